"""Groups of actors that talk over torch.distributed: one actor per bundle of a placement group,
and the rendezvous that joins them into one process group (NCCL on GPU, gloo on CPU).

A world may hold actors of several classes (a replica's prefill stages and decode ranks: one
group, so that the handoff can go stage to rank over it). Protocol for a member class:
`endpoint()` returns `free_endpoint()` (called on world rank 0 only), `init_group(host, port,
rank, world_size)` calls `join_process_group` before anything that needs the group, and `ping()`
returns `member_info()` (the replica's watchdog and the fault tests call it).

Nothing here waits without a bound: spawning a group waits at most `timeout_s` for the actors to
be placed, load their weights and join (then kills them and raises TimeoutError naming who did
not answer and which resources were missing), and `get_within` is the bounded `ray.get` that
every call on a group goes through: an error from any member surfaces at once, not behind a
member that hangs.
"""

import gc
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# A stage or rank is placed, loads its shard of the checkpoint and joins its group within this.
SPAWN_TIMEOUT_S = 1800.0
# One call on a group (a forward step, a cache read, a stats read) answers within this.
CALL_TIMEOUT_S = 600.0


def actor_device(device: str) -> "torch.device":
    """The torch device of a group actor ('cpu' or 'cuda': the GPU Ray assigned it). CPU actors
    run the tiny debug flavors with one intra-op thread (see build.build_engine). torch is
    imported here and in `join_process_group`, inside the actors: the driver that places them
    imports this module without it."""
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def freeze_start_up() -> None:
    """Keep the objects alive at the end of an actor's start-up (modules, the model, torch's,
    Triton's and Ray's: about 470,000 in a Kimi Linear replica on CPU) out of every later
    garbage collection. A full collection walks every tracked object (0.2 s for those on a
    2-core CPU) and the step it falls in waits; after this, only what the job made is walked.
    Called last by the actors that serve (a replica, a Ray Data replica, a prefill stage, a
    decode rank); `bench job`'s engine-alone run, in the caller's process, thaws them after."""
    gc.collect()
    gc.freeze()


def free_endpoint() -> tuple[str, int]:
    """This node's address and a free port: the rendezvous of a group whose rank 0 runs here."""
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def member_info() -> dict:
    """Where a group actor runs: its process id and Ray node id."""
    return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


def join_process_group(device_type: str, host: str, port: int, rank: int, world_size: int,
                       timeout_s: float = 600) -> None:  # fmt: skip
    import torch.distributed as dist

    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def get_within(refs: list, timeout_s: float, labels: list[str]) -> list:
    """ray.get(refs), bounded: the first member error is raised as soon as it arrives (not after
    the members before it answer), and after `timeout_s` a TimeoutError names the labels of the
    refs still unanswered. labels[i] names refs[i] ("prefill stage 1")."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
        if not ready:
            late = [lab for ref, lab in zip(refs, labels) if ref in pending]
            raise TimeoutError(f"no answer from {', '.join(late)} within {timeout_s:g} s")
        ray.get(ready)  # a member's error raises here
    return ray.get(list(refs))


@dataclass(frozen=True, kw_only=True, slots=True)
class Members:
    """One kind of member of a world: the actor class, one kwargs dict per member (in world
    rank order), the role that names them ("prefill stage"), the placement-group bundle of the
    first member (the others follow) and the GPUs each takes."""

    actor_cls: type
    kwargs: list[dict]
    role: str
    first_bundle: int = 0
    num_gpus: float = 0


def spawn_world(parts: list[Members], *, device: str, placement_group=None,
                timeout_s: float = SPAWN_TIMEOUT_S) -> list[list]:  # fmt: skip
    """One actor per member of every part, all joined into one process group before this
    returns (world rank = position in the parts taken in order; `init_group(host, port, rank,
    world_size)` on each), within `timeout_s`; returns the actors of each part. On any failure
    (an actor died while loading, resources that never came, a hung rendezvous) every actor is
    killed and the error raised: a TimeoutError names the members that did not answer and, if
    the placement group is not fully placed, its bundles."""
    actors, labels, sizes = [], [], []
    t0 = time.monotonic()
    try:
        for part in parts:
            remote_cls = ray.remote(part.actor_cls)
            opts = {"num_cpus": 1 if device == "cpu" else 0.1, "num_gpus": part.num_gpus}
            for r, kwargs in enumerate(part.kwargs):
                if placement_group is not None:
                    opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        placement_group, placement_group_bundle_index=part.first_bundle + r
                    )
                actors.append(remote_cls.options(**opts).remote(**kwargs))
                labels.append(f"{part.role} {r}")
            sizes.append(len(part.kwargs))
        ((host, port),) = get_within([actors[0].endpoint.remote()], timeout_s, labels[:1])
        left = timeout_s - (time.monotonic() - t0)
        n = len(actors)
        joins = [a.init_group.remote(host, port, rank, n) for rank, a in enumerate(actors)]
        get_within(joins, max(left, 1.0), labels)
    except TimeoutError as e:
        _kill(actors)
        roles = " and ".join(f"{p.role}s" for p in parts)
        raise TimeoutError(f"starting a group of {roles}: {e}{_missing(placement_group)}") from e
    except BaseException:
        _kill(actors)
        raise
    out, first = [], 0
    for size in sizes:
        out.append(actors[first : first + size])
        first += size
    return out


def _missing(pg) -> str:
    if pg is None:
        return ""
    ready, _ = ray.wait([pg.ready()], timeout=0)
    return "" if ready else f"; waiting for resources {pg.bundle_specs} (placement group)"


def _kill(actors: list) -> None:
    for a in actors:
        ray.kill(a)


def shutdown_actors(actors: list, timeout_s: float = 30.0) -> None:
    """Call each actor's `shutdown`, then kill them all: a dead or hung actor holds nothing up
    for longer than timeout_s."""
    try:
        ray.get([a.shutdown.remote() for a in actors], timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError):
        pass  # a dead or hung actor: killed below
    finally:
        _kill(actors)


def batch_meta(batch) -> dict:
    """What a group's actors need of a ForwardBatch (the rest stays with the engine)."""
    return {
        "seq_lens": batch.seq_lens,
        "cached_lens": batch.cached_lens,
        "slot_ids": batch.slot_ids,
        "page_tables": batch.page_tables,
    }
