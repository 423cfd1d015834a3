"""Node loss told apart from a replica's own failure, from facts (issue 50): on a
`ray.cluster_utils.Cluster` (a head that runs nothing, two worker nodes), the node that holds the
job's only replica is removed mid-job. The driver sees the replica's process vanish while the
GCS node table still calls the node alive (it marks it dead ~15 s later); the rows are retried
uncharged meanwhile, and once the table says the node is dead the replica is moved to the other
node. The job is set to count nothing: `max_retries = 0` (a charged row would get an error) and
`max_consecutive_failures = 1` (a charged failure would stop the job). It completes, every row
once, with the move counted as node loss. A fake replica (no model) keeps it fast.

This module starts its own cluster: it skips when Ray is already connected in this process.
"""

import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from k3batch.driver import run_job
from k3batch.driver.fake import FakeReplica
from k3batch.engine.request import SamplingParams
from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaSpec
from k3batch.testing.simcluster import multinode_cluster

END_S = 180
ROWS = 40


@pytest.fixture
def two_workers():
    if ray.is_initialized():
        pytest.skip("Ray is already connected in this process (run this module on its own)")
    with multinode_cluster(0) as cluster:
        workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
        ray.init(address=cluster.address)
        try:
            yield cluster, workers
        finally:
            ray.shutdown()


def test_node_removed_mid_job_moves_the_replica_uncharged(two_workers, tmp_path):
    cluster, workers = two_workers
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(ROWS)], "prompt": ["p q"] * ROWS}), inp)
    spec = JobSpec(
        model=_model_dir(tmp_path),
        name="node-removed",
        input=InputSpec(path=str(inp), batch_rows=2),
        output=OutputSpec(path=str(tmp_path / "out")),
        sampling=SamplingParams(temperature=0, max_new_tokens=2),
        replicas=ReplicaSpec(device="cpu", max_inflight_rows=4, max_retries=0,
                             max_consecutive_failures=1, wait_timeout_s=120.0),  # fmt: skip
        engine=EngineConfig(max_seq_len=64),
    )
    result = {}

    def job():
        try:
            result["report"] = run_job(spec, replica_cls=FakeReplica,
                                       replica_kw={"token_s": 0.1})  # fmt: skip
        except BaseException as e:
            result["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    node = _replica_node("node-removed/replica-0", tmp_path / "out", t0 + 60)
    cluster.remove_node(next(w for w in workers if w.node_id == node), allow_graceful=False)
    removed = time.monotonic()
    thread.join(END_S)
    took = time.monotonic() - t0
    assert not thread.is_alive(), f"the job did not end within {END_S} s"
    assert "error" not in result, result.get("error")
    report = result["report"]
    print(f"\nnode removed {removed - t0:.1f} s into the job; it ended after {took:.1f} s: "
          f"moves {report.replica_moves}, {report.rows_moved} rows moved")  # fmt: skip
    assert report.is_complete and report.error is None and report.rows_with_error == 0
    assert report.replica_moves == {"lost": 1} and report.rows_moved >= 1
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(ROWS))


def _model_dir(tmp_path) -> str:
    """A checkpoint folder with only config.json and the tokenizer: the fake replica loads no
    weights, but the driver reads the config and tokenizes the prompts."""
    import dataclasses

    from k3batch.model.weights import write_checkpoint
    from k3batch.testing import K3_MINI

    path = tmp_path / "ckpt"
    write_checkpoint(dataclasses.replace(K3_MINI, experts_mxfp4=True), path, seed=0)
    return str(path)


def _replica_node(name: str, out, deadline: float) -> str:
    """The node of the replica, once it is up and the job has committed a shard."""
    while time.monotonic() < deadline:
        try:
            actor = ray.get_actor(name)
            node = ray.get(actor.ready.remote(), timeout=10)["node_id"]
        except (ValueError, ray.exceptions.RayError):
            time.sleep(0.2)
            continue
        if out.is_dir() and any(out.glob("*.parquet")):
            return node
        time.sleep(0.1)
    pytest.fail("the replica did not come up and commit a shard in time")
