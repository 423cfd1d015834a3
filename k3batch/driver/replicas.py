"""Elastic replicas: one resource request per replica, replicas added as resources appear and
released when the remaining work no longer needs them.

A replica is one placement group holding all of its bundles (the replica actor, its prefill
stages and decode ranks), reserved together: Ray places the whole group or nothing, so a
partial replica never holds GPUs and two replicas can never each hold half of what both need.
The group is STRICT_PACK (one node) when the replica's GPUs fit one node
(`replicas.gpus_per_node`), else PACK (as few nodes as Ray can, still all or nothing).

The pool has `max` slots. Every slot's group is requested at the start: a group not placed yet
is what an autoscaler sees as pending demand (`ray status` lists it), so it adds nodes of a type
whose declared resources fit the bundles (GPU count and `accelerator_type:<type>`). We do not
call `ray.autoscaler.sdk.request_resources`: it sets a floor the cluster keeps after the job
unless reset, and it cannot say that bundles belong together; pending groups say exactly what
is needed and disappear with the job.

Slot life: "pending" (group requested; once placed the actor is created and its `ready()` is
awaited) -> "up" / "down" / "rebuild" / "dead" (`Health`) -> "draining" (gets no new rows,
finishes its own) -> "released" (actor killed, group removed: its node goes idle and the
autoscaler can remove it). Ray restarts a replica whose process died or that the driver
restarted (`max_restarts=-1`: `Health` bounds failures in a row instead); one whose constructor
raised ("rebuild") gets a new actor in the same group. A replica whose node was drained,
preempted or lost ("moved") goes back to "pending" with a new group; its rows are retried
elsewhere without counting against `max_retries` (`dispatch`).
The job starts as soon as `min` replicas are up (`start`, bounded by
`replicas.wait_timeout_s` with a message every `NOTICE_EVERY_S`). `step()` turns placed groups
into replicas and, once the input is exhausted, drains replicas beyond what the rows left need
(one replica per window of rows, `JobSpec.inflight_rows`) and cancels groups not placed yet.
"""

import logging
import time

import ray
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3batch.driver.health import Health
from k3batch.driver.jobspec import JobSpec, ReplicaSpec

log = logging.getLogger(__name__)

NOTICE_EVERY_S = 30.0
STATS_TIMEOUT_S = 30.0


def replica_bundles(r: ReplicaSpec, device: str) -> tuple[list[dict], str]:
    """The bundles of one replica and the group's strategy. A single-device replica: one bundle
    with the replica's device(s). Otherwise bundle 0 is a light coordinator (the replica actor),
    then one bundle (one device) per prefill stage, then one per decode rank (a decode group:
    tp > 1 or disaggregate)."""
    cuda = device == "cuda"
    accel = {f"accelerator_type:{r.accelerator_type}": 0.001} if r.accelerator_type and cuda else {}
    if r.is_single_device:
        gpus = (r.num_gpus if r.num_gpus is not None else 1) if cuda else 0
        bundles = [{"CPU": 1, "GPU": gpus, **accel}]
    else:
        gpus = r.num_workers if cuda else 0
        worker = {"CPU": 1, "GPU": 1 if cuda else 0, **accel}
        bundles = [{"CPU": 1}] + [worker] * r.num_workers
    bundles = [{k: v for k, v in b.items() if v} for b in bundles]
    return bundles, "STRICT_PACK" if gpus <= r.gpus_per_node else "PACK"


class ReplicaPool:
    def __init__(self, spec: JobSpec, device: str, *, replica_cls, replica_kw=None,
                 t0: float | None = None):  # fmt: skip
        """t0: the job's start (time.monotonic()), from which the timeline counts."""
        r = spec.replicas
        self.spec, self.device, self.r = spec, device, r
        self.replica_cls, self.replica_kw = ray.remote(replica_cls), replica_kw or {}
        self.bundles, self.strategy = replica_bundles(r, device)
        self.groups: list = [None] * r.max_replicas
        self.actors: list = [None] * r.max_replicas  # shared with Health and the Dispatcher
        self.builds = [0] * r.max_replicas  # actors created per slot (their names)
        self.health = Health(self.actors, down_timeout_s=r.wait_timeout_s,
                             max_failures=r.max_consecutive_failures)  # fmt: skip
        self.placing: dict = {}  # pg.ready() ref -> slot
        self.starting: dict = {}  # actor ready() ref -> (slot, sent at)
        self.t0 = time.monotonic() if t0 is None else t0
        self.idle_since: float | None = None  # no replica up or draining since
        self.idle_noticed = 0.0  # when the last "no replica is up" warning was logged
        self.timeline: list[tuple[float, int]] = []  # (s since start, replicas up), on change
        self.final_stats: list[dict] = []  # of replicas released before the end

    # ---- the loop's interface ------------------------------------------------------------
    def refs(self) -> list:
        return [*self.placing, *self.starting, *self.health.refs()]

    def owns(self, ref) -> bool:
        return ref in self.placing or ref in self.starting or ref in self.health.probes

    def on_ready(self, ref) -> None:
        if ref in self.placing:
            self._create(self.placing.pop(ref))
        elif ref in self.starting:
            self._started(ref)
        else:
            self.health.on_probe(ref)
        self._record()

    def step(self, dispatch, exhausted: bool) -> None:
        """Scale down at the tail, release drained replicas, probe down ones, bound waits."""
        now = time.monotonic()
        for ref, (i, sent) in list(self.starting.items()):
            if now - sent > self.r.wait_timeout_s:
                del self.starting[ref]
                log.error("replica %d not ready after %g s (replicas.wait_timeout_s): model "
                          "loading or stage startup did not finish", i, self.r.wait_timeout_s)
                self._release(i)  # fmt: skip
        self._tend()
        if exhausted:
            self._shrink(dispatch)
        self.health.send_probes()
        serving = [i for i, s in enumerate(self.health.state)
                   if s in ("up", "down", "draining", "rebuild")]  # fmt: skip
        if serving or not (self.placing or self.starting):
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        elif now - self.idle_since > self.r.wait_timeout_s:
            raise RuntimeError(
                f"gave up waiting for resources: no replica up for {now - self.idle_since:.0f} s "
                f"(replicas.wait_timeout_s = {self.r.wait_timeout_s:g}); {len(self.placing)} "
                f"replica(s) wait for bundles {self.bundles} ({self.strategy}); the cluster has "
                f"{_free()} free"
            )
        elif now - self.idle_noticed >= NOTICE_EVERY_S:  # replicas moved or rebuilt: say so
            self.idle_noticed = now
            log.warning("no replica is up; %s", self._startup_notice(
                self.r.min_replicas, now - self.idle_since, self.r.wait_timeout_s))  # fmt: skip
        self._record()

    # ---- startup -------------------------------------------------------------------------
    def start(self) -> None:
        """Request every replica's group, then block until `min` replicas are up (the rest keep
        coming while the job runs); RuntimeError after `replicas.wait_timeout_s`, naming what
        is missing. `shutdown()` removes the groups, also after an error here."""
        for i in range(self.r.max_replicas):
            self.groups[i] = placement_group(self.bundles, strategy=self.strategy)
            self.placing[self.groups[i].ready()] = i
        timeout_s, need = self.r.wait_timeout_s, self.r.min_replicas
        t_start = noticed = time.monotonic()
        while len(self.health.up()) < need:
            waited = time.monotonic() - t_start
            if waited >= timeout_s:
                raise RuntimeError(
                    f"waited {waited:.0f} s (replicas.wait_timeout_s = {timeout_s:g}) for "
                    f"{need} replica(s) (replicas.num_replicas min): {len(self.health.up())} up, "
                    f"{len(self.placing)} placement groups not placed; each asks for bundles "
                    f"{self.bundles} ({self.strategy}); the cluster has {_free()} free"
                )
            if time.monotonic() - noticed >= NOTICE_EVERY_S:
                noticed = time.monotonic()
                log.warning("%s", self._startup_notice(need, waited, timeout_s))
            self._tend()
            self.health.send_probes()
            refs = self.refs()
            if not refs and not self.health.waiting and "rebuild" not in self.health.state:
                raise RuntimeError(f"replicas failed to start; states: {self.health.state}")
            step = min(NOTICE_EVERY_S, max(timeout_s - waited, 0.0), 1.0)
            ready, _ = ray.wait(refs, num_returns=1, timeout=step) if refs else ([], [])
            for ref in ready:
                self.on_ready(ref)

    def _tend(self) -> None:
        """Decide waiting verdicts; move replicas whose node is gone; rebuild those whose
        actor is gone."""
        self.health.revisit()
        for i, s in enumerate(self.health.state):
            if s == "moved":
                self._move(i)
            elif s == "rebuild":
                self._create(i)

    def _startup_notice(self, need: int, waited: float, timeout_s: float) -> str:
        """What start-up waits for: replicas placed and starting (loading the model, sizing
        memory, warming kernels up), or placement groups the cluster cannot place yet."""
        notice = (f"waiting for replicas: {len(self.health.up())} of {self.r.max_replicas} up "
                  f"(min {need}), {waited:.0f} of {timeout_s:g} s")  # fmt: skip
        if self.starting:
            notice += (f"; {len(self.starting)} placed and starting (model load, memory "
                       "sizing, kernel warm-up)")  # fmt: skip
        if self.placing:
            notice += (f"; {len(self.placing)} waiting for resources: each asks for bundles "
                       f"{self.bundles} ({self.strategy}), pending for the autoscaler; free: "
                       f"{_free()}")  # fmt: skip
        return notice

    def _create(self, i: int) -> None:
        single = self.r.is_single_device
        gpus = self.bundles[0].get("GPU", 0) if single else 0
        self.actors[i] = self._new_actor(i, gpus, single)
        self.builds[i] += 1
        self.health.state[i] = "pending"
        self.health.node[i] = _bundle_node(self.groups[i])
        self.starting[self.actors[i].ready.remote()] = (i, time.monotonic())

    def _new_actor(self, i: int, gpus: float, single: bool):
        r = self.r
        return self.replica_cls.options(
            num_cpus=1,
            num_gpus=gpus,
            max_restarts=-1,  # bounded by Health: max_consecutive_failures in a row
            max_task_retries=0,
            max_concurrency=64,
            # a new name for each new actor of the slot: a dead actor keeps its name a while
            name=f"{self.spec.name}/replica-{i}" + (f".{self.builds[i]}" if self.builds[i] else ""),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.groups[i], placement_group_bundle_index=0
            ),
        ).remote(
            self.spec.model,
            self.spec.engine,
            self.device,
            pp=r.pp,
            pp_layers=r.pp_layers,
            tp=r.tp,
            dcp=r.dcp,
            disaggregate=r.disaggregate,
            placement_group=None if single else self.groups[i],
            **({"metrics": {"job": self.spec.name, "replica": str(i)}} if self.spec.metrics
               else {}),  # fmt: skip
            **self.replica_kw,
        )

    def _started(self, ref) -> None:
        i, _ = self.starting.pop(ref)
        try:
            answer = ray.get(ref, timeout=STATS_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.error("replica %d failed to start", i)
            f = self.health.failed(i, e)  # rebuilt, restarted or moved; a crash loop stops the job
            if f.verdict == "node" and self.health.state[i] == "pending":
                self.health.state[i] = "moved"  # its node went away while it started
            return
        self.health.start(i, answer.get("node_id"))
        log.info("replica %d up (%d up)", i, len(self.health.up()))

    # ---- the tail ------------------------------------------------------------------------
    def _shrink(self, dispatch) -> None:
        """The input is exhausted: keep one replica per window of rows left, drain the
        others (fewest rows in flight first), release drained replicas that hold no rows."""
        left = len(dispatch.queue) + sum(len(held) for held in dispatch.inflight)
        keep = -(-left // self.spec.inflight_rows)
        if keep <= len(self.health.up()):  # replicas not up yet are no longer needed
            for ref, i in list(self.placing.items()):
                del self.placing[ref]
                self._release(i)
            for ref, (i, _) in list(self.starting.items()):
                del self.starting[ref]
                self._release(i)
        up = sorted(self.health.up(), key=lambda i: len(dispatch.inflight[i]))
        for i in up[: max(len(up) - keep, 0)]:
            self.health.drain(i)
            log.info("replica %d draining (%d rows left in the job)", i, left)
        for i, s in enumerate(self.health.state):
            if s == "draining" and not dispatch.inflight[i]:
                self._release(i)

    def _move(self, i: int) -> None:
        """Replica i lost its node: take down what is left of it and request it anew (pending:
        the autoscaler sees the demand again if no live node has room)."""
        ray.kill(self.actors[i])
        remove_placement_group(self.groups[i])
        self.groups[i] = placement_group(self.bundles, strategy=self.strategy)
        self.placing[self.groups[i].ready()] = i
        self.health.state[i] = "pending"

    def _release(self, i: int) -> None:
        if self.health.state[i] in ("up", "draining"):
            self.final_stats += self._stats([i])
        if self.actors[i] is not None:
            ray.kill(self.actors[i])
        if self.groups[i] is not None:
            remove_placement_group(self.groups[i])
            self.groups[i] = None
        self.health.release(i)

    def _record(self) -> None:
        n = len(self.health.up())
        if not self.timeline or self.timeline[-1][1] != n:
            self.timeline.append((round(time.monotonic() - self.t0, 2), n))

    # ---- the end -------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.health.state = ["released"] * len(self.actors)
        self._record()
        for i in range(len(self.actors)):
            if self.actors[i] is not None:
                ray.kill(self.actors[i])
            if self.groups[i] is not None:
                remove_placement_group(self.groups[i])
                self.groups[i] = None

    def collect_stats(self) -> list[dict]:
        """stats() of every replica that served: those released on the way (read when they were
        released) and those up now."""
        return self.final_stats + self._stats(self.health.up())

    def _stats(self, slots: list[int]) -> list[dict]:
        """stats() of `slots`, each within STATS_TIMEOUT_S; a replica that fails or does not
        answer is left out (logged)."""
        refs = {self.actors[i].stats.remote(): i for i in slots}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=STATS_TIMEOUT_S)
        out = []
        for ref in refs:
            if ref not in ready:
                log.warning("replica %d: no statistics within %.0f s", refs[ref], STATS_TIMEOUT_S)
                continue
            try:
                out.append(ray.get(ref, timeout=STATS_TIMEOUT_S))
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("replica %d: no statistics: %s", refs[ref], e)
        return out


def _bundle_node(group) -> str | None:
    """The node of a placed group's first bundle (the replica actor's), or None."""
    try:
        return placement_group_table(group)["bundles_to_node_id"].get(0)
    except Exception:  # not placed any more (its node just went away): the answer tells
        return None


def _free() -> dict:
    try:
        return ray.available_resources()
    except Exception as e:  # the GCS itself is unreachable: say so instead
        return {"unknown": str(e)}
