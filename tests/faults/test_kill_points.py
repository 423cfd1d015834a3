"""Fault injection into a pp = 2, tp = 2 job on the shared local Ray head (CPU, k3-debug).

At random points of the job one process is SIGKILLed: the replica coordinator, a prefill stage,
a decode rank or the driver (then the job is rerun). Every id must be written exactly once, the
greedy tokens must equal an uninterrupted run's, and no run may hang (each is a subprocess with a
time limit). The slow test makes 20 kills and prints a table (kill point, victim, rows redone,
wall time; benchmarks/faults_pp2_tp2_cpu.txt); one decode-rank kill mid-job (about 2 min) is
slow too. The default suite's kills are in test_group_health.py and tests/driver/test_job.py.

Victims are found through Ray's state API (class name and job, never by process name: other
Ray sessions may share the machine) and killed with SIGKILL, as a crash or the OOM killer would.

Tokens are compared bit for bit, so the jobs decode one sequence at a time (max_num_seqs = 1; see
tests/driver/test_job.py: batched fp32 math is not batch-invariant).
"""

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray.util.state import list_actors

from fault_jobs import start_job, write_job

from k3batch.model.weights import init_checkpoint

NUM_ROWS = 12
# One run of the job, kills and rebuilds included; a run that takes longer has hung. Generous:
# a rebuild starts five processes that import torch, minutes on a loaded 2-core machine.
RUN_TIMEOUT_S = 900
VICTIM_CLASSES = {"replica": "ReplicaActor", "prefill": "PrefillStageActor",
                  "decode": "DecodeRankActor"}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kill") / "k3-debug"
    init_checkpoint("k3-debug", path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "kimi", "linear", "attention", "batch"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(12)]
    path = tmp_path_factory.mktemp("kill_in") / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(NUM_ROWS)], "prompt": prompts}), path)
    return path


def _finish(proc: subprocess.Popen, deadline: float) -> int:
    try:
        return proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"a run of the job did not finish within {RUN_TIMEOUT_S} s (hung)")


def _rows(out: Path) -> list[dict]:
    return pq.read_table(out, columns=["id", "output_token_ids", "error"]).to_pylist()


def _committed(out: Path) -> int:
    return sum(pq.read_metadata(p).num_rows for p in out.glob("*.parquet")) if out.is_dir() else 0


def _alive(cls: str, job_name: str, address: str) -> list:
    """ALIVE actors of `cls` that belong to the job whose replica is named job_name/replica-0
    (Ray at `address`: other Ray instances may run on this machine)."""
    replicas = list_actors(
        address=address,
        filters=[("name", "=", f"{job_name}/replica-0"), ("state", "=", "ALIVE")],
        raise_on_missing_output=False,
    )
    if not replicas:
        return []
    if cls == "ReplicaActor":
        return replicas
    return list_actors(
        address=address,
        filters=[
            ("class_name", "=", cls),
            ("state", "=", "ALIVE"),
            ("job_id", "=", replicas[0].job_id),
        ],
        raise_on_missing_output=False,
    )


@dataclass
class KillResult:
    victim: str
    round: int  # output directory: kills left when a job ends go to a new round
    point_s: float  # seconds into the run when the kill landed
    committed_at_kill: int  # rows committed (this round, all runs so far) at the kill
    retried_at_kill: int  # rows the driver had resubmitted so far (this round's log)
    at: float = 0.0  # time.monotonic() of the kill
    redone: int | None = None  # rows resubmitted because of this kill (None: driver kill)
    wall_s: float = 0.0  # from this kill to the next one or to the end of its round


def _retried(log: Path) -> int:
    """Rows the driver resubmitted so far: its "...; retrying N rows" warnings."""
    text = log.read_text() if log.exists() else ""
    return sum(int(m) for m in re.findall(r"; retrying (\d+) rows", text))


def run_with_kills(tmp, model_dir, inp, head, name, victims, delays,
                   progress: str | None = None) -> tuple[list, list[Path]]:  # fmt: skip
    """Run the pp = 2, tp = 2 job and SIGKILL victims[i] delays[i] seconds after the job is
    working again (a new replica process alive: rebuilt after the previous kill); after a
    driver kill, rerun. Kills left when the job ends go to a new round (a fresh output
    directory). Rows redone by a member kill are the rows the driver reports retrying until
    the next kill; a driver kill loses its open units' rows, which the rerun generates again
    (no report: shown as "-")."""
    results: list[KillResult] = []
    outs = []
    while len(results) < len(victims):
        rnd = len(outs)
        job = write_job(tmp, model_dir, inp, f"{name}-{rnd}")
        out, log = tmp / job.stem, job.with_suffix(".log")
        outs.append(out)
        proc, t_run = start_job(job, head.gcs_address), time.monotonic()
        up_since = None  # when a new replica process was first seen alive since the last kill
        old_pid = None  # the replica process at the last kill: it goes down with it
        while proc.poll() is None:
            assert time.monotonic() - t_run < RUN_TIMEOUT_S, f"a run of the job hung: {log}"
            time.sleep(0.2)
            i = len(results)
            if i == len(victims):
                continue
            if up_since is None:
                replicas = _alive("ReplicaActor", job.stem, head.gcs_address)
                if replicas and replicas[0].pid != old_pid:
                    up_since, old_pid = time.monotonic(), replicas[0].pid
                continue
            if time.monotonic() - up_since < delays[i]:
                continue
            if victims[i] == "driver":
                pid = proc.pid
            else:
                actors = _alive(VICTIM_CLASSES[victims[i]], job.stem, head.gcs_address)
                if not actors:
                    continue
                pid = random.Random(i).choice(actors).pid
            kill = KillResult(victims[i], rnd, 0.0, _committed(out), _retried(log))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kill.at = time.monotonic()
            up_since = None
            kill.point_s = kill.at - t_run
            results.append(kill)
            if progress is not None:
                with open(progress, "a") as f:
                    f.write(f"{len(results) - 1} {kill}\n")
            if victims[i] == "driver":
                _finish(proc, t_run + RUN_TIMEOUT_S)
                proc, t_run = start_job(job, head.gcs_address), time.monotonic()
        assert proc.returncode == 0, log.read_text()[-3000:]
        mine = [r for r in results if r.round == rnd]
        ends = [(n.at, n.retried_at_kill) for n in mine[1:]] + [(time.monotonic(), _retried(log))]
        for r, (t_next, retried_next) in zip(mine, ends):
            r.wall_s = t_next - r.at
            if r.victim != "driver":
                r.redone = retried_next - r.retried_at_kill
    return results, outs


def check_output(out: Path, ref: dict) -> None:
    rows = _rows(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(ref), "each id exactly once"
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    bad = [r["id"] for r in rows if r["output_token_ids"] != ref[r["id"]]]
    assert not bad, f"tokens differ from the uninterrupted run for {bad}"


def reference(tmp, model_dir, inp, head) -> dict:
    """The uninterrupted single-device run (tests/driver/test_job.py: pp/tp runs equal it
    exactly)."""
    job = write_job(tmp, model_dir, inp, "ref", pp=1, tp=1)
    rc = _finish(start_job(job, head.gcs_address), time.monotonic() + RUN_TIMEOUT_S)
    assert rc == 0, job.with_suffix(".log").read_text()[-3000:]
    return {r["id"]: r["output_token_ids"] for r in _rows(tmp / "ref")}


def format_table(results: list[KillResult]) -> str:
    lines = [
        f"{'#':>3} {'victim':>8} {'round':>5} {'kill at s':>9} {'committed':>9} "
        f"{'rows redone':>11} {'wall s':>7}"
    ]
    for i, r in enumerate(results):
        redone = "-" if r.redone is None else str(r.redone)
        lines.append(
            f"{i:>3} {r.victim:>8} {r.round:>5} {r.point_s:>9.1f} {r.committed_at_kill:>9} "
            f"{redone:>11} {r.wall_s:>7.1f}"
        )
    return "\n".join(lines)


@pytest.mark.slow  # ~2 min of a 5-process replica; the default suite kills in test_group_health
def test_killed_decode_rank_is_rebuilt_exactly_once(cluster, model_dir, job_input, tmp_path):
    """The fast subset: one decode rank killed as soon as it is up (test_group_health.py kills
    stages and ranks of an idle replica)."""
    ref = reference(tmp_path, model_dir, job_input, cluster)
    results, outs = run_with_kills(
        tmp_path, model_dir, job_input, cluster, "fast", ["decode"], [0.0]
    )
    print("\n" + format_table(results))
    for out in outs:
        check_output(out, ref)


@pytest.mark.slow
def test_twenty_random_kill_points(cluster, model_dir, job_input, tmp_path):
    """20 kills at random points, victims in turn (replica, prefill, decode, driver)."""
    ref = reference(tmp_path, model_dir, job_input, cluster)
    rng = random.Random(11)
    victims = [("replica", "prefill", "decode", "driver")[i % 4] for i in range(20)]
    delays = [rng.uniform(1.0, 20.0) for _ in victims]
    t0 = time.monotonic()
    progress = os.environ.get("K3_FAULTS_TABLE")
    results, outs = run_with_kills(
        tmp_path, model_dir, job_input, cluster, "kill", victims, delays,
        progress=progress and progress + ".partial",
    )  # fmt: skip
    for out in outs:
        check_output(out, ref)
    table = (
        f"20 kills in a pp = 2, tp = 2 job of {NUM_ROWS} rows, {len(outs)} round(s), "
        f"{time.monotonic() - t0:.0f} s in all\n" + format_table(results)
    )
    print("\n" + table)
    if os.environ.get("K3_FAULTS_TABLE"):
        Path(os.environ["K3_FAULTS_TABLE"]).write_text(table + "\n")
