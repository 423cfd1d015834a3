"""k3batch.io.sink and k3batch.io.manifest: atomic shard commits, temp cleanup, duplicate
refusal, and the manifest rules that make a resume safe. CPU only, under tmp_path."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3batch.io.manifest import MANIFEST_NAME, Manifest, open_manifest
from k3batch.io.resolve import resolve_input
from k3batch.io.sink import ShardSink, shard_name


def rows(*ids: int) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "out": [f"o{i}" for i in ids]})


# --- sink ------------------------------------------------------------------------------------


def test_shard_name_padded_and_sortable():
    assert shard_name(3, 12) == "part-f00003-b000012.parquet"
    names = [shard_name(f, b) for f, b in [(0, 10), (0, 9), (1, 0), (0, 100)]]
    assert sorted(names) == [
        shard_name(0, 9),
        shard_name(0, 10),
        shard_name(0, 100),
        shard_name(1, 0),
    ]
    with pytest.raises(ValueError, match="-1"):
        shard_name(-1, 0)


def test_sink_write_commit_round_trip(tmp_path):
    out = tmp_path / "out" / "nested"  # created on demand
    sink = ShardSink(str(out))
    assert sink.path == str(out) and out.is_dir()
    assert sink.committed() == set()
    path = sink.write(0, 1, rows(10, 11))
    assert path == str(out / "part-f00000-b000001.parquet")
    sink.write(0, 0, rows(0, 1))
    sink.write(2, 0, rows(20))
    assert sink.committed() == {(0, 0), (0, 1), (2, 0)}
    assert pq.read_table(path).equals(rows(10, 11))
    assert sink.read_all().column("id").to_pylist() == [0, 1, 10, 11, 20]  # unit order
    # Nothing but the shards is left behind (no temp files, no probe).
    assert sorted(p.name for p in out.iterdir()) == sorted(
        shard_name(f, b) for f, b in [(0, 0), (0, 1), (2, 0)]
    )
    # A new sink on the same directory (a resumed run) sees the same commits.
    assert ShardSink(f"file://{out}").committed() == {(0, 0), (0, 1), (2, 0)}


def test_sink_cleans_up_temp_leftovers(tmp_path):
    sink = ShardSink(str(tmp_path))
    sink.write(0, 0, rows(1))
    # What a run killed mid-write leaves: a temp shard, a temp JSON; plus unrelated files.
    (tmp_path / f".{shard_name(0, 1)}.abc123.tmp").write_bytes(b"PAR1 half a shard")
    (tmp_path / f".{MANIFEST_NAME}.def456.tmp").write_bytes(b"{")
    (tmp_path / "README.txt").write_text("keep me")
    (tmp_path / "part-f00000-b000002.parquet.bak").write_text("keep me")
    assert sink.committed() == {(0, 0)}
    assert sink.cleanup_temp() == 2
    assert sink.cleanup_temp() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [shard_name(0, 0), "README.txt", "part-f00000-b000002.parquet.bak"]
    )
    assert sink.read_all().column("id").to_pylist() == [1]


def test_sink_double_write_asserts(tmp_path):
    sink = ShardSink(str(tmp_path))
    sink.write(1, 3, rows(1))
    with pytest.raises(AssertionError, match="duplicate"):
        sink.write(1, 3, rows(2))
    assert sink.read_all().column("id").to_pylist() == [1]  # the first commit is intact


def test_sink_read_all_unifies_schemas(tmp_path):
    sink = ShardSink(str(tmp_path))
    assert sink.read_all().num_rows == 0
    sink.write(0, 0, pa.table({"id": pa.array([1], pa.int32()), "out": ["a"]}))
    sink.write(0, 1, pa.table({"id": pa.array([2], pa.int64()), "error": ["boom"]}))
    table = sink.read_all()
    assert table.schema.field("id").type == pa.int64()
    assert table.to_pydict() == {"id": [1, 2], "out": ["a", None], "error": [None, "boom"]}


def test_sink_json_atomic_round_trip(tmp_path):
    sink = ShardSink(str(tmp_path))
    assert sink.read_json("report.json") is None
    sink.write_json("report.json", {"done": 1})
    sink.write_json("report.json", {"done": 2, "nested": {"a": [1, 2]}})
    assert sink.read_json("report.json") == {"done": 2, "nested": {"a": [1, 2]}}
    assert sink.committed() == set()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    with pytest.raises(ValueError, match="a/b"):
        sink.write_json("a/b", {})


def test_sink_unwritable_output_names_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for bad in [blocker / "out", blocker]:
        with pytest.raises(ValueError) as info:
            ShardSink(str(bad))
        assert str(bad) in str(info.value)


# --- manifest --------------------------------------------------------------------------------


def make_input(tmp_path, names=("a.parquet", "b.parquet")):
    root = tmp_path / "in"
    root.mkdir(exist_ok=True)
    for i, name in enumerate(names):
        pq.write_table(rows(i, i + 100), root / name)
    return root


def test_manifest_new_then_resume_keeps_original_files(tmp_path):
    root = make_input(tmp_path)
    sink = ShardSink(str(tmp_path / "out"))
    _, files = resolve_input(str(root))
    desc = {"model": "k3-debug", "input": str(root), "sampling": {"temperature": 0.0}}
    manifest, got = open_manifest(
        sink, fingerprint="fp1", description=desc, files=files, batch_rows=64
    )
    assert got == files
    assert (manifest.job_fingerprint, manifest.batch_rows, manifest.version) == ("fp1", 64, 1)
    assert manifest.input_files == [
        {"uri": f.uri, "path": f.path, "size_bytes": f.size_bytes} for f in files
    ]
    on_disk = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert Manifest.from_dict(on_disk, where="test") == manifest

    # Resume after a new file appeared in the input, with another batch size asked for: the
    # recorded file list and batch size win.
    sink.write(0, 0, rows(0))
    pq.write_table(rows(7), root / "a0_new.parquet")
    _, files_now = resolve_input(str(root))
    assert len(files_now) == 3
    resumed, got = open_manifest(
        ShardSink(str(tmp_path / "out")),
        fingerprint="fp1",
        description=desc,
        files=files_now,
        batch_rows=8,
    )
    assert resumed == manifest and resumed.batch_rows == 64
    assert got == files
    assert [f.index for f in got] == [0, 1]


def test_manifest_different_job_refused(tmp_path):
    root = make_input(tmp_path)
    sink = ShardSink(str(tmp_path / "out"))
    _, files = resolve_input(str(root))
    desc = {"model": "k3-debug", "sampling": {"temperature": 0.0, "max_tokens": 16}}
    open_manifest(sink, fingerprint="fp1", description=desc, files=files, batch_rows=64)
    other = {"model": "k3-debug", "sampling": {"temperature": 0.7, "max_tokens": 16}, "seed": 1}
    with pytest.raises(ValueError) as info:
        open_manifest(sink, fingerprint="fp2", description=other, files=files, batch_rows=64)
    msg = str(info.value)
    assert "different job" in msg and "another output dir" in msg
    assert "sampling.temperature: 0.0 there, 0.7 now" in msg
    assert "seed: (unset) there, 1 now" in msg
    assert "model" not in msg.split("differing settings:")[1]  # only differing keys are shown


def test_manifest_shards_without_manifest_refused(tmp_path):
    root = make_input(tmp_path)
    sink = ShardSink(str(tmp_path / "out"))
    sink.write(0, 0, rows(1))
    _, files = resolve_input(str(root))
    with pytest.raises(ValueError, match="no _k3batch_manifest.json"):
        open_manifest(sink, fingerprint="fp1", description={}, files=files, batch_rows=64)
    assert sink.read_json(MANIFEST_NAME) is None


def test_manifest_input_changed_refused(tmp_path):
    root = make_input(tmp_path)
    sink = ShardSink(str(tmp_path / "out"))
    _, files = resolve_input(str(root))
    open_manifest(sink, fingerprint="fp1", description={}, files=files, batch_rows=64)

    pq.write_table(rows(*range(50)), root / "b.parquet")  # rewritten, different size
    _, files_now = resolve_input(str(root))
    with pytest.raises(ValueError, match="b.parquet changed size"):
        open_manifest(sink, fingerprint="fp1", description={}, files=files_now, batch_rows=64)

    (root / "a.parquet").unlink()
    _, files_now = resolve_input(str(root))
    with pytest.raises(ValueError, match="a.parquet .*missing"):
        open_manifest(sink, fingerprint="fp1", description={}, files=files_now, batch_rows=64)


def test_manifest_malformed_refused(tmp_path):
    sink = ShardSink(str(tmp_path))
    sink.write_json(MANIFEST_NAME, {"job_fingerprint": "fp1"})
    with pytest.raises(ValueError, match="malformed manifest .*missing keys"):
        open_manifest(sink, fingerprint="fp1", description={}, files=[], batch_rows=64)
