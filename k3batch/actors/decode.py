"""The decode half of a replica: a TP group of DecodeRankActors (one per device, STRICT_PACK so
they share a node) with one torch.distributed group among them (NCCL on GPU, gloo on CPU), and
the DecodeGroupRunner that drives it behind the engine's runner protocol.

Each rank loads only its shard of the checkpoint and keeps, per request slot, its heads of every
KDA state and its token stripe of every MLA latent (DCP). Requests arrive by handoff: the
prefill side reshards a finished prompt's caches to each rank's layout and the pieces travel
actor to actor through the object store (never through the driver).
"""

import ray
import torch
import torch.distributed as dist

from k3batch.actors.placement import (
    actor_device,
    batch_meta,
    free_endpoint,
    join_process_group,
    spawn_group,
)
from k3batch.model.config import K3Config
from k3batch.model.forward_batch import ForwardBatch
from k3batch.parallel import handoff, tp
from k3batch.parallel.group import ParallelLayout, create_groups


class DecodeRankActor:
    def __init__(
        self,
        model_dir: str,
        layout: ParallelLayout,
        *,
        tp_rank: int,
        num_slots: int,
        max_seq_len: int,
        device: str,
        dtype: torch.dtype,
    ):
        self.model_dir, self.layout, self.tp_rank = model_dir, layout, tp_rank
        self.num_slots, self.max_seq_len, self.dtype = num_slots, max_seq_len, dtype
        self.device = actor_device(device)
        self.config = K3Config.from_hf(model_dir)
        self.handoff_bytes = 0
        self.num_handoffs = 0

    def endpoint(self) -> tuple[str, int]:
        return free_endpoint()

    def init_group(self, host: str, port: int) -> None:
        """Join the group, then build this rank's model and cache (they need the groups)."""
        join_process_group(self.device.type, host, port, self.tp_rank, self.layout.tp_size)
        tp_group, dcp_group = create_groups(self.layout)
        self.model = tp.build_rank_model(
            self.config, self.layout, tp_group, dcp_group, dtype=self.dtype, device=self.device
        )
        tp.load_rank_weights_(self.model, self.model_dir, self.layout, self.tp_rank)
        self.model.eval()
        self.cache = tp.rank_cache(
            self.config,
            self.layout,
            self.tp_rank,
            num_slots=self.num_slots,
            max_seq_len=self.max_seq_len,
            device=self.device,
            dtype=self.dtype,
        )

    def import_request(self, slot: int, pieces: list) -> int:
        """Store a handed-off request: `pieces` are this rank's shares (dicts, or object refs to
        them) from every prefill stage. Returns the bytes received."""
        n = 0
        for p in pieces:
            p = ray.get(p) if isinstance(p, ray.ObjectRef) else p
            handoff.write_request_(self.cache, slot, p)
            n += handoff.handoff_bytes(p)
        self.handoff_bytes += n
        self.num_handoffs += 1
        return n

    @torch.inference_mode()
    def forward(self, ids: list[int], meta: dict, all_logits: bool):
        """One decode step on every rank (the same tokens everywhere); rank 0 returns the
        full-vocabulary logits (fp32, CPU)."""
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits = self.model.forward_batch(
            x, ForwardBatch(**meta), self.cache, all_logits=all_logits
        )
        return logits.float().cpu() if self.tp_rank == 0 else None

    def cache_slot(self, slot: int) -> dict:
        """This rank's cache for one slot (tests compare it with the resharded reference)."""
        return {
            name: {i: t[slot].cpu() for i, t in getattr(self.cache, name).items()}
            for name in ("kda_state", "kda_conv", "mla_latent")
        }

    def stats(self) -> dict:
        return {
            "rank": self.tp_rank,
            "handoff_bytes": self.handoff_bytes,
            "handoffs": self.num_handoffs,
        }

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DecodeGroupRunner:
    """A TP (+DCP) decode group behind the runner protocol: `submit` sends one decode batch
    to every rank, `wait` returns rank 0's logits. `import_request` hands a request over."""

    depth = 1

    def __init__(
        self,
        model_dir: str,
        layout: ParallelLayout,
        *,
        num_slots: int,
        max_seq_len: int,
        device: str,
        dtype: torch.dtype,
        placement_group=None,
        first_bundle: int = 0,
        gpus_per_rank: float = 0,
    ):
        self.config, self.layout = K3Config.from_hf(model_dir), layout
        # One extra slot takes the padding rows of a bucketed decode batch (see Engine).
        self.scratch_slot = num_slots
        kwargs = dict(
            model_dir=model_dir,
            layout=layout,
            num_slots=num_slots + 1,
            max_seq_len=max_seq_len,
            device=device,
            dtype=dtype,
        )
        self.ranks = spawn_group(
            DecodeRankActor,
            [kwargs | {"tp_rank": r} for r in range(layout.tp_size)],
            device=device,
            placement_group=placement_group,
            first_bundle=first_bundle,
            num_gpus=gpus_per_rank,
        )

    def submit(self, ids: list[int], batch: ForwardBatch, all_logits: bool):
        meta = batch_meta(batch)
        return [a.forward.remote(ids, meta, all_logits) for a in self.ranks]

    def wait(self, refs):
        return ray.get(refs)[0]  # every rank's ref: a failing rank raises here

    def import_request(self, slot: int, per_rank: list[list]) -> list:
        """per_rank[r]: rank r's pieces from every prefill stage (dicts or object refs)."""
        return [a.import_request.remote(slot, per_rank[r]) for r, a in enumerate(self.ranks)]

    def stats(self) -> dict:
        ranks = ray.get([a.stats.remote() for a in self.ranks])
        return {
            "handoff_bytes_per_rank": [s["handoff_bytes"] for s in ranks],
            "handoffs": ranks[0]["handoffs"],
        }

    def shutdown(self) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.ranks], timeout=30)
        finally:
            for a in self.ranks:
                ray.kill(a)
