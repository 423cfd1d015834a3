"""Replica health as the driver sees it: "pending" (not started yet: `ReplicaPool`), "up" (gets
rows), "down" (failed, restarting: probed with `ready()` until it answers), "dead" (out of
restarts, or down for longer than `down_timeout_s`), "moved" (its node was drained, preempted
or lost: the pool starts it anew elsewhere), "draining" (gets no new rows; its own still come
back) or "released" (taken down by the pool). Every probe is bounded: one not
answered within `probe_timeout_s` counts as a failed probe. The job fails, naming the last
error, when every replica is dead or released and none is pending. While no replica is up (nodes
lost, replicas being rebuilt), a warning says so every `WAIT_LOG_EVERY_S`.
"""

import logging
import time

import ray

log = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0
WAIT_LOG_EVERY_S = 30.0


class Health:
    def __init__(self, replicas: list, *, down_timeout_s: float, probe_timeout_s: float = 60.0):
        self.replicas = replicas
        self.state = ["pending"] * len(replicas)
        self.down_timeout_s, self.probe_timeout_s = down_timeout_s, probe_timeout_s
        self.down_since: dict[int, float] = {}
        self.probes: dict = {}  # ready() ref -> (replica index, sent at)
        self.probe_at: dict[int, float] = {}  # replica index -> when to probe next
        self.failures = 0
        self.logged_at = 0.0  # last "no replica is up" warning

    def up(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == "up"]

    def serving(self) -> list[int]:
        """Replicas whose rows in flight still come back: up and draining."""
        return [i for i, s in enumerate(self.state) if s in ("up", "draining")]

    def start(self, r: int) -> None:
        self.state[r] = "up"

    def drain(self, r: int) -> None:
        self.state[r] = "draining"

    def release(self, r: int) -> None:
        self.state[r] = "released"
        self.probe_at.pop(r, None)
        self.down_since.pop(r, None)

    def failed(self, r: int, err: Exception) -> None:
        """Replica r failed a call with `err`: it is down (or dead) from now on."""
        if self.state[r] in ("up", "draining"):
            self.failures += 1
        if node_loss(err):  # the pool moves it: a new group, placed on a live node
            if self.state[r] in ("up", "draining", "down"):
                log.warning("replica %d: its node is gone (%s); moving it", r, node_loss(err))
                self.state[r] = "moved"
                self.probe_at.pop(r, None)
                self.down_since.pop(r, None)
        elif isinstance(err, ray.exceptions.ActorDiedError):
            self._dead(r, err)
        elif self.state[r] in ("up", "draining"):
            self.state[r] = "down"
            self.down_since[r] = time.monotonic()
            self.probe_at[r] = time.monotonic()

    def _dead(self, r: int, err: Exception) -> None:
        self.state[r] = "dead"
        self.probe_at.pop(r, None)
        self.down_since.pop(r, None)
        log.error("replica %d is dead: %s", r, err)
        if all(s in ("dead", "released") for s in self.state):  # none pending, none moving
            raise RuntimeError(f"every replica died; last error: {err}") from err

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
                self._dead(r, TimeoutError(
                    f"gave up waiting for resources: down for more than {self.down_timeout_s:.0f} s "
                    f"(replicas.wait_timeout_s = {self.down_timeout_s:g})"
                ))  # fmt: skip
            elif at <= now:
                del self.probe_at[r]
                self.probes[self.replicas[r].ready.remote()] = (r, now)
        for ref, (r, sent) in list(self.probes.items()):
            if now - sent > self.probe_timeout_s:  # a hung probe: forget it, probe again
                del self.probes[ref]
                self.probe_at[r] = now

    def on_probe(self, ref) -> None:
        r, _ = self.probes.pop(ref)
        if self.state[r] != "down":
            return  # released or dead meanwhile
        try:
            ray.get(ref, timeout=self.probe_timeout_s)
        except ray.exceptions.ActorDiedError as e:
            self.failed(r, e)
        except (ray.exceptions.RayError, TimeoutError):
            self.probe_at[r] = time.monotonic() + PROBE_EVERY_S  # still restarting
        else:
            if self.state[r] == "down":
                log.warning("replica %d is back", r)
                self.state[r] = "up"
                del self.down_since[r]


def node_loss(err: Exception) -> str | None:
    """Why a replica's node went away, as Ray reports it: "preempted" (the node was drained for
    preemption), "drained" (it ended as expected: drained, scaled down), "lost" (it died
    unexpectedly), "unavailable" (the connection to it broke); None when the failure is the
    replica's own. Rows lost this way are retried
    without counting against `replicas.max_retries`."""
    if not isinstance(err, ray.exceptions.RayActorError):
        return None
    if isinstance(err, ray.exceptions.ActorUnavailableError):
        # What a node that just went away looks like first (connection reset), before Ray
        # knows why; Ray says the rows "may or may not have been executed": not their fault.
        return "unavailable"
    if err.preempted:
        return "preempted"
    text = str(err)
    if "terminated expectedly" in text:
        return "drained"
    if "its node has died" in text or "node it was running on is dead" in text:
        return "lost"
    return None
