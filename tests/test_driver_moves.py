"""Node loss as Ray reports it, without a cluster: `health.node_loss` names why a replica's node
went away from the errors Ray raises (built here by Ray's own constructors from the death causes
the GCS sends, with its message lines), and the dispatcher retries the rows of a moved replica
without charging them, while a failure of the replica's own is charged."""

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext, NodeDeathInfo
from ray.exceptions import ActorDiedError, ActorUnavailableError

from k3batch.driver.dispatch import Dispatcher
from k3batch.driver.health import Health, node_loss
from k3batch.prompts import RowWork
from k3batch.report import JobReport

NODE_DIED = "The actor died because its node has died. Node Id: 0a1b\n\tthe actor's node was "


def _died(message: str, reason: int = NodeDeathInfo.UNSPECIFIED) -> ActorDiedError:
    ctx = ActorDiedErrorContext(actor_id=b"\x01" * 16, error_message=message,
                                node_death_info=NodeDeathInfo(reason=reason))  # fmt: skip
    return ActorDiedError(ctx)


@pytest.mark.parametrize(
    "err, cause",
    [
        (_died(NODE_DIED + "preempted: spot reclaimed", NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED),
         "preempted"),
        (_died(NODE_DIED + "terminated expectedly: scaled down",
               NodeDeathInfo.EXPECTED_TERMINATION), "drained"),
        (_died(NODE_DIED + "terminated unexpectedly: raylet died",
               NodeDeathInfo.UNEXPECTED_TERMINATION), "lost"),
        (ActorUnavailableError("connection reset", None), "unavailable"),
        (_died("The actor is dead because its worker process has died. Worker exit type: "
               "SYSTEM_ERROR"), None),
        (RuntimeError("the replica restarted"), None),
    ],
    ids=["node-preempted", "node-drained", "node-lost", "connection-broken", "worker-died",
         "not-ray"],
)  # fmt: skip
def test_node_loss_names_the_cause_ray_reports(err, cause):
    assert node_loss(err) == cause


class _Replica:  # the dispatcher only keeps a handle here; nothing is called
    pass


def test_moved_rows_are_retried_uncharged_and_own_failures_charged():
    replicas = [_Replica(), _Replica()]  # the second stays pending: the job goes on
    health = Health(replicas, down_timeout_s=60.0)
    health.start(0)
    dispatch = Dispatcher(replicas, health, window=4, max_retries=0,
                          report=JobReport(job="t", output="t"))  # fmt: skip
    work = RowWork(0, [1, 2], None)
    dispatch.inflight[0][(0, 0, 0)] = (0, work)
    preempted = _died(NODE_DIED + "preempted: x", NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED)
    dispatch._failed(0, preempted)
    assert health.state[0] == "moved" and not dispatch.take_done()  # retried, max_retries = 0
    assert list(dispatch.queue) == [((0, 0, 0, 1), work)]
    assert dispatch.report.replica_moves == {"preempted": 1} and dispatch.report.rows_moved == 1

    health.start(0)  # the moved replica is up again elsewhere, with the row
    dispatch.queue.clear()
    dispatch.inflight[0][(0, 0, 0)] = (1, work)
    dispatch._failed(0, _died("The actor is dead because its worker process has died."))
    ((key, row),) = dispatch.take_done()  # the replica's own failure: charged, out of retries
    assert key == (0, 0, 0) and "failed 2 times" in row["error"] and not dispatch.queue
    assert health.state[0] == "dead"


def test_startup_notice_says_whether_replicas_are_starting_or_unplaced(monkeypatch):
    """A replica whose group is placed is loading (no autoscaler talk); an unplaced group names
    its bundles and the cluster's free resources."""
    from types import SimpleNamespace

    from k3batch.driver import replicas

    monkeypatch.setattr(replicas, "_free", lambda: "{'GPU': 0}")
    pool = SimpleNamespace(health=SimpleNamespace(up=lambda: []), r=SimpleNamespace(max_replicas=2),
                           starting={"ref": (0, 0.0)}, placing={}, bundles=[{"GPU": 1}],
                           strategy="STRICT_PACK")  # fmt: skip
    notice = replicas.ReplicaPool._startup_notice(pool, 1, 30, 600)
    assert "0 of 2 up (min 1), 30 of 600 s; 1 placed and starting" in notice
    assert "autoscaler" not in notice
    pool.placing = {"pg": 1}
    notice = replicas.ReplicaPool._startup_notice(pool, 1, 60, 600)
    assert "1 waiting for resources" in notice and "[{'GPU': 1}] (STRICT_PACK)" in notice
    assert "free: {'GPU': 0}" in notice
