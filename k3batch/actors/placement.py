"""Groups of actors that talk over torch.distributed: one actor per bundle of a placement group,
and the rendezvous that joins them into one process group (NCCL on GPU, gloo on CPU).

Protocol for a group actor class: `endpoint()` returns `free_endpoint()` (called on rank 0 only)
and `init_group(host, port)` calls `join_process_group` before anything that needs the group.
"""

import socket
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def actor_device(device: str) -> torch.device:
    """The torch device of a group actor ('cpu' or 'cuda': the GPU Ray assigned it). CPU actors
    run the tiny debug flavors with one intra-op thread (see build.build_engine)."""
    if device == "cpu":
        torch.set_num_threads(1)
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def free_endpoint() -> tuple[str, int]:
    """This node's address and a free port: the rendezvous of a group whose rank 0 runs here."""
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def join_process_group(device_type: str, host: str, port: int, rank: int, world_size: int,
                       timeout_s: float = 600) -> None:  # fmt: skip
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def spawn_group(actor_cls, kwargs_per_rank: list[dict], *, device: str, placement_group=None,
                first_bundle: int = 0, num_gpus: float = 0) -> list:  # fmt: skip
    """One actor per rank (rank r in bundle first_bundle + r when a placement group is given),
    joined into one process group before this returns."""
    remote_cls = ray.remote(actor_cls)
    actors = []
    for r, kwargs in enumerate(kwargs_per_rank):
        opts = {"num_cpus": 1 if device == "cpu" else 0.1, "num_gpus": num_gpus}
        if placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=first_bundle + r
            )
        actors.append(remote_cls.options(**opts).remote(**kwargs))
    host, port = ray.get(actors[0].endpoint.remote())
    ray.get([a.init_group.remote(host, port) for a in actors])
    return actors


def batch_meta(batch) -> dict:
    """What a group's actors need of a ForwardBatch (the rest stays with the engine)."""
    return {
        "seq_lens": batch.seq_lens,
        "cached_lens": batch.cached_lens,
        "slot_ids": batch.slot_ids,
        "page_tables": batch.page_tables,
    }
