"""Output side of a job: a directory of committed Parquet shards, one per unit of work.

Contract: shard `part-fFFFFF-bBBBBBB.parquet` exists iff unit (file index, batch index) is done.
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

from k3batch.io.source import filesystem_from_uri

_SHARD_RE = re.compile(r"^part-f(\d+)-b(\d+)\.parquet$")
_TEMP_SUFFIX = ".tmp"  # temp names are ".<final name>.<random>.tmp", hidden from dataset readers


def shard_name(file_index: int, batch_idx: int) -> str:
    """Committed shard name of a unit, zero-padded so names sort in unit order:
    shard_name(3, 12) == "part-f00003-b000012.parquet"."""
    if file_index < 0 or batch_idx < 0:
        raise ValueError(f"negative unit index: file_index={file_index}, batch_idx={batch_idx}")
    return f"part-f{file_index:05d}-b{batch_idx:06d}.parquet"


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
        """Atomically commit `table` as the shard of unit (file_index, batch_idx); returns the
        final path. Raises AssertionError if that shard is already committed (a duplicate)."""
        final = self._join(shard_name(file_index, batch_idx))
        if self.fs.get_file_info(final).type != pafs.FileType.NotFound:
            raise AssertionError(
                f"shard {final} already committed: writing unit ({file_index}, {batch_idx}) "
                f"again would duplicate its rows"
            )
        self._commit(final, lambda out: pq.write_table(table, out))
        return final

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


def _check_side_name(name: str) -> None:
    if not name or "/" in name or _SHARD_RE.match(name) or _is_temp(name):
        raise ValueError(f"invalid side-file name {name!r}: a plain name, not a shard or temp")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
