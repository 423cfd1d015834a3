"""Which row of an id runs: the first occurrence in input order, always, whatever the order in
which units commit and however often the job is resumed.

`IdIndex` maps each id to the position of its first occurrence (file index << 40 | row), built
at the start of every run by one pass over the id column of the valid input files (nothing else
is read, committed shards never). It lives in a SQLite file in a local temp directory, so the
driver's memory stays bounded (SQLite's page cache, `cache_mb`) at any number of ids. A row runs
iff its position is its id's first position; every other row of that id gets a duplicate error.
"""

import logging
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from k3batch.io import InputFile, iter_units

log = logging.getLogger(__name__)

_ROW_BITS = 40  # rows per file < 2**40
_LOOKUP_CHUNK = 900  # ids per SELECT (below SQLite's bound on bound parameters)
_OTHER_BATCH_ROWS = 8192  # rows read at a time from a file that is not Parquet


def position(file_index: int, row: int) -> int:
    """The input-order position of row `row` of file `file_index`."""
    return (file_index << _ROW_BITS) | row


def id_strings(column: pa.ChunkedArray | pa.Array) -> list[str | None]:
    """Ids as strings (None for null): the one conversion used for indexing and for lookups."""
    try:
        return pc.cast(column, pa.string()).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return [None if v is None else str(v) for v in column.to_pylist()]


class IdIndex:
    """First position of every id of the input (see the module docstring)."""

    def __init__(self, *, cache_mb: int = 64):
        self._dir = tempfile.mkdtemp(prefix="k3batch-ids-")
        self._db = sqlite3.connect(os.path.join(self._dir, "ids.sqlite"))
        self._db.execute("PRAGMA journal_mode = OFF")
        self._db.execute("PRAGMA synchronous = OFF")
        self._db.execute(f"PRAGMA cache_size = {-1024 * cache_mb}")  # negative: KiB
        self._db.execute("CREATE TABLE first (id TEXT PRIMARY KEY, pos INTEGER) WITHOUT ROWID")
        self.num_rows = 0

    def add(self, ids: Iterable[str | None], positions: Iterable[int]) -> None:
        """Record ids at positions, in input order: an id seen before keeps its first position."""
        rows = [(i, p) for i, p in zip(ids, positions) if i is not None]
        self._db.executemany("INSERT OR IGNORE INTO first VALUES (?, ?)", rows)
        self.num_rows += len(rows)

    def first_positions(self, ids: list[str]) -> dict[str, int]:
        """{id: first position} for the given ids (ids never indexed are left out)."""
        out: dict[str, int] = {}
        unique = list(dict.fromkeys(ids))
        for s in range(0, len(unique), _LOOKUP_CHUNK):
            chunk = unique[s : s + _LOOKUP_CHUNK]
            marks = ",".join("?" * len(chunk))
            out.update(self._db.execute(f"SELECT id, pos FROM first WHERE id IN ({marks})", chunk))
        return out

    def close(self) -> None:
        self._db.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    @classmethod
    def build(cls, fs: pafs.FileSystem, files: list[InputFile], id_column: str) -> "IdIndex":
        """Index the id column of `files` (the valid ones, in input order), row group by row
        group. A row group that cannot be read is left out: its rows never run in this run
        (the unit reader reports them), so they cannot be anyone's first occurrence."""
        index = cls()
        try:
            for f in files:
                try:
                    index._add_file(fs, f, id_column)
                except Exception as e:  # vanished since the survey: the unit reader reports it
                    log.warning("%s: ids unreadable: %s", f.uri, e)
            index._db.commit()
        except BaseException:
            index.close()
            raise
        return index

    def _add_file(self, fs: pafs.FileSystem, f: InputFile, id_column: str) -> None:
        if f.format != "parquet":  # no row groups to read one column of: the rows, streamed
            for unit in iter_units(fs, [f], _OTHER_BATCH_ROWS):
                if unit.table is not None and id_column in unit.table.schema.names:
                    col = unit.table.column(id_column)
                    self.add(id_strings(col), range(position(f.index, unit.row_offset), 1 << 62))
            return
        with fs.open_input_file(f.path) as handle:
            pf = pq.ParquetFile(handle)
            start = 0
            for r in range(pf.metadata.num_row_groups):
                try:
                    col = pf.read_row_group(r, columns=[id_column]).column(0)
                except Exception as e:  # corrupt row group: reported when read as a unit
                    log.warning("%s: ids of row group %d unreadable: %s", f.uri, r, e)
                else:
                    self.add(id_strings(col), range(position(f.index, start), 1 << 62))
                start += pf.metadata.row_group(r).num_rows
