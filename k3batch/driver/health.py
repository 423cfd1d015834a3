"""Replica health as the driver sees it: "up" (gets rows), "down" (failed, restarting: probed
with `ready()` until it answers) or "dead" (out of restarts, or down for longer than
`down_timeout_s`). Every probe is bounded: one not answered within `probe_timeout_s` counts as
a failed probe. The job fails, naming the last error, only when every replica is dead. While no
replica is up (nodes lost, replicas being rebuilt), a warning says so every `WAIT_LOG_EVERY_S`.
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
        self.state = ["up"] * len(replicas)
        self.down_timeout_s, self.probe_timeout_s = down_timeout_s, probe_timeout_s
        self.down_since: dict[int, float] = {}
        self.probes: dict = {}  # ready() ref -> (replica index, sent at)
        self.probe_at: dict[int, float] = {}  # replica index -> when to probe next
        self.failures = 0
        self.logged_at = 0.0  # last "no replica is up" warning

    def up(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == "up"]

    def failed(self, r: int, err: Exception) -> None:
        """Replica r failed a call with `err`: it is down (or dead) from now on."""
        if self.state[r] == "up":
            self.failures += 1
        if isinstance(err, ray.exceptions.ActorDiedError):
            self._dead(r, err)
        elif self.state[r] == "up":
            self.state[r] = "down"
            self.down_since[r] = time.monotonic()
            self.probe_at[r] = time.monotonic()

    def _dead(self, r: int, err: Exception) -> None:
        self.state[r] = "dead"
        self.probe_at.pop(r, None)
        log.error("replica %d is dead: %s", r, err)
        if all(s == "dead" for s in self.state):
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
                self._dead(r, TimeoutError(f"down for more than {self.down_timeout_s:.0f} s"))
            elif at <= now:
                del self.probe_at[r]
                self.probes[self.replicas[r].ready.remote()] = (r, now)
        for ref, (r, sent) in list(self.probes.items()):
            if now - sent > self.probe_timeout_s:  # a hung probe: forget it, probe again
                del self.probes[ref]
                self.probe_at[r] = now

    def on_probe(self, ref) -> None:
        r, _ = self.probes.pop(ref)
        try:
            ray.get(ref, timeout=self.probe_timeout_s)
        except ray.exceptions.ActorDiedError as e:
            self._dead(r, e)
        except (ray.exceptions.RayError, TimeoutError):
            self.probe_at[r] = time.monotonic() + PROBE_EVERY_S  # still restarting
        else:
            if self.state[r] == "down":
                log.warning("replica %d is back", r)
                self.state[r] = "up"
                del self.down_since[r]
