"""Input side of a job: stream the files `io.resolve.resolve_input` found as deterministic
units of work. Parquet, Arrow IPC (and a Hugging Face folder's Arrow files) are read here; JSON
Lines, CSV and OpenAI batch requests by `lines.py` (a malformed line is that row's error).

Contract: a unit is (file index, batch index) over the sorted file list and a fixed `batch_rows`;
batch b of a file holds rows [b * batch_rows, min((b + 1) * batch_rows, num_rows)), whatever the
file's row-group, record-batch or line layout, so the same input and batch size always give the
same units. Reading is streamed (Parquet: one row group's column chunks plus about two batches;
other formats: about one batch). A file that cannot be read yields one error unit instead of
rows; iteration goes on. A row that cannot be parsed (line formats) is in `Unit.row_errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from k3batch.io import lines
from k3batch.io.resolve import InputFile


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
