"""A job always ends: a replica that fails the same way every time stops the job with its cause
(issue 50), one that fails once and then works does not, and rows are never lost or duplicated.

Each test runs a real k3-mini replica with a planted fault (`driver.fake.FaultyReplica`) or a
real fault (a truncated checkpoint shard) on the shared local Ray head, and is bounded in time:
a job that does not end fails the test. Before issue 50 a replica that exits its process on
every start was judged a lost node ("unavailable") and moved forever, uncharged; these jobs did
not end. Each test prints the time to the job's end, its exit status and the cause as printed.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3batch.driver import run_job
from k3batch.driver.fake import FaultyReplica
from k3batch.driver.health import CrashLoopError
from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaSpec
from k3batch.engine.request import SamplingParams
from k3batch.io import shard_name
from k3batch.testing import truncated_checkpoint

END_S = 240  # every job here ends well within this (a few replica starts on a 2-core machine)
FAILURES = 2  # replicas.max_consecutive_failures of these jobs


def _spec(model_dir, tmp: Path, name: str, rows: int = 6) -> JobSpec:
    inp = tmp / "in.parquet"
    prompts = [" ".join(["kimi", "linear"][: 1 + i % 2] * (1 + i % 3)) for i in range(rows)]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": prompts}), inp)
    return JobSpec(
        model=model_dir,
        name=name,
        input=InputSpec(path=str(inp), batch_rows=2),
        output=OutputSpec(path=str(tmp / "out")),
        sampling=SamplingParams(temperature=0, max_new_tokens=3),
        replicas=ReplicaSpec(device="cpu", max_inflight_rows=4, max_retries=3,
                             max_consecutive_failures=FAILURES, wait_timeout_s=120.0),  # fmt: skip
        engine=EngineConfig(max_seq_len=64, chunk_size=16),
    )


def _stops(spec: JobSpec, **fault) -> tuple[CrashLoopError, float]:
    t0 = time.monotonic()
    with pytest.raises(CrashLoopError) as e:
        run_job(spec, replica_cls=FaultyReplica, replica_kw=fault)
    took = time.monotonic() - t0
    print(f"\n{fault}: stopped after {took:.1f} s: {str(e.value).splitlines()[0]}")
    assert took < END_S
    return e.value, took


def _report(spec: JobSpec) -> dict:
    return json.loads((Path(spec.output.path) / "_k3batch_report.json").read_text())


def test_replica_that_raises_at_build_stops_the_job_with_its_cause(cluster, mini_model_dir,
                                                                   tmp_path):  # fmt: skip
    spec = _spec(mini_model_dir, tmp_path, "build-fails")
    err, _ = _stops(spec, fault="build")
    assert err.failures == FAILURES and err.cause["type"] == "RuntimeError"
    assert "planted: this replica cannot be built" in err.cause["message"]
    assert "fake.py" in err.cause["traceback"]  # the replica's own traceback, not Ray's words
    report = _report(spec)
    assert report["error"]["kind"] == "crash_loop"
    assert "planted: this replica cannot be built" in report["error"]["message"]
    assert report["rows_written"] == 0 and len(report["missing"]) == 1


def test_replica_whose_forward_raises_stops_the_job_with_its_cause(cluster, mini_model_dir,
                                                                   tmp_path):  # fmt: skip
    spec = _spec(mini_model_dir, tmp_path, "forward-fails")
    err, _ = _stops(spec, fault="forward")
    assert err.cause["type"] == "RuntimeError" and "illegal memory access" in err.cause["message"]
    assert "faulty_step" in err.cause["traceback"]
    assert _report(spec)["error"]["traceback"] == err.cause["traceback"]


def test_replica_that_exits_at_a_step_every_time_stops_the_job(cluster, mini_model_dir, tmp_path):
    spec = _spec(mini_model_dir, tmp_path, "exits")
    err, _ = _stops(spec, fault="exit", at_step=2)
    assert err.failures == FAILURES
    # no Python error to report: what Ray says of the vanished process
    assert err.cause["type"] in ("ActorUnavailableError", "ActorDiedError"), err.cause
    assert _report(spec)["replica_moves"] == {}  # its node never went away: nothing moved


def test_replica_that_exits_once_then_works_finishes_every_row_once(cluster, mini_model_dir,
                                                                    tmp_path):  # fmt: skip
    spec = _spec(mini_model_dir, tmp_path, "exits-once")
    t0 = time.monotonic()
    report = run_job(spec, replica_cls=FaultyReplica,
                     replica_kw={"fault": "exit_once", "at_step": 2,
                                 "marker": str(tmp_path / "exited")})  # fmt: skip
    took = time.monotonic() - t0
    print(f"\nexit once: the job ended after {took:.1f} s, complete: {report.is_complete}")
    assert (tmp_path / "exited").exists() and took < END_S
    assert report.is_complete and report.error is None and report.replica_failures == 1
    rows = pq.read_table(spec.output.path).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"r{i}" for i in range(6)]
    assert all(r["error"] is None for r in rows)


def test_truncated_checkpoint_shard_ends_the_job_naming_the_shard_error(mini_model_dir, cluster,
                                                                       tmp_path):  # fmt: skip
    """A real fault, through the command line: the largest shard cut short, as a broken
    download leaves it. Exit status 1, the safetensors error printed by the driver."""
    ckpt = truncated_checkpoint(mini_model_dir, tmp_path / "ckpt")
    spec = _spec(str(ckpt), tmp_path, "truncated")
    job = tmp_path / "job.toml"
    job.write_text(f"""
name = "truncated"
model = "{ckpt}"
[input]
path = "{spec.input.path}"
[output]
path = "{spec.output.path}"
[replicas]
device = "cpu"
max_consecutive_failures = {FAILURES}
""")
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "k3batch.cli", "run", str(job), "--address", cluster.gcs_address],
        capture_output=True, text=True, timeout=END_S,
    )  # fmt: skip
    took = time.monotonic() - t0
    last = res.stderr.strip().splitlines()[-1]
    print(f"\ntruncated shard: exit {res.returncode} after {took:.1f} s; {last}")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "a crash loop, so the job stops" in res.stderr
    assert "SafetensorError" in res.stderr, res.stderr[-3000:]
    assert "incomplete metadata" in res.stderr
    assert "SafetensorError" in _report(spec)["error"]["type"]


def test_a_rerun_after_a_crash_loop_resumes_without_duplicates(cluster, mini_model_dir, tmp_path):
    """Rows committed before the crash loop stay; the rerun (fault gone) writes only the rest."""
    spec = _spec(mini_model_dir, tmp_path, "resume")
    first = run_job(spec)  # a healthy run, then as if its last unit had been in flight
    assert first.is_complete
    (Path(spec.output.path) / shard_name(0, 2)).unlink()
    _stops(spec, fault="forward")
    again = run_job(spec)
    assert again.is_complete and again.rows_written == 2 and again.rows_skipped_resumed == 4
    ids = [r["id"] for r in pq.read_table(spec.output.path).to_pylist()]
    assert sorted(ids) == [f"r{i}" for i in range(6)]
