"""Failure verdicts without a cluster (`driver.health`): node loss as Ray reports it (errors built
by Ray's own constructors from the death causes the GCS sends) and as the GCS node table shows
it (a fake table here); rows of a moved replica retried uncharged, a replica's own failure
charged; a vanished process judged only once the facts come (the table, or the replica's next
answer); a replica that is down when its node dies still moved (issue 53)."""

import pytest
import ray
from ray.core.generated.common_pb2 import ActorDiedErrorContext, NodeDeathInfo
from ray.exceptions import ActorDiedError, ActorUnavailableError

from k3batch.actors.failure import ReplicaFailed, describe
from k3batch.driver import health as health_mod
from k3batch.driver.dispatch import Dispatcher
from k3batch.driver.health import CrashLoopError, Health, said_node_loss
from k3batch.driver.prompts import RowWork
from k3batch.driver.report import JobReport

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
        (ActorUnavailableError("connection reset", None), None),  # says nothing of the node
        (_died("The actor is dead because its worker process has died. Worker exit type: "
               "SYSTEM_ERROR"), None),
        (RuntimeError("the replica restarted"), None),
    ],
    ids=["node-preempted", "node-drained", "node-lost", "connection-broken", "worker-died",
         "not-ray"],
)  # fmt: skip
def test_said_node_loss_names_the_cause_ray_reports(err, cause):
    assert said_node_loss(err) == cause


class _Replica:  # the dispatcher only keeps a handle here; nothing is called
    pass


def _table(alive: dict[str, bool], reason: int = NodeDeathInfo.UNEXPECTED_TERMINATION):
    return lambda: {n: {"NodeID": n, "Alive": a, "DeathReason": 0 if a else reason}
                    for n, a in alive.items()}  # fmt: skip


def _setup(monkeypatch, *, max_retries=0, max_failures=3, alive=True):
    monkeypatch.setattr(health_mod, "node_table", _table({"n0": alive, "n1": True}))
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    replicas = [_Replica(), _Replica()]  # the second stays pending: the job goes on
    health = Health(replicas, down_timeout_s=60.0, max_failures=max_failures)
    health.start(0, "n0")
    dispatch = Dispatcher(replicas, health, window=4, max_retries=max_retries,
                          report=JobReport(job="t", output="t"))  # fmt: skip
    return health, dispatch, RowWork(0, [1, 2], None)


def test_moved_rows_are_retried_uncharged_and_own_failures_charged(monkeypatch):
    health, dispatch, work = _setup(monkeypatch)
    dispatch.inflight[0][(0, 0, 0)] = (0, work)
    preempted = _died(NODE_DIED + "preempted: x", NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED)
    dispatch._failed(0, preempted)
    assert health.state[0] == "moved" and not dispatch.take_done()  # retried, max_retries = 0
    assert list(dispatch.queue) == [((0, 0, 0, 1), work)]
    assert dispatch.report.replica_moves == {"preempted": 1} and dispatch.report.rows_moved == 1
    assert health.streak[0] == 0

    health.start(0, "n1")  # the moved replica is up again elsewhere, with the row
    dispatch.queue.popleft()
    dispatch.inflight[0][(0, 0, 0)] = (1, work)
    dispatch._failed(0, RuntimeError("the replica restarted; its rows in flight are lost"))
    ((key, row),) = dispatch.take_done()  # the replica's own failure: charged, out of retries
    assert key == (0, 0, 0) and "failed 1 times" in row["error"] and not dispatch.queue
    assert "the replica restarted" in row["error"]
    assert health.state[0] == "down" and health.streak[0] == 1


def test_a_dead_node_in_the_table_is_node_loss_whatever_the_error(monkeypatch):
    """The replica reports an engine failure, but one of its members' nodes is dead: moved."""
    health, dispatch, work = _setup(monkeypatch)
    monkeypatch.setattr(health_mod, "node_table", _table({"n0": True, "n1": False}))
    dispatch.inflight[0][(0, 0, 0)] = (0, work)
    err = ReplicaFailed(describe(RuntimeError("decode rank 1 died")) | {"where": "engine"},
                        ["n0", "n1"])  # fmt: skip
    dispatch._failed(0, err)
    assert health.state[0] == "moved" and dispatch.report.replica_moves == {"lost": 1}
    assert list(dispatch.queue) == [((0, 0, 0, 1), work)] and health.streak[0] == 0


def test_a_vanished_process_waits_for_the_table_then_moves_uncharged(monkeypatch):
    """The process is gone while the table still calls its node alive (the GCS's health checks
    lag): rows retried uncharged at once; when the table marks the node dead, it was node loss."""
    health, dispatch, work = _setup(monkeypatch, max_failures=1)
    dispatch.inflight[0][(0, 0, 0)] = (0, work)
    dispatch._failed(0, ActorUnavailableError("Socket closed", None))
    assert health.state[0] == "down" and len(health.waiting) == 1  # not judged yet
    assert list(dispatch.queue) == [((0, 0, 0, 1), work)] and not dispatch.take_done()
    monkeypatch.setattr(health_mod, "node_table", _table({"n0": False}))
    health.revisit()
    assert health.state[0] == "moved" and not health.waiting and health.streak[0] == 0
    assert dispatch.report.replica_moves == {"lost": 1} and dispatch.report.rows_moved == 1


def test_a_vanished_process_that_comes_back_on_its_node_is_charged(monkeypatch):
    """Ray restarted it on the same, live node: its own failure (a crash loop at max_failures),
    and rows out of retries get their error."""
    health, dispatch, work = _setup(monkeypatch, max_failures=2)
    dispatch.inflight[0][(0, 0, 0)] = (0, work)
    dispatch._failed(0, ActorUnavailableError("Socket closed", None))
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: {"node_id": "n0"})
    health.probes["probe"] = (0, 0.0)
    health.on_probe("probe")
    assert health.state[0] == "up" and health.streak[0] == 1 and not health.waiting
    ((key, row),) = dispatch.take_done()  # charged: max_retries = 0
    assert "ActorUnavailableError: " in row["error"] and "Socket closed" in row["error"]
    assert not dispatch.queue
    health.probes["again"] = (0, 0.0)  # fails again at once: the second in a row
    dispatch._failed(0, ActorUnavailableError("Socket closed", None))
    with pytest.raises(CrashLoopError, match="replica 0 failed 2 times in a row"):
        health.on_probe("again")


def test_a_finished_row_ends_the_streak(monkeypatch):
    health, dispatch, work = _setup(monkeypatch, max_retries=3, max_failures=2)
    dispatch.inflight[0][(0, 0, 0)] = (0, work)
    dispatch._failed(0, RuntimeError("the replica restarted"))
    assert health.streak[0] == 1
    health.start(0, "n0")
    dispatch.inflight[0][(0, 0, 0)] = dispatch.queue.popleft()[0][3], work
    dispatch.calls["take"] = (0, dispatch.epoch[0], "take", 0.0)
    dispatch.instance[0] = "i"
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ("i", [{"key": (0, 0, 0, 1)}]))
    dispatch.on_ready("take")
    assert health.streak[0] == 0 and len(dispatch.take_done()) == 1


def test_a_replica_down_when_its_node_dies_is_still_moved(monkeypatch):
    """Issue 53: a replica already down (restarting) whose node then dies must be moved, its
    rows retried uncharged, not left down with nothing scheduled: the probe says the node died,
    or the table does."""
    for via in ("probe", "table"):
        health, dispatch, work = _setup(monkeypatch)
        dispatch.inflight[0][(0, 0, 0)] = (0, work)
        dispatch._failed(0, ActorUnavailableError("Socket closed", None))
        assert health.state[0] == "down"
        if via == "probe":
            def dead(ref, timeout=None):
                raise _died(NODE_DIED + "terminated unexpectedly", 2)

            monkeypatch.setattr(ray, "get", dead)
            health.probes["probe"] = (0, 0.0)
            health.on_probe("probe")
        else:
            monkeypatch.setattr(health_mod, "node_table", _table({"n0": False}))
            health.revisit()
        assert health.state[0] == "moved", via
        assert list(dispatch.queue) == [((0, 0, 0, 1), work)] and not dispatch.take_done(), via
        assert health.streak[0] == 0 and dispatch.report.rows_moved == 1, via


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


def test_a_replica_whose_node_dies_while_it_starts_is_moved(monkeypatch):
    """Its start fails with its node's death: the slot is moved (a new group elsewhere), not
    left pending with nothing placed or starting."""
    from types import SimpleNamespace

    from k3batch.driver import replicas

    monkeypatch.setattr(health_mod, "node_table", _table({"n0": True}))
    health = Health([_Replica()], down_timeout_s=60.0)

    def dead(ref, timeout=None):
        raise _died(NODE_DIED + "terminated unexpectedly", NodeDeathInfo.UNEXPECTED_TERMINATION)

    monkeypatch.setattr(ray, "get", dead)
    pool = SimpleNamespace(starting={"ref": (0, 0.0)}, health=health)
    replicas.ReplicaPool._started(pool, "ref")
    assert health.state[0] == "moved" and health.streak[0] == 0
