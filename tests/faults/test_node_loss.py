"""Node loss on a `ray.cluster_utils.Cluster` (a head that runs nothing, two worker nodes, each
big enough for one pp = 2, tp = 2 replica): the node that holds the replica is removed mid-job;
Ray re-places the replica's placement groups on the other node, the replica is rebuilt there
(coordinator, prefill stages, decode ranks) and its rows are retried. Every id is written
exactly once, with the tokens of an uninterrupted run. With no node left to rebuild on, the job
waits for resources at most `replicas.wait_timeout_s`, then fails saying so.

Slow (two clusters, several replica builds on a 2-core machine). This module starts its own
cluster: it must not share a process with the `cluster` fixture's driver, so it skips when
Ray is already connected.
"""

import json
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
from ray.util.state import list_actors

from fault_jobs import start_job, write_job

from k3batch.model.weights import init_checkpoint
from k3batch.testing.simcluster import multinode_cluster

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 400
NODE_CPUS = 6  # one replica (coordinator, 2 stages, 2 ranks) and a tokenize task


@pytest.fixture
def two_node_cluster():
    if ray.is_initialized():
        pytest.skip("Ray is already connected in this process (run this module on its own)")
    with multinode_cluster(0, dashboard=True) as cluster:
        workers = [cluster.add_node(num_cpus=NODE_CPUS) for _ in range(2)]
        ray.init(address=cluster.address)
        try:
            yield cluster, workers
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("node") / "k3-debug"
    init_checkpoint("k3-debug", path, seed=0)
    return str(path)


def _job(tmp: Path, model_dir: str, name: str, wait_timeout_s: float = 600) -> Path:
    import pyarrow as pa

    inp = tmp / "in.parquet"
    if not inp.exists():
        prompts = [" ".join(["kimi", "linear", "attention", "batch"][: 1 + i % 4] * (1 + i % 3))
                   for i in range(10)]  # fmt: skip
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(10)], "prompt": prompts}), inp)
    return write_job(tmp, model_dir, inp, name, max_retries=3, wait_timeout_s=wait_timeout_s)


def _wait(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the job did not end within {timeout_s} s")


def _replica(name: str, address: str):
    found = list_actors(
        address=address,
        filters=[("name", "=", f"{name}/replica-0"), ("state", "=", "ALIVE")],
        raise_on_missing_output=False,
    )
    return found[0] if found else None


def _remove_replica_node(cluster, workers, name: str, out: Path, deadline: float) -> str:
    """Once the job has committed a shard, remove the node its replica runs on."""
    while time.monotonic() < deadline:
        replica = _replica(name, cluster.address)
        if replica is not None and out.is_dir() and any(out.glob("*.parquet")):
            node = next(w for w in workers if w.node_id == replica.node_id)
            cluster.remove_node(node, allow_graceful=False)
            return replica.node_id
        time.sleep(0.3)
    pytest.fail("the job committed nothing in time")


def test_node_loss_rebuilds_the_replica_on_the_other_node(two_node_cluster, model_dir, tmp_path):
    cluster, workers = two_node_cluster
    ref_job = _job(tmp_path, model_dir, "ref")
    assert _wait(start_job(ref_job, cluster.address), RUN_TIMEOUT_S) == 0, ref_job.with_suffix(
        ".log"
    ).read_text()[-3000:]
    ref = {r["id"]: r["output_token_ids"] for r in pq.read_table(tmp_path / "ref").to_pylist()}

    job = _job(tmp_path, model_dir, "nodeloss")
    t0 = time.monotonic()
    proc = start_job(job, cluster.address)
    lost = _remove_replica_node(cluster, workers, "nodeloss", tmp_path / "nodeloss",
                                t0 + RUN_TIMEOUT_S)  # fmt: skip
    rc = _wait(proc, RUN_TIMEOUT_S)
    log = job.with_suffix(".log").read_text()
    assert rc == 0, log[-3000:]
    rows = pq.read_table(tmp_path / "nodeloss").to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(ref)
    assert {r["id"]: r["output_token_ids"] for r in rows} == ref
    report = json.loads((tmp_path / "nodeloss" / "_k3batch_report.json").read_text())
    assert report["replica_failures"] >= 1, report
    survivors = {w.node_id for w in workers} - {lost}
    members = list_actors(
        address=cluster.address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
    )
    assert all(a.node_id in survivors for a in members)
    print(f"\nnode loss: {report['rows_retried']} rows retried, {time.monotonic() - t0:.1f} s")


def test_no_node_left_waits_a_bounded_time(two_node_cluster, model_dir, tmp_path):
    """Both worker nodes removed mid-job: the job says it waits for resources, then fails after
    replicas.wait_timeout_s (not forever)."""
    cluster, workers = two_node_cluster
    # also the bound on the replica's first start: ~25 s on 2 cores (k3-debug on the CPU)
    wait_s = 60
    job = _job(tmp_path, model_dir, "nonode", wait_timeout_s=wait_s)
    t0 = time.monotonic()
    proc = start_job(job, cluster.address)
    _remove_replica_node(cluster, workers, "nonode", tmp_path / "nonode", t0 + RUN_TIMEOUT_S)
    for w in list(cluster.worker_nodes):
        cluster.remove_node(w, allow_graceful=False)
    removed = time.monotonic()
    rc = _wait(proc, wait_s + 100)
    log = job.with_suffix(".log").read_text()
    assert rc != 0 and "no replica is up" in log, log[-3000:]
    assert "gave up waiting for resources" in log, log[-3000:]
    assert f"wait_timeout_s = {wait_s}" in log, log[-3000:]
    assert time.monotonic() - removed < wait_s + 60
