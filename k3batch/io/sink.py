"""Output side of a job: a directory of committed shards, one per unit of work (Parquet, or JSON
Lines for `output.format` jsonl and openai), and the merged file of a finished job.

Contract: shard `part-fFFFFF-bBBBBBB.<parquet|jsonl>` exists iff unit (file index, batch index)
is done (one job writes one extension: the format is part of its fingerprint).
A shard is written under a hidden temp name in the same directory and then renamed, so it is
never visible half-written: rename(2) is atomic on local POSIX filesystems and on HDFS; object
stores (S3, GCS) have no rename, pyarrow copies then deletes, and since an object only becomes
visible once complete, the final name still appears all at once. A run killed mid-write leaves
only temp files, which `cleanup_temp` removes. One job (one writer per shard) per directory.
"""

from __future__ import annotations

import json
import os
import re
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from k3batch.io.resolve import filesystem_from_uri

_SHARD_RE = re.compile(r"^part-f(\d+)-b(\d+)\.(parquet|jsonl)$")
_TEMP_SUFFIX = ".tmp"  # temp names are ".<final name>.<random>.tmp", hidden from dataset readers


def shard_name(file_index: int, batch_idx: int, ext: str = "parquet") -> str:
    """Committed shard name of a unit, zero-padded so names sort in unit order:
    shard_name(3, 12) == "part-f00003-b000012.parquet"."""
    if file_index < 0 or batch_idx < 0:
        raise ValueError(f"negative unit index: file_index={file_index}, batch_idx={batch_idx}")
    return f"part-f{file_index:05d}-b{batch_idx:06d}.{ext}"


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(_TEMP_SUFFIX)


class ShardSink:
    """Output directory of committed shards (see the module docstring for the contract).

    Attributes: `fs` (pyarrow filesystem), `path` (the directory as `fs` understands it),
    `uri` (the output as given, for messages).
    """

    def __init__(self, output: str):
        self.uri = output
        self.fs, self.path = filesystem_from_uri(output)
        if len(self.path) > 1:
            self.path = self.path.rstrip("/")
        self._is_local = isinstance(self.fs, pafs.LocalFileSystem)
        try:
            info = self.fs.get_file_info(self.path)
            if info.type == pafs.FileType.File:
                raise ValueError(f"output {output!r} is a file, not a directory")
            self.fs.create_dir(self.path, recursive=True)
            # Probe: an unwritable directory should fail now, not after the first batch.
            probe = self._join(f".k3batch-probe.{uuid.uuid4().hex}{_TEMP_SUFFIX}")
            with self.fs.open_output_stream(probe) as out:
                out.write(b"probe")
            self.fs.delete_file(probe)
        except ValueError:
            raise
        except Exception as e:  # OSError, ArrowInvalid, ... depending on the filesystem
            raise ValueError(f"output {output!r} cannot be created or written: {e}") from e

    def _join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def _list_names(self) -> list[str]:
        selector = pafs.FileSelector(self.path, recursive=False, allow_not_found=True)
        return [
            i.base_name for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File
        ]

    def committed(self) -> set[tuple[int, int]]:
        """(file_index, batch_idx) of every committed shard; other files are ignored."""
        done = set()
        for name in self._list_names():
            m = _SHARD_RE.match(name)
            if m:
                done.add((int(m.group(1)), int(m.group(2))))
        return done

    def cleanup_temp(self) -> int:
        """Delete temp files left by a killed run; returns how many. Call only while no other
        process writes to this directory."""
        names = [n for n in self._list_names() if _is_temp(n)]
        for name in names:
            self.fs.delete_file(self._join(name))
        return len(names)

    def _commit(self, final: str, write_temp) -> None:
        """Write through `write_temp(stream)` to a temp file beside `final`, then rename."""
        tmp = self._join(f".{final.rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:12]}{_TEMP_SUFFIX}")
        try:
            with self.fs.open_output_stream(tmp) as out:
                write_temp(out)
            if self._is_local:
                _fsync_path(tmp)  # data on disk before the name says "done" (power loss)
            self.fs.move(tmp, final)
            if self._is_local:
                _fsync_path(self.path)  # the rename itself
        except BaseException:
            try:
                self.fs.delete_file(tmp)
            except Exception:
                pass  # never created or already moved; cleanup_temp catches the rest
            raise

    def write(self, file_index: int, batch_idx: int, table: pa.Table) -> str:
        """Atomically commit `table` as the Parquet shard of unit (file_index, batch_idx);
        returns the final path. Raises AssertionError if that shard is already committed (a
        duplicate)."""
        final = self._new_shard(file_index, batch_idx, "parquet")
        self._commit(final, lambda out: pq.write_table(table, out))
        return final

    def write_lines(self, file_index: int, batch_idx: int, lines: list[dict]) -> str:
        """Atomically commit `lines` (one JSON object each) as the JSON Lines shard of unit
        (file_index, batch_idx); as `write` otherwise."""
        final = self._new_shard(file_index, batch_idx, "jsonl")
        data = b"".join(_json_line(x) for x in lines)
        self._commit(final, lambda out: out.write(data))
        return final

    def _new_shard(self, file_index: int, batch_idx: int, ext: str) -> str:
        if (file_index, batch_idx) in self._committed_unit(file_index, batch_idx):
            raise AssertionError(
                f"shard of unit ({file_index}, {batch_idx}) already committed in {self.uri}: "
                f"writing it again would duplicate its rows"
            )
        return self._join(shard_name(file_index, batch_idx, ext))

    def _committed_unit(self, file_index: int, batch_idx: int) -> set:
        paths = [self._join(shard_name(file_index, batch_idx, e)) for e in ("parquet", "jsonl")]
        infos = self.fs.get_file_info(paths)
        return {(file_index, batch_idx)} if any(
            i.type != pafs.FileType.NotFound for i in infos
        ) else set()  # fmt: skip

    def shard_paths(self) -> list[str]:
        """Paths of the committed shards in unit order."""
        names = sorted(n for n in self._list_names() if _SHARD_RE.match(n))
        return [self._join(n) for n in names]

    def merge(self, name: str) -> str:
        """Atomically write every committed shard, in unit order, as the one file `name` beside
        them (JSON Lines shards: concatenated; Parquet: one file, row groups per shard, schemas
        unified). Streams one shard at a time. Returns the path."""
        _check_side_name(name)
        paths = self.shard_paths()
        if name.endswith(".jsonl"):
            def write_temp(out):
                for p in paths:
                    with self.fs.open_input_stream(p) as src:
                        while chunk := src.read(1 << 20):
                            out.write(chunk)
        else:
            schemas = [pq.read_schema(p, filesystem=self.fs) for p in paths]
            schema = pa.unify_schemas(schemas, promote_options="permissive")

            def write_temp(out):
                with pq.ParquetWriter(out, schema) as w:
                    for p in paths:
                        t = pq.read_table(p, filesystem=self.fs)
                        for f in schema:  # a column some shards lack is null there
                            if f.name not in t.schema.names:
                                t = t.append_column(f.name, pa.nulls(t.num_rows, f.type))
                        w.write_table(t.select(schema.names).cast(schema))
        path = self._join(name)
        self._commit(path, write_temp)
        return path

    def read_all(self) -> pa.Table:
        """All committed shards concatenated in unit order, schemas unified permissively (a
        column missing from some shards becomes null there). For tests and small outputs."""
        units = sorted(self.committed())
        if not units:
            return pa.table({})
        tables = [pq.read_table(self._join(shard_name(f, b)), filesystem=self.fs) for f, b in units]
        return pa.concat_tables(tables, promote_options="permissive")

    def write_json(self, name: str, obj: dict) -> None:
        """Atomically write `obj` as JSON file `name` beside the shards (replacing it)."""
        _check_side_name(name)
        data = json.dumps(obj, indent=2, sort_keys=False).encode() + b"\n"
        self._commit(self._join(name), lambda out: out.write(data))

    def read_json(self, name: str) -> dict | None:
        """The JSON file `name` beside the shards, or None if it does not exist."""
        _check_side_name(name)
        path = self._join(name)
        if self.fs.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        with self.fs.open_input_stream(path) as src:
            raw = src.read()
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


def _json_line(obj: dict) -> bytes:
    # default=str: values JSON has no type for (dates, bytes of a binary column) as their text
    return json.dumps(obj, ensure_ascii=False, default=str).encode() + b"\n"


def _check_side_name(name: str) -> None:
    if not name or "/" in name or _SHARD_RE.match(name) or _is_temp(name):
        raise ValueError(f"invalid side-file name {name!r}: a plain name, not a shard or temp")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
