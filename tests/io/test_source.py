"""k3batch.io.source: input resolution, footer row counts, exact deterministic units, corrupt
files, bounded memory. CPU only, tiny Parquet files under tmp_path."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3batch.io.resolve import resolve_input
from k3batch.io.source import count_rows, iter_units

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_rows(path: Path, num_rows: int, *, start: int = 0, row_group_size: int | None = None):
    """A Parquet file whose `id` column is start .. start + num_rows - 1."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = list(range(start, start + num_rows))
    table = pa.table({"id": pa.array(ids, pa.int64()), "prompt": [f"p{i}" for i in ids]})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def ids_of(units) -> list[int]:
    return [i for u in units for i in u.table.column("id").to_pylist()]


# --- resolve_input ---------------------------------------------------------------------------


def test_resolve_input_single_file(tmp_path):
    p = write_rows(tmp_path / "a.parquet", 3)
    fs, files = resolve_input(str(p))
    assert [(f.path, f.uri, f.index) for f in files] == [(str(p), str(p), 0)]
    assert files[0].size_bytes == p.stat().st_size
    assert fs.get_file_info(files[0].path).size == files[0].size_bytes


def test_resolve_input_relative_path(tmp_path, monkeypatch):
    write_rows(tmp_path / "d" / "a.parquet", 3)
    monkeypatch.chdir(tmp_path)
    _, files = resolve_input("d")
    assert [f.path for f in files] == [str(tmp_path / "d" / "a.parquet")]


def test_resolve_input_directory_recursive_sorted_skips_metadata(tmp_path):
    root = tmp_path / "in"
    for rel in ["b.parquet", "a.parquet", "sub/c.parquet", "sub/deeper/a.parquet"]:
        write_rows(root / rel, 2)
    for rel in [
        "_SUCCESS",
        ".hidden.parquet",
        "_meta.parquet",
        "notes.txt",
        "_temporary/x.parquet",
        ".cache/y.parquet",
    ]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"not parquet")
    _, files = resolve_input(str(root))
    rels = [os.path.relpath(f.path, root) for f in files]
    assert rels == ["a.parquet", "b.parquet", "sub/c.parquet", "sub/deeper/a.parquet"]
    assert [f.index for f in files] == [0, 1, 2, 3]


def test_resolve_input_glob(tmp_path):
    root = tmp_path / "in"
    for rel in ["x1.parquet", "x2.parquet", "y.parquet", "sub/x3.parquet", "_x0.parquet"]:
        write_rows(root / rel, 1)
    _, files = resolve_input(str(root / "x*.parquet"))
    assert [os.path.basename(f.path) for f in files] == ["x1.parquet", "x2.parquet"]
    _, files = resolve_input(str(root / "**" / "x*.parquet"))
    assert [os.path.relpath(f.path, root) for f in files] == [
        "sub/x3.parquet",
        "x1.parquet",
        "x2.parquet",
    ]
    _, files = resolve_input(str(root / "*" / "x?.parquet"))
    assert [os.path.relpath(f.path, root) for f in files] == ["sub/x3.parquet"]


def test_resolve_input_file_uri_keeps_uri_form(tmp_path):
    root = tmp_path / "in"
    write_rows(root / "a.parquet", 1)
    write_rows(root / "b.parquet", 1)
    for spec in [f"file://{root}", f"file://{root}/", f"file://{root}/*.parquet"]:
        _, files = resolve_input(spec)
        assert [f.path for f in files] == [str(root / "a.parquet"), str(root / "b.parquet")]
        assert [f.uri for f in files] == [f"file://{root}/a.parquet", f"file://{root}/b.parquet"]


@pytest.mark.parametrize("rel", ["missing", "missing/*.parquet", "in/*.csv", "in/zzz*"])
def test_resolve_input_nothing_matches_names_spec(tmp_path, rel):
    write_rows(tmp_path / "in" / "a.parquet", 1)
    spec = str(tmp_path / rel)
    with pytest.raises(ValueError, match="matches no|does not exist") as info:
        resolve_input(spec)
    assert spec in str(info.value)


def test_resolve_input_empty_dir_and_bad_uri(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        resolve_input(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="nosuchscheme"):
        resolve_input("nosuchscheme://bucket/x.parquet")


# --- count_rows ------------------------------------------------------------------------------


def test_count_rows_from_footers_none_for_corrupt(tmp_path):
    write_rows(tmp_path / "a.parquet", 25, row_group_size=7)
    (tmp_path / "b.parquet").write_bytes(b"garbage" * 100)
    write_rows(tmp_path / "c.parquet", 0)
    fs, files = resolve_input(str(tmp_path))
    assert count_rows(fs, files) == [25, None, 0]


# --- iter_units ------------------------------------------------------------------------------


def test_iter_units_exact_sizes_across_uneven_row_groups(tmp_path):
    write_rows(tmp_path / "a.parquet", 53, row_group_size=7)
    write_rows(tmp_path / "b.parquet", 20, start=1000, row_group_size=20)
    fs, files = resolve_input(str(tmp_path))
    units = list(iter_units(fs, files, batch_rows=10))
    assert [(u.file.index, u.batch_idx, u.table.num_rows, u.row_offset) for u in units] == [
        (0, 0, 10, 0),
        (0, 1, 10, 10),
        (0, 2, 10, 20),
        (0, 3, 10, 30),
        (0, 4, 10, 40),
        (0, 5, 3, 50),
        (1, 0, 10, 0),
        (1, 1, 10, 10),
    ]
    assert all(u.error is None for u in units)
    assert ids_of(units) == list(range(53)) + list(range(1000, 1020))
    for u in units:  # every unit holds exactly its rows
        assert u.table.column("id")[0].as_py() == u.row_offset + (1000 if u.file.index else 0)
    # Deterministic: the same numbering and contents again, and with another batch size the
    # same rows in the same order.
    again = list(iter_units(fs, files, batch_rows=10))
    key = [(u.file.index, u.batch_idx) for u in units]
    assert [(u.file.index, u.batch_idx) for u in again] == key
    assert all(a.table.equals(b.table) for a, b in zip(units, again))
    assert ids_of(iter_units(fs, files, batch_rows=3)) == ids_of(units)


def test_iter_units_batch_larger_than_file(tmp_path):
    write_rows(tmp_path / "a.parquet", 5, row_group_size=2)
    fs, files = resolve_input(str(tmp_path))
    units = list(iter_units(fs, files, batch_rows=100))
    assert [(u.batch_idx, u.table.num_rows) for u in units] == [(0, 5)]
    with pytest.raises(ValueError, match="batch_rows"):
        list(iter_units(fs, files, batch_rows=0))


def test_iter_units_skip(tmp_path):
    write_rows(tmp_path / "a.parquet", 53, row_group_size=7)
    write_rows(tmp_path / "b.parquet", 30, start=100, row_group_size=30)
    fs, files = resolve_input(str(tmp_path))
    full = {(u.file.index, u.batch_idx): u.table for u in iter_units(fs, files, 10)}
    done = {(0, 0), (0, 2), (0, 3), (0, 5), (1, 1)}
    units = list(iter_units(fs, files, 10, skip=lambda f, b: (f, b) in done))
    assert [(u.file.index, u.batch_idx) for u in units] == sorted(full.keys() - done)
    for u in units:
        assert u.table.equals(full[(u.file.index, u.batch_idx)])
    assert list(iter_units(fs, files, 10, skip=lambda f, b: True)) == []


def test_iter_units_skip_does_not_read_skipped_row_groups(tmp_path):
    # Row groups of 10 = batches of 10: corrupting row group 1 must not matter once unit 1 is
    # committed, because row groups wholly inside skipped units are never read.
    path = write_rows(tmp_path / "a.parquet", 30, row_group_size=10)
    _corrupt_row_group(path, 1)
    fs, files = resolve_input(str(path))
    units = list(iter_units(fs, files, 10, skip=lambda f, b: b == 1))
    assert [(u.batch_idx, u.error) for u in units] == [(0, None), (2, None)]
    assert ids_of(units) == list(range(10)) + list(range(20, 30))


def _corrupt_row_group(path: Path, rg: int) -> None:
    """Overwrite the start of row group `rg`'s first column chunk with garbage."""
    meta = pq.ParquetFile(path).metadata.row_group(rg).column(0)
    offset = meta.dictionary_page_offset or meta.data_page_offset
    data = bytearray(path.read_bytes())
    data[offset : offset + 32] = b"\xff" * 32
    path.write_bytes(bytes(data))


def test_iter_units_corrupt_files_between_good_ones(tmp_path):
    write_rows(tmp_path / "a.parquet", 25, row_group_size=7)
    (tmp_path / "b.parquet").write_bytes(os.urandom(500))  # garbage with a .parquet name
    good = write_rows(tmp_path / "tmp_c_src.parquet", 40)
    (tmp_path / "c.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    good.unlink()
    write_rows(tmp_path / "d.parquet", 12, start=500, row_group_size=5)
    fs, files = resolve_input(str(tmp_path))
    assert [os.path.basename(f.path) for f in files] == [
        "a.parquet",
        "b.parquet",
        "c.parquet",
        "d.parquet",
    ]
    units = list(iter_units(fs, files, batch_rows=10))
    errors = [u for u in units if u.table is None]
    assert [(u.file.index, u.batch_idx, u.row_offset) for u in errors] == [(1, 0, 0), (2, 0, 0)]
    assert "b.parquet" in errors[0].error and "c.parquet" in errors[1].error
    good_units = [u for u in units if u.table is not None]
    assert [(u.file.index, u.batch_idx) for u in good_units] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (3, 0),
        (3, 1),
    ]
    assert ids_of(good_units) == list(range(25)) + list(range(500, 512))
    # A committed error unit is not yielded again, and a footer error is only ever unit 0.
    again = list(iter_units(fs, files, 10, skip=lambda f, b: (f, b) == (1, 0)))
    assert [(u.file.index, u.batch_idx) for u in again if u.table is None] == [(2, 0)]


def test_iter_units_read_error_midway(tmp_path):
    """A bad row group costs the batches with rows in it, not the rest of the file (issue 11,
    defect 4). Fails with the old `return` after the first read error: units 8 and 9 missing."""
    path = write_rows(tmp_path / "a.parquet", 200, row_group_size=50)
    _corrupt_row_group(path, 2)  # rows 100..149
    write_rows(tmp_path / "b.parquet", 5, start=900)
    fs, files = resolve_input(str(tmp_path))
    assert count_rows(fs, files) == [200, 5]  # the footer is intact
    units = list(iter_units(fs, files, batch_rows=20))
    # batches 5, 6 lie in row group 2, batch 7 (rows 140..159) straddles it: all three lost
    assert [(u.file.index, u.batch_idx, u.table is None) for u in units] == [
        (0, 0, False),
        (0, 1, False),
        (0, 2, False),
        (0, 3, False),
        (0, 4, False),
        (0, 5, True),
        (0, 8, False),
        (0, 9, False),
        (1, 0, False),
    ]
    err = units[5]
    assert err.row_offset == 100 and "a.parquet" in err.error and "row 100" in err.error
    assert "batches 5-7" in err.error
    assert ids_of(units[6:8]) == list(range(160, 200))
    # Resuming with batch 5 committed reports the next not-committed batch of the bad region.
    units = list(iter_units(fs, files, 20, skip=lambda f, b: f == 0 and b <= 5))
    assert [(u.file.index, u.batch_idx, u.table is None) for u in units] == [
        (0, 6, True),
        (0, 8, False),
        (0, 9, False),
        (1, 0, False),
    ]


def test_iter_units_bounded_memory(tmp_path):
    """200k rows read with batch_rows=1000: Arrow's peak allocation stays far below the file's
    decoded size. Measured in a fresh process (the pool's peak is process-wide), importing only
    k3batch.io (the top-level package would import torch)."""
    path = tmp_path / "big.parquet"
    num_rows = 200_000
    table = pa.table(
        {
            "id": pa.array(range(num_rows), pa.int64()),
            "prompt": [f"prompt number {i} " + "x" * (i % 50) for i in range(num_rows)],
        }
    )
    pq.write_table(table, path, row_group_size=10_000)
    decoded_bytes = table.nbytes
    del table
    script = textwrap.dedent(f"""
        import sys, types
        pkg = types.ModuleType("k3batch")
        pkg.__path__ = [{str(REPO_ROOT / "k3batch")!r}]
        sys.modules["k3batch"] = pkg  # skip k3batch/__init__.py (imports torch)
        import pyarrow as pa
        from k3batch.io.resolve import resolve_input
        from k3batch.io.source import iter_units
        fs, files = resolve_input({str(path)!r})
        num_rows = num_units = 0
        for unit in iter_units(fs, files, batch_rows=1000):
            assert unit.table.num_rows == 1000, unit
            num_rows += unit.table.num_rows
            num_units += 1
        print(num_rows, num_units, pa.default_memory_pool().max_memory())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got_rows, got_units, peak_bytes = map(int, out.stdout.split())
    assert (got_rows, got_units) == (num_rows, 200)
    assert peak_bytes < decoded_bytes / 4, (peak_bytes, decoded_bytes)
