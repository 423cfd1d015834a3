"""Input side of a job: resolve a user's input spec to a fixed, sorted list of files of one
format and stream them as deterministic units of work.

Formats (`FORMATS`; chosen by extension, or named): Parquet, JSON Lines and CSV (`lines.py`: a
malformed line is that row's error), OpenAI batch requests (`openai_batch.py`, JSON Lines named
`format = "openai"`), Arrow IPC / Feather, and a Hugging Face `save_to_disk` folder (its Arrow
stream files, in the order its `state.json` lists them). A directory or glob may not mix formats.

Contract: a unit is (file index, batch index) over the sorted file list and a fixed `batch_rows`;
batch b of a file holds rows [b * batch_rows, min((b + 1) * batch_rows, num_rows)), whatever the
file's row-group, record-batch or line layout, so the same input and batch size always give the
same units. Reading is streamed (Parquet: one row group's column chunks plus about two batches;
other formats: about one batch). A file that cannot be read yields one error unit instead of
rows; iteration goes on. A row that cannot be parsed (line formats) is in `Unit.row_errors`.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from k3batch.io import lines

# Glob magic in local paths. In URIs `?` starts a query string (s3://b/x?region=...), so there
# only `*` and `[` are glob characters.
_LOCAL_GLOB_CHARS = "*?["
_URI_GLOB_CHARS = "*["


@dataclass(frozen=True, slots=True)
class InputFile:
    path: str  # as understood by the filesystem returned with it (normalized)
    uri: str  # what the user would recognise (original URI form); for messages and manifests
    size_bytes: int
    index: int  # position in the sorted list; the `f` of a unit
    format: str = "parquet"  # one of FORMATS except "auto"; how the file is read


@dataclass(frozen=True, slots=True)
class Unit:
    file: InputFile
    batch_idx: int
    table: pa.Table | None  # rows of this batch; None if the file is corrupt or unreadable
    row_offset: int  # index of the first row of this batch within the file (batch_idx * batch_rows)
    error: str | None  # why table is None, naming the file
    # row index within the batch -> why that row cannot run ("line 7: malformed JSON: ...");
    # line formats only. Such a row's values in `table` are null or partial (an OpenAI custom_id).
    row_errors: dict[int, str] | None = None


# "auto": by extension. "hf": a Hugging Face save_to_disk folder (read as its Arrow files).
FORMATS = ("auto", "parquet", "jsonl", "csv", "arrow", "hf", "openai")
_EXTENSIONS = {  # longest suffix first where one ends another
    ".jsonl.gz": "jsonl",
    ".ndjson.gz": "jsonl",
    ".json.gz": "jsonl",
    ".csv.gz": "csv",
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",  # one object per line; a JSON array file is not read
    ".csv": "csv",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
_HF_STATE = "state.json"  # what marks a save_to_disk folder (with dataset_info.json)


def format_of(path: str) -> str | None:
    """The format a file's name says, or None: format_of("a/b.jsonl.gz") == "jsonl"."""
    name = path.lower()
    return next((fmt for ext, fmt in _EXTENSIONS.items() if name.endswith(ext)), None)


def _takes(fmt: str, path: str) -> bool:
    """Whether a listed file belongs to an input of format `fmt` ("auto": any known format)."""
    found = format_of(path)
    if fmt == "auto":
        return found is not None
    return found == ("jsonl" if fmt == "openai" else fmt)


def filesystem_from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, normalized path) for a local path (absolute or relative, no scheme) or any URI
    `pyarrow.fs.FileSystem.from_uri` understands. Raises ValueError naming `uri` if it cannot."""
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"expected a non-empty path or URI, got {uri!r}")
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # ArrowInvalid, OSError, ... depending on the scheme
        raise ValueError(f"cannot open {uri!r} as a filesystem URI: {e}") from e
    return fs, path


def _is_hidden(rel_path: str) -> bool:
    """True if any component of a relative path starts with '.' or '_' (_SUCCESS, .crc, ...)."""
    return any(part.startswith((".", "_")) for part in rel_path.split("/") if part)


def _split_glob(spec: str) -> tuple[str, str | None]:
    """Split `spec` into (base, pattern): base is the longest leading directory without glob
    characters; pattern is the rest, relative to base, or None if spec has no glob characters.
    A URI's query string stays on the base."""
    query = ""
    if "://" in spec:
        scheme, rest = spec.split("://", 1)
        head = scheme + "://"
        if "?" in rest:
            rest, query = rest.split("?", 1)
            query = "?" + query
        magic = _URI_GLOB_CHARS
    else:
        head, rest, magic = "", spec, _LOCAL_GLOB_CHARS
    first = min((i for i, c in enumerate(rest) if c in magic), default=None)
    if first is None:
        return spec, None
    slash = rest.rfind("/", 0, first)
    if head and slash < 0:
        # e.g. s3://bucket*/x: the glob would be in the bucket or host name.
        raise ValueError(f"glob characters in the bucket or host of {spec!r} are not supported")
    if slash < 0:
        base, pattern = ".", rest
    else:
        base, pattern = rest[:slash] or "/", rest[slash + 1 :]
    return head + base + query, pattern


def _glob_match(pattern_parts: list[str], path_parts: list[str]) -> bool:
    """Match path components against glob components; `**` matches zero or more components."""
    if not pattern_parts:
        return not path_parts
    head, rest = pattern_parts[0], pattern_parts[1:]
    if head == "**":
        return any(_glob_match(rest, path_parts[i:]) for i in range(len(path_parts) + 1))
    return (
        bool(path_parts)
        and fnmatch.fnmatchcase(path_parts[0], head)
        and _glob_match(rest, path_parts[1:])
    )


def _uri_prefix(base_uri: str, base_path: str) -> str:
    """The string to prepend to a filesystem path to get back the user's URI form."""
    if "://" not in base_uri:
        return ""
    uri = base_uri.split("?", 1)[0].rstrip("/")
    if uri.endswith(base_path.rstrip("/")):
        return uri[: len(uri) - len(base_path.rstrip("/"))]
    # Percent-encoding or other rewriting: fall back to scheme://netloc.
    scheme, rest = uri.split("://", 1)
    netloc = rest.split("/", 1)[0]
    return f"{scheme}://{netloc}" if base_path.startswith("/") else f"{scheme}://"


def resolve_input(spec: str, format: str = "auto") -> tuple[pafs.FileSystem, list[InputFile]]:
    """Resolve an input spec to (filesystem, files sorted by path, indexed 0..n-1), all of one
    format.

    spec: a file; a directory (every file of a known extension under it, recursively; a Hugging
    Face save_to_disk folder: its Arrow files); a glob (`data/*.jsonl`, `data/**/part-*.parquet`);
    each as a local path or any URI pyarrow.fs understands (file://, s3://, gs://, hdfs://, ...).
    format: one of FORMATS; "auto" decides by extension (a glob's files of no known extension
    are Parquet, as before formats existed). Files or directories whose name starts with '.' or
    '_' below the base (metadata such as _SUCCESS) are skipped. Raises ValueError naming `spec`
    if it does not exist, nothing matches, its formats are mixed or a file's format is unknown.
    """
    if format not in FORMATS:
        raise ValueError(f"input.format = {format!r} must be one of {', '.join(FORMATS)}")
    base_uri, pattern = _split_glob(spec)
    fs, base_path = filesystem_from_uri(base_uri)
    if len(base_path) > 1:
        base_path = base_path.rstrip("/")
    prefix = _uri_prefix(base_uri, base_path)

    single_file = False
    try:
        if pattern is None:
            info = fs.get_file_info(base_path)
            if info.type == pafs.FileType.File:
                infos, single_file = [info], True
            elif info.type == pafs.FileType.Directory:
                hf = _hf_files(fs, base_path, format)
                if hf is not None:
                    return fs, [
                        InputFile(path=i.path, uri=prefix + i.path, size_bytes=int(i.size),
                                  index=idx, format="arrow")  # fmt: skip
                        for idx, i in enumerate(hf)
                    ]
                selector = pafs.FileSelector(base_path, recursive=True)
                infos = [
                    i
                    for i in fs.get_file_info(selector)
                    if i.type == pafs.FileType.File and _takes(format, i.path)
                ]
            else:
                raise ValueError(f"input {spec!r} does not exist")
        else:
            parts = [p for p in pattern.split("/") if p]
            recursive = len(parts) > 1 or "**" in parts
            selector = pafs.FileSelector(base_path, recursive=recursive, allow_not_found=True)
            infos = [
                i
                for i in fs.get_file_info(selector)
                if i.type == pafs.FileType.File
                and _glob_match(parts, _relative(i.path, base_path).split("/"))
            ]
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"cannot list input {spec!r}: {e}") from e

    if not single_file:  # a file named explicitly is taken even if its name starts with '_'
        infos = [i for i in infos if not _is_hidden(_relative(i.path, base_path))]
    if not infos:
        what = "files" if format == "auto" else f"{format} files"
        raise ValueError(f"input {spec!r} matches no {what}")
    infos.sort(key=lambda i: i.path)
    formats = [_file_format(i.path, format, spec, named=single_file) for i in infos]
    kinds = sorted(set(formats))
    if len(kinds) > 1:
        counts = ", ".join(f"{formats.count(k)} {k}" for k in kinds)
        raise ValueError(
            f"input {spec!r} mixes formats ({counts} files): one job reads one format; "
            f"narrow input.path or set input.format"
        )
    files = [
        InputFile(path=i.path, uri=prefix + i.path, size_bytes=int(i.size), index=idx, format=fmt)
        for idx, (i, fmt) in enumerate(zip(infos, formats))
    ]
    return fs, files


def _file_format(path: str, format: str, spec: str, *, named: bool) -> str:
    if format == "hf":
        return "arrow"
    if format != "auto":
        return format
    found = format_of(path)
    if found is None and named:
        raise ValueError(
            f"input {spec!r}: cannot tell the format from the file name; set input.format "
            f"(one of {', '.join(FORMATS[1:])})"
        )
    return found or "parquet"


def _hf_files(fs: pafs.FileSystem, folder: str, format: str) -> list[pafs.FileInfo] | None:
    """The Arrow files of a Hugging Face save_to_disk folder in its own order, or None if
    `folder` is not one (no state.json). ValueError for a DatasetDict folder (pick a split)."""
    if format not in ("auto", "hf", "arrow"):
        return None
    state_path = f"{folder}/{_HF_STATE}"
    if fs.get_file_info(state_path).type != pafs.FileType.File:
        if format == "hf":
            dict_path = f"{folder}/dataset_dict.json"
            if fs.get_file_info(dict_path).type == pafs.FileType.File:
                raise ValueError(f"input {folder!r} holds several splits: name one split's folder")
            raise ValueError(f"input {folder!r} has no {_HF_STATE}: not a save_to_disk folder")
        return None
    with fs.open_input_stream(state_path) as src:
        try:
            state = json.loads(src.read())
            names = [d["filename"] for d in state["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"input {folder!r}: unreadable {_HF_STATE}: {e}") from e
    infos = fs.get_file_info([f"{folder}/{n}" for n in names])
    missing = [i.path for i in infos if i.type != pafs.FileType.File]
    if missing:
        raise ValueError(f"input {folder!r}: {_HF_STATE} lists missing files {missing[:3]}")
    return infos


def _relative(path: str, base: str) -> str:
    if base in ("", "/"):
        return path.lstrip("/")
    return path[len(base) :].lstrip("/") if path.startswith(base) else path


def count_rows(fs: pafs.FileSystem, files: list[InputFile]) -> list[int | None]:
    """Row count of each file (Parquet: from its footer alone; other formats: a streamed pass);
    None for a file that cannot be read."""
    counts: list[int | None] = []
    for f in files:
        try:
            counts.append(scan_file(fs, f)[1])
        except Exception:  # corrupt footer, vanished file, permission, ...: reported as None
            counts.append(None)
    return counts


def scan_file(fs: pafs.FileSystem, f: InputFile) -> tuple[pa.Schema, int]:
    """(schema, row count) of a file, as its units will have them. Parquet reads the footer only;
    Arrow files read every record batch, line formats every line (streamed). Raises whatever
    reading raises."""
    if f.format == "parquet":
        with fs.open_input_file(f.path) as handle:
            meta = pq.ParquetFile(handle).metadata
            return meta.schema.to_arrow_schema(), meta.num_rows
    if f.format == "arrow":
        with fs.open_input_file(f.path) as handle:
            schema, batches = _ipc_batches(handle)
            return schema, sum(rb.num_rows for rb in batches)
    num_rows, columns = lines.scan(fs, f.path, f.format)
    return lines.schema_of(columns, f.format), num_rows


def iter_units(
    fs: pafs.FileSystem,
    files: list[InputFile],
    batch_rows: int,
    skip: Callable[[int, int], bool] = lambda f, b: False,
) -> Iterator[Unit]:
    """Stream the units of `files` in order: each file's batches of exactly `batch_rows` rows
    (the last batch of a file may be shorter; a file with no rows gives no units).

    skip(file_index, batch_idx) -> True drops that unit (already committed); row groups lying
    wholly inside skipped units are not read at all. Errors yield one Unit with table=None and
    `error` naming the file, then iteration goes on with the next file:
      - footer (or open) error: the unit is batch 0. `skip` applies: if batch 0 is committed the
        file yields nothing, so a file that was readable in an earlier run and is unreadable now
        is only visible through `count_rows` (None). Callers check completeness against it.
      - read error midway (a bad row group): one error unit, the first not-skipped batch with
        rows in the row group's unread part; every batch with rows there is lost for this run
        (named in `error`), and the file goes on with its next row group, so the units after a
        bad row group are still produced. In the other formats (no row groups to resume at)
        the rest of the file is lost for this run.
    """
    if not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be a positive int, got {batch_rows!r}")
    for f in files:
        if f.format == "parquet":
            yield from _iter_file_units(fs, f, batch_rows, skip)
        elif f.format == "arrow":
            yield from _iter_ipc_units(fs, f, batch_rows, skip)
        else:
            yield from _iter_line_units(fs, f, batch_rows, skip)


def _ipc_batches(handle) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """An Arrow IPC file (Feather v2) or stream (what save_to_disk writes): schema and batches."""
    try:
        reader = pa.ipc.open_file(handle)
    except pa.ArrowInvalid:  # no file footer: the stream format
        handle.seek(0)
        stream = pa.ipc.open_stream(handle)
        return stream.schema, iter(stream)
    return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))


def _iter_ipc_units(fs, f: InputFile, batch_rows: int, skip) -> Iterator[Unit]:
    try:
        handle = fs.open_input_file(f.path)
    except Exception as e:
        if not skip(f.index, 0):
            yield _error_unit(f, 0, batch_rows, "cannot open", e)
        return
    with handle:
        pending: list[pa.RecordBatch] = []
        pos = 0  # file row index of the next row
        try:
            _, batches = _ipc_batches(handle)
            for rb in batches:
                offset = 0
                while offset < rb.num_rows:
                    b = pos // batch_rows
                    take = min(rb.num_rows - offset, (b + 1) * batch_rows - pos)
                    if not skip(f.index, b):
                        pending.append(rb.slice(offset, take))
                    pos, offset = pos + take, offset + take
                    if pos % batch_rows == 0 and pending:
                        yield _table_unit(f, b, batch_rows, pa.Table.from_batches(pending))
                        pending = []
        except Exception as e:
            b = pos // batch_rows
            if not skip(f.index, b):
                yield _error_unit(f, b, batch_rows, f"read error at row {pos}", e)
            return
        if pending:
            b = (pos - 1) // batch_rows
            yield _table_unit(f, b, batch_rows, pa.Table.from_batches(pending))


def _iter_line_units(fs, f: InputFile, batch_rows: int, skip) -> Iterator[Unit]:
    """Units of a line format: every row of the file has the file's columns (a first pass lists
    them), so every batch of a file has one schema."""
    try:
        _, columns = lines.scan(fs, f.path, f.format)
    except Exception as e:
        if not skip(f.index, 0):
            yield _error_unit(f, 0, batch_rows, "cannot read", e)
        return
    pending: list = []
    row = 0
    try:
        records = lines.iter_records(
            fs, f.path, f.format, want=lambda r: not skip(f.index, r // batch_rows)
        )
        for rec in records:
            b = row // batch_rows
            if not skip(f.index, b):
                pending.append(rec)
            row += 1
            if row % batch_rows == 0 and pending:
                yield _records_unit(f, b, batch_rows, pending, columns)
                pending = []
    except Exception as e:
        b = row // batch_rows
        if not skip(f.index, b):
            yield _error_unit(f, b, batch_rows, f"read error after row {row}", e)
        return
    if pending:
        yield _records_unit(f, (row - 1) // batch_rows, batch_rows, pending, columns)


def _table_unit(f: InputFile, b: int, batch_rows: int, table: pa.Table) -> Unit:
    return Unit(file=f, batch_idx=b, table=table, row_offset=b * batch_rows, error=None)


def _records_unit(f: InputFile, b: int, batch_rows: int, records: list, columns) -> Unit:
    table, errors = lines.records_table(records, columns, f.format)
    return Unit(file=f, batch_idx=b, table=table, row_offset=b * batch_rows, error=None,
                row_errors=errors or None)  # fmt: skip


def _error_unit(f: InputFile, batch_idx: int, batch_rows: int, what: str, e: Exception) -> Unit:
    error = f"{f.uri}: {what}: {type(e).__name__}: {e}"
    return Unit(
        file=f, batch_idx=batch_idx, table=None, row_offset=batch_idx * batch_rows, error=error
    )


def _iter_file_units(
    fs: pafs.FileSystem, f: InputFile, batch_rows: int, skip: Callable[[int, int], bool]
) -> Iterator[Unit]:
    try:
        handle = fs.open_input_file(f.path)
    except Exception as e:
        if not skip(f.index, 0):
            yield _error_unit(f, 0, batch_rows, "cannot open", e)
        return
    with handle:
        try:
            pf = pq.ParquetFile(handle)
            meta = pf.metadata
            rg_rows = [meta.row_group(r).num_rows for r in range(meta.num_row_groups)]
            num_rows = meta.num_rows
            if sum(rg_rows) != num_rows:
                raise ValueError(f"row groups hold {sum(rg_rows)} rows, footer says {num_rows}")
        except Exception as e:
            # The row count is unknown, so the error is always reported as unit 0; once that is
            # committed the file yields nothing more.
            if not skip(f.index, 0):
                yield _error_unit(f, 0, batch_rows, "cannot read Parquet footer", e)
            return
        yield from _rechunk(pf, f, rg_rows, num_rows, batch_rows, skip)


def _rechunk(
    pf: pq.ParquetFile,
    f: InputFile,
    rg_rows: list[int],
    num_rows: int,
    batch_rows: int,
    skip: Callable[[int, int], bool],
) -> Iterator[Unit]:
    """Read the needed row groups one at a time and cut their rows into exact batches."""
    num_batches = -(-num_rows // batch_rows)
    wanted = [not skip(f.index, b) for b in range(num_batches)]

    pending: list[pa.RecordBatch] = []  # rows of the batch being assembled, in order
    pos = 0  # file row index of the next row to arrive
    rg_start = 0
    for r, n in enumerate(rg_rows):
        rg_end = rg_start + n
        first_b, last_b = rg_start // batch_rows, (rg_end - 1) // batch_rows
        if n == 0 or not any(wanted[first_b : last_b + 1]):
            rg_start = rg_end
            continue
        # A wanted batch never straddles a skipped row group, so rows of a partly assembled
        # batch always continue exactly where this row group starts.
        assert not pending or pos == rg_start, (f.uri, r, pos, rg_start)
        pos = rg_start
        reader = pf.iter_batches(batch_size=batch_rows, row_groups=[r])
        while True:
            try:
                rb = next(reader, None)
                if rb is not None and pos + rb.num_rows > rg_end:
                    raise ValueError(f"row group {r} yields more than its {n} rows")
                if rb is None and pos != rg_end:
                    raise ValueError(f"row group {r} ended after {pos - rg_start} of {n} rows")
            except Exception as e:
                # Every wanted batch with rows in this row group's unread part is lost (reported
                # once, as its first); the file goes on with the next row group.
                lost = [b for b in range(pos // batch_rows, last_b + 1) if wanted[b]]
                if lost:
                    what = (
                        f"read error at row {pos} (row group {r}, rows {rg_start}-{rg_end - 1}; "
                        f"batches {lost[0]}-{lost[-1]} skipped)"
                    )
                    yield _error_unit(f, lost[0], batch_rows, what, e)
                for b in lost:
                    wanted[b] = False
                pending = []
                break
            if rb is None:
                break
            offset = 0  # within rb
            while offset < rb.num_rows:
                b = pos // batch_rows
                b_end = min((b + 1) * batch_rows, num_rows)
                take = min(rb.num_rows - offset, b_end - pos)
                if wanted[b]:
                    assert pending or pos == b * batch_rows, (f.uri, b, pos)
                    pending.append(rb.slice(offset, take))
                    if pos + take == b_end:
                        table = pa.Table.from_batches(pending)
                        pending = []
                        yield Unit(
                            file=f, batch_idx=b, table=table, row_offset=b * batch_rows, error=None
                        )
                pos += take
                offset += take
        rg_start = rg_end
    assert not pending, (f.uri, pos, num_rows)
