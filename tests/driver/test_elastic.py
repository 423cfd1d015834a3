"""Elastic replicas on simulated clusters (fake GPU nodes, fake replicas: the driver, the
placement groups and Ray's autoscaler are real; no model runs).

- From zero worker nodes (`SimulatedCluster`, Ray's fake multi-node autoscaler): the job asks
  for GPU nodes because its spec does (`device = "auto"`, an accelerator type), starts when
  the first replica is up (not waiting for the second), reaches `max`, drains at the tail (a
  replica released while the last row, 3 s long, still runs), scales back to zero nodes once
  they are idle (`k3batch.bench.elastic.IDLE_TIMEOUT_S`) and writes every row exactly once.
- One request per replica: two replicas of three GPU bundles each (pp = 1, tp = 2) on a node
  with four GPUs (room for one and a half): one runs, the other waits holding nothing. (The
  old driver asked for a replica's prefill and decode groups separately: 1 + 2 + 1 of the 4
  GPUs got placed and both replicas waited for the rest until wait_timeout_s.)
- A node removed mid-job: its replica's rows go to the other replica without counting against
  `max_retries` (0 here, so a counted retry would be an error row); exactly once.

The node tests share one head (each adds and removes its own worker nodes); the first test starts
and stops its own cluster. The module skips when Ray is already connected.
"""

import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from k3batch.driver import run_job
from k3batch.bench.elastic import format_timeline, run_elastic
from k3batch.driver.fake import FakeReplica
from k3batch.engine.request import SamplingParams
from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaRange
from k3batch.driver.jobspec import ReplicaSpec
from k3batch.model.weights import init_checkpoint
from k3batch.testing.simcluster import multinode_cluster

GPU_NODE = {"num_cpus": 2, "num_gpus": 1, "resources": {"accelerator_type:SIM": 1}}


@pytest.fixture(autouse=True)
def _no_ray_yet():
    if ray.is_initialized():
        pytest.skip("Ray is already connected in this process (run this module on its own)")


@pytest.fixture(scope="module")
def fixed_head():
    """A head that runs nothing but tokenize tasks (1 CPU, no GPU), started once for the tests
    that add worker nodes (`fixed_cluster`)."""
    with multinode_cluster(1) as cluster:
        yield cluster


@pytest.fixture
def fixed_cluster(fixed_head):
    """The head, joined by this process for one test; the worker nodes the test adds (and has
    not removed itself) are removed afterwards, so every test starts with the head alone."""
    assert not fixed_head.worker_nodes, "a worker node left by an earlier test"
    try:
        ray.init(address=fixed_head.address, log_to_driver=False)
        yield fixed_head
    finally:
        ray.shutdown()
        for node in list(fixed_head.worker_nodes):
            fixed_head.remove_node(node)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "k3-debug"
    init_checkpoint("k3-debug", path, seed=0)  # config and tokenizer; no model runs
    return str(path)


def _job(model_dir, tmp_path, n: int, **replicas) -> JobSpec:
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)],
                             "prompt_token_ids": [[1 + i % 50, 2, 3] for i in range(n)]}),
                   tmp_path / "in.parquet")  # fmt: skip
    return JobSpec(
        model=model_dir,
        name="elastic-test",
        input=InputSpec(path=str(tmp_path / "in.parquet"), batch_rows=4),
        output=OutputSpec(path=str(tmp_path / "out")),
        sampling=SamplingParams(temperature=0, max_new_tokens=2),
        replicas=ReplicaSpec(accelerator_type="SIM", max_inflight_rows=4, **replicas),
        engine=EngineConfig(max_seq_len=128),
    )


def _exactly_once(out, n: int) -> None:
    rows = pq.read_table(out).to_pylist()
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n)), "lost or duplicated rows"
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]][:3]


def test_elastic_job_scales_from_zero_nodes_to_max_and_back(tmp_path):
    n = 300
    result = run_elastic(tmp_path, rows=n, max_replicas=2, token_s=0.02, tail_tokens=150)
    print("\n" + format_timeline(result))
    report, replicas, nodes = result["report"], result["replicas"], result["nodes"]
    assert nodes[0][1] == 0, "the cluster starts with no worker node"
    ids = [r["id"] for r in result["rows"]]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n)) and report["rows_with_error"] == 0
    first_up = next(t for t, k in replicas if k >= 1)
    max_up = next(t for t, k in replicas if k == 2)
    # the job's clock starts with the first replica (how long after it the second comes up
    # depends on the machine's load: both nodes are launched at once)
    assert report["stage_s"]["startup"] <= first_up + 1.0, replicas
    assert all(k > 0 for k in report["rows_per_replica"]) and len(report["rows_per_replica"]) == 2
    # the tail: one replica released while the last row still runs, its node removed
    assert any(k == 1 and max_up < t < result["job_end_s"] for t, k in replicas), replicas
    assert nodes[-1][1] == 0, nodes
    assert max(k for _, k in nodes) == 2


def test_two_replicas_never_deadlock_on_room_for_one_and_a_half(fixed_cluster, model_dir,
                                                                tmp_path):  # fmt: skip
    fixed_cluster.add_node(num_cpus=8, num_gpus=4, resources={"accelerator_type:SIM": 1})
    spec = _job(model_dir, tmp_path, 24, num_replicas=ReplicaRange(min=1, max=2), tp=2,
                wait_timeout_s=60)
    free_gpus, stop = [], threading.Event()

    def sample():
        while not stop.wait(0.2):
            free_gpus.append(ray.available_resources().get("GPU", 0))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        report = run_job(spec, replica_cls=FakeReplica, replica_kw={"token_s": 0.05})
    finally:
        stop.set()
        sampler.join()
    _exactly_once(tmp_path / "out", 24)
    assert max(k for _, k in report.replica_timeline) == 1  # the second never placed...
    assert 1 in free_gpus  # ...and held nothing: the fourth GPU stayed free


def test_node_removed_mid_job_completes_exactly_once(fixed_cluster, model_dir, tmp_path):
    workers = [fixed_cluster.add_node(**GPU_NODE) for _ in range(2)]
    n = 80
    spec = _job(model_dir, tmp_path, n, num_replicas=2, max_retries=0, wait_timeout_s=60)
    removed = []

    def remove_a_busy_node():
        deadline = time.monotonic() + 60
        out = tmp_path / "out"
        while time.monotonic() < deadline:
            if out.is_dir() and len(list(out.glob("*.parquet"))) >= 3:
                fixed_cluster.remove_node(workers[0], allow_graceful=False)
                removed.append(time.monotonic())
                return
            time.sleep(0.1)

    killer = threading.Thread(target=remove_a_busy_node)
    killer.start()
    report = run_job(spec, replica_cls=FakeReplica, replica_kw={"token_s": 0.1})
    killer.join()
    assert removed, "the job ended before the node was removed"
    _exactly_once(tmp_path / "out", n)
    # The replica's process vanishes first; the node table marks its node dead ~15 s later, so
    # the verdict ("lost") may still be open when the job ends: its rows went uncharged all the
    # same (max_retries = 0), counted in rows_moved either way
    assert set(report.replica_moves) <= {"lost"} and report.rows_moved > 0, report.to_dict()
    assert report.replica_moves or report.failures_unjudged, report.to_dict()
    assert report.is_complete and report.rows_with_error == 0
