"""Replica health as the driver sees it, and the verdict on every failure: the replica's own, or
its node's loss.

States: "pending" (not started yet: `ReplicaPool`), "up" (gets rows), "down" (failed, its process
restarting: probed with `ready()` until it answers), "rebuild" (its actor is gone for good, a
constructor that raised: the pool starts a new one in the same placement group), "moved" (its
node was drained, preempted or lost: the pool starts it anew elsewhere), "dead" (down for longer
than `down_timeout_s`), "draining" (gets no new rows; its own still come back) or "released"
(taken down by the pool). Every probe is bounded: one not answered within `probe_timeout_s`
counts as a failed probe.

The verdict comes from facts, not from the exception's type. A node is lost when Ray says so:
the error names a dead or preempted node, or the GCS node table marks one of the failure's nodes
(the replica's, and its stages' and ranks' as the replica reports them) dead, drained or
preempted. A failure the replica reported itself (`ReplicaFailed`, a constructor's error, an
answer from a new process) is its own unless such a node is dead. A process that vanished (the
connection broke, the actor died) on a node the table still calls alive is "unknown" for now:
the table lags a lost node by its health checks (about 15 s), so the verdict waits until the
replica answers again from the same node (its own), the table marks the node dead or the replica
answers from another one (node loss), or `VERDICT_S` passes with the node alive (its own).
Meanwhile its rows are retried uncharged (`dispatch`); an own verdict charges them.

Only own failures count: `streak[r]` is the replica's own failures since it last finished a row
(start-up failures included). At `max_failures` in a row the job stops with `CrashLoopError`,
which carries the replica's cause (type, message, traceback tail). Node loss is never counted.
The job also fails, naming the last error, when every replica is dead or released and none is
pending. While no replica is up, a warning says so every `WAIT_LOG_EVERY_S`.
"""

import logging
import time
from dataclasses import dataclass, field

import ray

from k3batch.actors.failure import ReplicaFailed, cause_line

log = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0
WAIT_LOG_EVERY_S = 30.0
VERDICT_S = 60.0  # longest wait for the node table to mark a lost node dead (GCS: ~15 s)
TABLE_EVERY_S = 1.0  # node table reads while a verdict waits


@dataclass(eq=False)
class Failure:
    """One failure of replica `replica`. verdict: "own", "node" or "unknown" (waiting for
    facts); lost: why the node went away ("preempted", "drained", "lost") when "node"; cause:
    {"type", "message", "traceback"}; nodes: the Ray node ids involved; keys: the rows it lost
    (the dispatcher's, charged when the verdict becomes "own")."""

    replica: int
    verdict: str
    cause: dict
    nodes: list[str]
    lost: str | None = None
    at: float = field(default_factory=time.monotonic)
    keys: list = field(default_factory=list)


class CrashLoopError(RuntimeError):
    """A replica failed `failures` times in a row by itself: the job stops. cause: the last
    failure's {"type", "message", "traceback"}."""

    def __init__(self, replica: int, failures: int, cause: dict):
        self.replica, self.failures, self.cause = replica, failures, cause
        super().__init__(
            f"replica {replica} failed {failures} times in a row without finishing a row "
            f"(replicas.max_consecutive_failures = {failures}): a crash loop, so the job stops. "
            f"Its last failure: {cause_line(cause)}\n{cause['traceback']}"
        )

    def to_dict(self) -> dict:
        return {"replica": self.replica, "failures": self.failures, **self.cause}


class Health:
    def __init__(self, replicas: list, *, down_timeout_s: float, max_failures: int = 3,
                 probe_timeout_s: float = 60.0):  # fmt: skip
        self.replicas = replicas
        n = len(replicas)
        self.state = ["pending"] * n
        self.down_timeout_s, self.probe_timeout_s = down_timeout_s, probe_timeout_s
        self.max_failures = max_failures
        self.down_since: dict[int, float] = {}
        self.probes: dict = {}  # ready() ref -> (replica index, sent at)
        self.probe_at: dict[int, float] = {}  # replica index -> when to probe next
        self.node: list[str | None] = [None] * n  # the node each replica last answered from
        self.streak = [0] * n  # own failures since the replica last finished a row
        self.waiting: list[Failure] = []  # verdict "unknown"
        self.on_verdict = lambda failure: None  # the dispatcher accounts a late verdict's rows
        self.metrics = None  # the job's `k3batch.metrics.JobMetrics`, when it has them
        self.failures = 0
        self.logged_at = 0.0  # last "no replica is up" warning
        self.table_at = 0.0  # last node-table read for waiting verdicts

    def up(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == "up"]

    def serving(self) -> list[int]:
        """Replicas whose rows in flight still come back: up and draining."""
        return [i for i, s in enumerate(self.state) if s in ("up", "draining")]

    def start(self, r: int, node_id: str | None) -> None:
        self.state[r], self.node[r] = "up", node_id

    def progress(self, r: int) -> None:
        """Replica r finished a row: its failures so far are no longer in a row."""
        self.streak[r] = 0

    def drain(self, r: int) -> None:
        self.state[r] = "draining"

    def release(self, r: int) -> None:
        self.state[r] = "released"
        self.probe_at.pop(r, None)
        self.down_since.pop(r, None)

    # ---- failures and their verdicts -------------------------------------------------------
    def failed(self, r: int, err: Exception) -> Failure:
        """Replica r failed a call (or its start) with `err`: judge it, then down, rebuild or
        moved. Raises CrashLoopError at the `max_failures`-th own failure in a row."""
        if self.state[r] in ("up", "draining"):
            self.failures += 1
        f = judge(r, err, self.node[r])
        if self.metrics is not None:
            self.metrics.failure(r, f.verdict)
        if isinstance(err, ReplicaFailed):  # a live process that is broken: restart it
            ray.kill(self.replicas[r], no_restart=False)
        if f.verdict == "node":
            self._moved(f)
            return f
        how = "its own failure" if f.verdict == "own" else "its process is gone; is its node?"
        log.error("replica %d failed (%s): %s", r, how, cause_line(f.cause))
        if isinstance(err, ray.exceptions.ActorDiedError):  # gone for good: a new actor
            self.state[r] = "rebuild"
            self.probe_at.pop(r, None)
            self.down_since.pop(r, None)
        elif self.state[r] in ("up", "draining", "pending", "down"):  # restarting: probe it
            self.state[r] = "down"
            self.down_since.setdefault(r, time.monotonic())
            self.probe_at[r] = time.monotonic()
        if f.verdict == "own":
            self._own(f)
        else:
            self.waiting.append(f)
        return f

    def _own(self, f: Failure) -> None:
        f.verdict = "own"
        self.streak[f.replica] += 1
        if self.streak[f.replica] >= self.max_failures:
            raise CrashLoopError(f.replica, self.streak[f.replica], f.cause)

    def _moved(self, f: Failure, *, move: bool = True) -> None:
        """Node loss: the pool moves the replica (move=False: it already answered from a live
        node, where Ray restarted it)."""
        f.verdict = "node"
        log.warning("replica %d: its node is gone (%s); %s", f.replica, f.lost,
                    "moving it" if move else "Ray restarted it on another node")  # fmt: skip
        if move and self.state[f.replica] not in ("released", "pending"):
            self.state[f.replica] = "moved"
            self.probe_at.pop(f.replica, None)
            self.down_since.pop(f.replica, None)

    def _decide(self, f: Failure, verdict: str, lost: str | None = None, *,
                move: bool = True) -> None:  # fmt: skip
        self.waiting.remove(f)
        if verdict == "node":
            f.lost = lost
            self._moved(f, move=move)
            self.on_verdict(f)
        else:
            f.verdict = "own"
            self.on_verdict(f)  # rows charged first: a crash loop's rows are accounted
            self._own(f)

    def revisit(self, *, final: bool = False) -> None:
        """Decide waiting verdicts from the node table (read at most every TABLE_EVERY_S).
        final: the job's rows are all done; decide only node loss, leave the rest unjudged."""
        now = time.monotonic()
        if not self.waiting or (now - self.table_at < TABLE_EVERY_S and not final):
            return
        self.table_at = now
        table = node_table()
        for f in list(self.waiting):
            lost = dead_node(f.nodes, table)
            if lost:
                self._decide(f, "node", lost)
            elif now - f.at > VERDICT_S and not final:
                self._decide(f, "own")

    # ---- probes of replicas that are down ---------------------------------------------------
    def refs(self) -> list:
        return list(self.probes)

    def send_probes(self) -> None:
        now = time.monotonic()
        if self.down_since and not self.up() and now - self.logged_at >= WAIT_LOG_EVERY_S:
            self.logged_at = now
            waited = now - min(self.down_since.values())
            log.warning(
                "no replica is up (%s); waiting for one to be rebuilt or for resources: "
                "%.0f of %g s (replicas.wait_timeout_s)",
                ", ".join(self.state), waited, self.down_timeout_s,
            )
        for r, at in list(self.probe_at.items()):
            if now - self.down_since[r] > self.down_timeout_s:
                del self.probe_at[r]
                limit = self.down_timeout_s
                self._dead(r, TimeoutError(
                    f"gave up waiting for resources: down for more than {limit:.0f} s "
                    f"(replicas.wait_timeout_s = {limit:g})"
                ))  # fmt: skip
            elif at <= now:
                del self.probe_at[r]
                self.probes[self.replicas[r].ready.remote()] = (r, now)
        for ref, (r, sent) in list(self.probes.items()):
            if now - sent > self.probe_timeout_s:  # a hung probe: forget it, probe again
                del self.probes[ref]
                self.probe_at[r] = now

    def _dead(self, r: int, err: Exception) -> None:
        self.state[r] = "dead"
        self.probe_at.pop(r, None)
        self.down_since.pop(r, None)
        log.error("replica %d is dead: %s", r, err)
        if all(s in ("dead", "released") for s in self.state):  # none pending, none moving
            raise RuntimeError(f"every replica died; last error: {err}") from err

    def on_probe(self, ref) -> None:
        r, _ = self.probes.pop(ref)
        if self.state[r] != "down":
            return  # released, moved or dead meanwhile
        try:
            answer = ray.get(ref, timeout=self.probe_timeout_s)
        except (ReplicaFailed, ray.exceptions.ActorDiedError) as e:
            # the restarted process failed (its constructor or right after), or its node died
            lost = said_node_loss(e)
            for f in [f for f in self.waiting if f.replica == r]:
                self._decide(f, "node" if lost else "own", lost)
            if self.state[r] == "down":
                self.failed(r, e)
            return
        except (ray.exceptions.RayError, TimeoutError):
            self.probe_at[r] = time.monotonic() + PROBE_EVERY_S  # still restarting
            return
        node = answer["node_id"]
        for f in [f for f in self.waiting if f.replica == r]:  # it answered: from where?
            if node == self.node[r]:
                self._decide(f, "own")
            else:
                self._decide(f, "node", dead_node(f.nodes, node_table()) or "lost", move=False)
        log.warning("replica %d is back", r)
        self.state[r], self.node[r] = "up", node
        del self.down_since[r]


def judge(r: int, err: Exception, node_id: str | None) -> Failure:
    """The verdict on replica r's failure `err` from what the error and the node table say;
    node_id: where the replica last answered from."""
    nodes = [node_id] if node_id else []
    if isinstance(err, ReplicaFailed):
        cause, nodes = dict(err.details), [n for n in err.nodes if n]
    else:
        cause = ray_cause(err)
    lost = said_node_loss(err)
    if lost:
        return Failure(r, "node", cause, nodes, lost)
    lost = dead_node(nodes, node_table()) if nodes else None
    if lost:
        return Failure(r, "node", cause, nodes, lost)
    gone = isinstance(err, ray.exceptions.RayActorError) and not (
        isinstance(err, ray.exceptions.ActorDiedError) and err.actor_init_failed
    )
    return Failure(r, "unknown" if gone and nodes else "own", cause, nodes)


def said_node_loss(err: Exception) -> str | None:
    """Why a replica's node went away, when Ray's error says so: "preempted" (drained for
    preemption), "drained" (ended as expected: drained, scaled down), "lost" (died)."""
    if not isinstance(err, ray.exceptions.RayActorError):
        return None
    if err.preempted:
        return "preempted"
    text = str(err)
    if "terminated expectedly" in text:
        return "drained"
    if "its node has died" in text or "node it was running on is dead" in text:
        return "lost"
    return None


def ray_cause(err: Exception) -> dict:
    """{"type", "message", "traceback"} of an error the driver got from Ray. A constructor's
    error carries the replica's traceback in its text: its last line is the cause."""
    text = str(err).strip()
    lines = text.splitlines() or [""]
    if isinstance(err, ray.exceptions.ActorDiedError) and err.actor_init_failed:
        last = lines[-1]
        kind, _, message = last.partition(": ")
        if message and kind.replace(".", "").replace("_", "").isalnum():
            return {"type": kind, "message": message, "traceback": "\n".join(lines[-12:])}
    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        return {"type": type(err.cause).__name__, "message": str(err.cause),
                "traceback": "\n".join(lines[-12:])}  # fmt: skip
    return {"type": type(err).__name__, "message": text, "traceback": ""}


_DEATH = {"AUTOSCALER_DRAIN_PREEMPTED": "preempted", "AUTOSCALER_DRAIN_IDLE": "drained",
          "EXPECTED_TERMINATION": "drained"}  # fmt: skip


def node_table() -> dict[str, dict]:
    """The GCS node table by node id (dead nodes stay listed for a while); {} when the GCS
    cannot be read (then no node is judged dead)."""
    try:
        return {n["NodeID"]: n for n in ray.nodes()}
    except Exception as e:  # the GCS itself unreachable: judge nothing from it
        log.warning("cannot read the node table: %s", e)
        return {}


def dead_node(nodes: list[str], table: dict[str, dict]) -> str | None:
    """Why the first of `nodes` that the table marks dead went away ("preempted", "drained",
    "lost"), or None when every one is alive (or the table is empty)."""
    from ray.core.generated.common_pb2 import NodeDeathInfo

    if not table:
        return None
    for n in nodes:
        entry = table.get(n)
        if entry is None:
            return "lost"  # gone from the table altogether
        if not entry["Alive"]:
            return _DEATH.get(NodeDeathInfo.Reason.Name(entry.get("DeathReason", 0)), "lost")
    return None
