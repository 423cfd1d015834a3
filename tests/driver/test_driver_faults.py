"""Driver faults of issue 11 on the shared local Ray head, with an instant fake replica (no
model): schema drift (3), silent loss on resume (4), duplicate ids after resume (5), bounded
waits (6), the output lease (7), a resume that reads no committed shard (9), slow rows (11).

Each test fails on the code before issue 11 (checked with its real replica in place of the
fake, as the old `run_job` had no `replica_cls`): schema drift crashed the driver (KeyError:
'Field "id" does not exist'); the earlier row of an id was flagged as the duplicate, so x had no
completion (`[] == ['first x']`); the resume read a committed shard and died on it
(ArrowInvalid); the rerun over a file unreadable now exited without an account of the lost rows.
The tests that need the new API (lease, bounded waits, fake replica options) fail on the old
code because it had none of it. Marked `slow`: the multi-job cases whose logic the no-Ray
tests also cover.
"""

import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import k3batch.driver.replicas as replicas_mod
from k3batch.driver import run_job
from k3batch.driver.fake import FakeReplica
from k3batch.engine.request import SamplingParams
from k3batch.io import LeaseHeldError, OutputLease, ShardSink, shard_name
from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaSpec


def _spec(model_dir, inp, out, **kw) -> JobSpec:
    return JobSpec(
        model=model_dir,
        name=kw.pop("name", "faults"),
        input=InputSpec(path=str(inp), batch_rows=kw.pop("batch_rows", 2)),
        output=OutputSpec(path=str(out)),
        sampling=SamplingParams(temperature=0, max_new_tokens=2),
        replicas=ReplicaSpec(
            device=kw.pop("device", "cpu"),
            max_inflight_rows=kw.pop("inflight", 4),
            wait_timeout_s=kw.pop("wait_timeout_s", 120.0),
        ),
        engine=EngineConfig(max_seq_len=128),
    )


def _run(spec, **replica_kw):
    return run_job(spec, replica_cls=FakeReplica, replica_kw=replica_kw)


def _write(path, **cols):
    pq.write_table(pa.table(cols), path)


def _rows(out) -> dict:
    return {(r["id"]): r for r in pq.read_table(out).to_pylist()}


def test_schema_drift_skips_the_bad_files_and_runs_the_rest(cluster, mini_model_dir, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    _write(inp / "0.parquet", id=["a0", "a1"], prompt=["hi there", "kimi"])
    _write(inp / "1-no-prompt.parquet", id=["b0"], text=["x"])
    _write(inp / "2-no-id.parquet", prompt=["x"])
    _write(inp / "3-int-ids.parquet", id=[7], prompt=["x"])
    _write(inp / "4-int-prompt.parquet", id=["d0"], prompt=[5])
    _write(inp / "5-clash.parquet", id=["e0"], prompt=["x"], error=["y"])
    _write(inp / "6.parquet", id=["f0", "f1", "f2"], prompt=["a", "b", "c"])
    report = _run(_spec(mini_model_dir, inp, tmp_path / "out"))
    assert sorted(_rows(tmp_path / "out")) == ["a0", "a1", "f0", "f1", "f2"]
    assert all(r["error"] is None for r in _rows(tmp_path / "out").values())
    bad = report.unreadable_inputs
    assert len(bad) == 5, bad
    for name, why in [
        ("1-no-prompt", "no prompt column"),
        ("2-no-id", "id type none"),
        ("3-int-ids", "id type 'integer'"),
        ("4-int-prompt", "prompt type 'integer'"),
        ("5-clash", "clash with output columns"),
    ]:
        assert any(name in b and why in b for b in bad), (name, bad)
    assert not report.is_complete
    assert sorted(os.path.basename(m["file"]) for m in report.missing) == sorted(
        f"{n}.parquet" for n in ["1-no-prompt", "2-no-id", "3-int-ids", "4-int-prompt", "5-clash"]
    )
    assert all(m["rows"] == 1 for m in report.missing)


@pytest.mark.slow  # the fast subset: tests/driver/test_driver_inputs.py, test_driver_stream.py
def test_rerun_names_rows_lost_to_a_file_unreadable_now(cluster, mini_model_dir, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    _write(inp / "a.parquet", id=["a0", "a1", "a2", "a3"], prompt=["p"] * 4)
    _write(inp / "b.parquet", id=["b0", "b1", "b2", "b3"], prompt=["q"] * 4)
    spec = _spec(mini_model_dir, inp, tmp_path / "out")
    first = _run(spec)
    assert first.is_complete and first.rows_written == 8
    # b's second unit is lost (as if the first run died before it) and b turns unreadable,
    # same size: its first unit is committed, so the old reader yielded nothing at all.
    (tmp_path / "out" / shard_name(1, 1)).unlink()
    size = (inp / "b.parquet").stat().st_size
    (inp / "b.parquet").write_bytes(b"\0" * size)
    again = _run(spec)
    assert again.rows_written == 0 and not again.is_complete
    (miss,) = again.missing
    assert miss["file"].endswith("b.parquet") and miss["rows"] == 2 and miss["batches"] == [1]
    assert "cannot read Parquet footer" in miss["why"][0]
    assert "INCOMPLETE" in again.summary() and "b.parquet: 2 rows" in again.summary()


def test_first_occurrence_runs_even_when_its_duplicate_committed_first(
    cluster, mini_model_dir, tmp_path
):
    inp = tmp_path / "in"
    inp.mkdir()
    _write(inp / "a.parquet", id=["x", "y"], prompt=["first x", "y"])
    _write(inp / "b.parquet", id=["z", "x"], prompt=["z", "second x"])
    spec = _spec(mini_model_dir, inp, tmp_path / "out")
    _run(spec)
    # As if the driver died after committing b's unit but before a's: the rerun must still run
    # a's x (the first occurrence) and keep b's x as the duplicate.
    (tmp_path / "out" / shard_name(0, 0)).unlink()
    report = _run(spec)
    assert report.rows_written == 2 and report.is_complete
    rows = pq.read_table(tmp_path / "out").to_pylist()
    xs = [r for r in rows if r["id"] == "x"]
    assert [r["prompt"] for r in xs if r["error"] is None] == ["first x"]
    assert [r["prompt"] for r in xs if r["error"] is not None] == ["second x"]
    assert "duplicate id 'x' (first at file 0 row 0)" in [r["error"] for r in xs if r["error"]]


def test_resume_reads_no_committed_shard(cluster, mini_model_dir, tmp_path):
    inp = tmp_path / "in.parquet"
    _write(inp, id=[f"r{i}" for i in range(6)], prompt=["p"] * 6)
    spec = _spec(mini_model_dir, inp, tmp_path / "out")
    _run(spec)
    (tmp_path / "out" / shard_name(0, 0)).write_bytes(b"not parquet: a resume never reads it")
    (tmp_path / "out" / shard_name(0, 2)).unlink()
    report = _run(spec)
    assert report.rows_written == 2 and report.rows_skipped_resumed == 4 and report.is_complete


def test_second_driver_on_one_output_is_refused(cluster, mini_model_dir, tmp_path):
    _write(tmp_path / "in.parquet", prompt=["p"])
    spec = _spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out")
    with OutputLease(ShardSink(str(tmp_path / "out")), job="the-other-job", settle_s=0):
        with pytest.raises(LeaseHeldError, match="in use by job 'the-other-job'"):
            _run(spec)
    assert _run(spec).is_complete  # released: the next driver goes ahead


def test_unplaceable_job_fails_after_wait_timeout_naming_resources(
    cluster, mini_model_dir, tmp_path
):
    _write(tmp_path / "in.parquet", prompt=["p"])
    spec = _spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out", device="cuda",
                 wait_timeout_s=3.0)  # fmt: skip  # the test cluster has no GPU
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"waited 3 s .*'GPU': 1"):
        _run(spec)
    assert time.monotonic() - t0 < 30


def test_statistics_of_a_hung_replica_do_not_hang_the_end(
    cluster, mini_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(replicas_mod, "STATS_TIMEOUT_S", 1.0)
    _write(tmp_path / "in.parquet", prompt=["p", "q"])
    t0 = time.monotonic()
    spec = _spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out")
    report = _run(spec, stats_delay_s=600)
    assert report.is_complete and report.rows_written == 2 and report.rows_per_replica == []
    assert time.monotonic() - t0 < 60


@pytest.mark.slow  # the fast subset: tests/driver/test_driver_inputs.py, test_driver_stream.py
def test_slow_row_does_not_hold_back_the_rest(cluster, mini_model_dir, tmp_path):
    n = 16
    _write(tmp_path / "in.parquet", id=[f"r{i}" for i in range(n)], prompt=["p"] * n,
           max_new_tokens=[300] + [1] * (n - 1))  # fmt: skip  # row 0: 3 s, the rest: 10 ms
    report = _run(_spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out"), token_s=0.01)
    assert report.is_complete and report.peak_inflight_rows <= 4
    out = tmp_path / "out"
    mtime = {b: (out / shard_name(0, b)).stat().st_mtime for b in range(n // 2)}
    assert max(mtime, key=mtime.get) == 0  # every other unit committed before the slow one's


@pytest.mark.slow  # the fast subset: tests/driver/test_driver_inputs.py, test_driver_stream.py
def test_killed_replica_rows_are_retried_on_the_stream(cluster, mini_model_dir, tmp_path):
    """The streaming path's retry: a replica killed mid-job (Ray restarts it) loses its rows in
    flight; they are resubmitted, stale results are dropped, every id is written once."""
    import threading

    import ray

    n = 40
    _write(tmp_path / "in.parquet", id=[f"r{i}" for i in range(n)], prompt=["p"] * n)
    spec = _spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out", name="kill-fake")
    spec = spec.__class__(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__},
                             "replicas": ReplicaSpec(num_replicas=2, device="cpu",
                                                     max_inflight_rows=4)})  # fmt: skip

    def killer():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor("kill-fake/replica-0")
                ray.get(actor.ready.remote(), timeout=30)
                time.sleep(1.0)
                ray.kill(actor, no_restart=False)
                return
            except ValueError:
                time.sleep(0.1)

    t = threading.Thread(target=killer)
    t.start()
    t0 = time.monotonic()
    report = _run(spec, token_s=0.5)  # 2 tokens: 1 s per row, 4 at a time per replica: 5 s
    t.join()
    assert report.is_complete and report.replica_failures >= 1
    assert sorted(_rows(tmp_path / "out")) == sorted(f"r{i}" for i in range(n))
    assert time.monotonic() - t0 < 120
