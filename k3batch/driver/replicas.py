"""Starting the replicas and reading their statistics, every wait bounded.

A replica is a placement group (or two, with tp > 1) and one ReplicaActor in its first bundle.
Waiting for the groups is bounded by `replicas.wait_timeout_s`, with a visible message every
`NOTICE_EVERY_S`; a job that cannot get its resources fails naming the bundles it asked for,
what the cluster has free, and how long it waited. Actor startup (model loading) is bounded by
the same timeout. The final statistics ask only replicas that are up, within `STATS_TIMEOUT_S`.
"""

import logging
import time

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3batch.actors.replica import ReplicaActor
from k3batch.jobspec import JobSpec

log = logging.getLogger(__name__)

NOTICE_EVERY_S = 30.0
STATS_TIMEOUT_S = 30.0


def start_replicas(spec: JobSpec, device: str, groups: list, *, replica_cls=ReplicaActor,
                   replica_kw=None) -> list:  # fmt: skip
    """Placement groups per replica, and one replica actor in the first bundle of the first.
    pp = tp = 1: one bundle with the replica's device(s) (STRICT_PACK). Otherwise the replica is
    a light coordinator followed by one bundle (one device) per pipeline stage (PACK: stages may
    span nodes), and with tp > 1 a second group with one bundle per decode rank (STRICT_PACK: a
    decode group shares a node). GPU and accelerator-type requests let an autoscaler see the
    demand. Returns the actors (not ready yet: see `wait_until_ready`). Every placement group is
    appended to `groups` as soon as it exists, so the caller can remove them even on error."""
    r = spec.replicas
    cuda = device == "cuda"
    accel = {f"accelerator_type:{r.accelerator_type}": 0.001} if r.accelerator_type and cuda else {}
    single = r.pp == 1 and r.tp == 1
    worker = {"CPU": 1, "GPU": 1 if cuda else 0, **accel}
    if single:
        gpus = (r.num_gpus if r.num_gpus is not None else 1) if cuda else 0
        bundles, strategy = [{"CPU": 1, "GPU": gpus, **accel}], "STRICT_PACK"
    else:
        gpus = 0
        bundles, strategy = [{"CPU": 1}] + [worker] * r.pp, "PACK"
    drop_zeros = lambda bs: [{k: v for k, v in b.items() if v} for b in bs]  # noqa: E731
    replica_groups, decode_groups = [], [None] * r.num_replicas
    for i in range(r.num_replicas):
        replica_groups.append(placement_group(drop_zeros(bundles), strategy=strategy))
        groups.append(replica_groups[-1])
        if r.tp > 1:
            decode_groups[i] = placement_group(drop_zeros([worker] * r.tp), strategy="STRICT_PACK")
            groups.append(decode_groups[i])
    wait_for_groups(groups, r.wait_timeout_s)
    actor_cls = ray.remote(replica_cls)
    actors = [
        actor_cls.options(
            num_cpus=1,
            num_gpus=gpus,
            max_restarts=r.max_retries,
            max_task_retries=0,
            max_concurrency=64,
            name=f"{spec.name}/replica-{i}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0
            ),
        ).remote(
            spec.model,
            spec.engine,
            device,
            pp=r.pp,
            pp_layers=r.pp_layers,
            tp=r.tp,
            dcp=r.dcp,
            placement_group=None if single else pg,
            decode_placement_group=dpg,
            **(replica_kw or {}),
        )
        for i, (pg, dpg) in enumerate(zip(replica_groups, decode_groups))
    ]
    return actors


def wait_for_groups(groups: list, timeout_s: float) -> None:
    """Wait until every placement group is placed; RuntimeError after `timeout_s`, naming the
    bundles still waiting and what the cluster has free."""
    t0 = time.monotonic()
    pending = {pg.ready(): pg for pg in groups}
    while pending:
        waited = time.monotonic() - t0
        if waited >= timeout_s:
            asked = [pg.bundle_specs for pg in pending.values()]
            raise RuntimeError(
                f"waited {waited:.0f} s (replicas.wait_timeout_s = {timeout_s:g}) for resources: "
                f"{len(pending)} of {len(groups)} placement groups not placed; they ask for "
                f"bundles {asked}; the cluster has {_free()} free"
            )
        step = min(NOTICE_EVERY_S, timeout_s - waited)
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=step)
        for ref in ready:
            del pending[ref]
        if pending:
            log.warning(
                "waiting for resources for %d replica group(s) for %.0f s (of %g): bundles %s; "
                "free: %s",
                len(pending),
                time.monotonic() - t0,
                timeout_s,
                [pg.bundle_specs for pg in pending.values()],
                _free(),
            )


def wait_until_ready(actors: list, timeout_s: float) -> None:
    """Wait for every replica's `ready()` (model loaded); RuntimeError naming the replicas that
    did not answer within `timeout_s`, or the first startup error."""
    refs = {a.ready.remote(): i for i, a in enumerate(actors)}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    late = sorted(i for ref, i in refs.items() if ref not in ready)
    if late:
        raise RuntimeError(
            f"replica(s) {late} not ready after {timeout_s:g} s (replicas.wait_timeout_s): "
            f"model loading or stage startup did not finish"
        )
    ray.get(ready, timeout=STATS_TIMEOUT_S)  # raises the startup error of a failed replica


def collect_stats(actors: list, up: list[int]) -> list[dict]:
    """stats() of the replicas that are up, each within STATS_TIMEOUT_S; a replica that fails
    or does not answer is left out (logged)."""
    refs = {actors[i].stats.remote(): i for i in up}
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


def _free() -> dict:
    try:
        return ray.available_resources()
    except Exception as e:  # the GCS itself is unreachable: say so instead
        return {"unknown": str(e)}
