"""The decode half of a replica: a TP group of N DecodeRankActors (one per device, N >= 1; in the
replica's placement group, on one node when its GPUs fit one), and the DecodeGroupRunner that
drives it behind the engine's runner protocol. The ranks are world ranks P..P+N-1 of the
replica's process group (NCCL on GPU, gloo on CPU), after the P prefill stages; their TP and DCP
groups are subgroups of it.

Each rank loads only its shard of the checkpoint and keeps, in its arena (`cache.paged`), per
request a KDA block with its heads of every KDA state and MLA pages with its token stripe of
every latent (DCP). The engine places blocks and pages for all ranks at once (the same
indices everywhere). Requests arrive by handoff: every prefill stage reshards its layers of a
finished prompt to each rank's layout and sends them, one packed buffer per rank, over the
replica's group (device to device on GPUs); only the buffers' manifests go through Ray.
"""

import time

import torch
import torch.distributed as dist

from k3batch.actors.placement import (
    CALL_TIMEOUT_S,
    actor_device,
    batch_meta,
    free_endpoint,
    freeze_start_up,
    get_within,
    join_process_group,
    member_info,
    shutdown_actors,
)
from k3batch.cache.paged import PagedCache
from k3batch.engine.config import EngineConfig
from k3batch.engine.graphs import DecodeGraphs
from k3batch.engine.runner import arena_bytes
from k3batch.model.config import K3Config
from k3batch.model.forward_batch import ForwardBatch
from k3batch.model.loader import resolve_expert_dtype
from k3batch.parallel import handoff, tp
from k3batch.parallel.group import create_groups
from k3batch.parallel.layout import ParallelLayout


class DecodeRankActor:
    def __init__(
        self,
        model_dir: str,
        layout: ParallelLayout,
        *,
        tp_rank: int,
        engine_config: EngineConfig,
        device: str,
        dtype: torch.dtype,
    ):
        self.model_dir, self.layout, self.tp_rank = model_dir, layout, tp_rank
        self.engine_config, self.dtype = engine_config, dtype
        self.device = actor_device(device)
        self.config = K3Config.from_hf(model_dir)
        self.handoff_bytes = 0
        self.handoff_s = 0.0  # from posting the receives to the data in this rank's memory
        self.num_handoffs = 0
        self.static_steps = 0  # decode steps run on the static buffers (graphs on CUDA)
        self.broken: str | None = None  # why a handed-off request is missing: forward refuses

    def endpoint(self) -> tuple[str, int]:
        return free_endpoint()

    def ping(self) -> dict:
        return member_info() | {"role": "decode", "rank": self.tp_rank}

    def init_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Join the replica's group (world rank `rank`; the prefill stages are the ranks before
        the decode ranks), then build this rank's model and cache (they need the groups)."""
        join_process_group(self.device.type, host, port, rank, world_size)
        self.num_stages = rank - self.tp_rank
        tp_group, dcp_group = create_groups(self.layout, first_rank=self.num_stages)
        decode_ranks = range(self.num_stages, self.num_stages + self.layout.tp_size)
        handoff.connect(list(range(self.num_stages)), list(decode_ranks), rank, self.device)
        self.model = tp.build_rank_model(
            self.config, self.layout, tp_group, dcp_group, dtype=self.dtype, device=self.device,
            expert_dtype=resolve_expert_dtype(self.model_dir),
        )  # fmt: skip
        tp.load_rank_weights_(self.model, self.model_dir, self.layout, self.tp_rank)
        self.model.eval()
        cfg = self.engine_config
        layout = tp.rank_cache_layout(
            self.config,
            self.layout,
            page_size=cfg.page_size,
            dtype_bytes=self.dtype.itemsize,
        )
        # One extra request's room: the scratch block and page of padding rows (see Engine).
        total = arena_bytes(layout, cfg, self.device, dcp_size=self.layout.dcp_size, extra=1)
        self.cache = PagedCache(
            layout, total, device=self.device, dtype=self.dtype, dcp_size=self.layout.dcp_size
        )
        # Decode steps run on static buffers (the same path as the single-device engine's
        # graphs), replayed as CUDA graphs on GPUs; every rank captures here at once.
        capture = self.device.type == "cuda" and cfg.cuda_graphs
        self.graphs = DecodeGraphs.build(self.model, self.cache, cfg, capture=capture)
        freeze_start_up()

    def cache_spec(self):
        return self.cache.spec

    def apply(self, moves) -> None:
        self.cache.apply(moves)

    def import_request(self, block: int, pages: list[int], manifests: list) -> int:
        """Receive a handed-off request from every prefill stage and store it in a block and
        pages: manifests[s] is the object ref of the manifest of the buffer that stage s (world
        rank s) sends this rank. Returns the bytes received. Nobody waits for this call, so a
        failure (a stage lost with its manifest or its buffer, a fetch that timed out) marks the
        rank broken: its next forward raises instead of decoding from a cache that lacks the
        request."""
        try:
            labels = [f"handoff manifest of prefill stage {s}" for s in range(len(manifests))]
            manifests = get_within(list(manifests), CALL_TIMEOUT_S, labels)
            # The stages posted their sends before returning the manifests: from here on it
            # is the transfer.
            t0 = time.perf_counter()
            bufs = [torch.empty(m.num_bytes, dtype=torch.uint8, device=self.device)
                    for m in manifests]  # fmt: skip
            for work in [dist.irecv(b, src=s) for s, b in enumerate(bufs)]:
                work.wait()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            seconds = time.perf_counter() - t0
            for buf, m in zip(bufs, manifests):
                self.cache.write_request_(block, pages, handoff.unpack(buf, m))
        except BaseException as e:
            self.broken = f"importing a request into block {block} failed: {e!r}"
            raise
        n = sum(m.num_bytes for m in manifests)
        self.handoff_bytes += n
        self.handoff_s += seconds
        self.num_handoffs += 1
        return n

    @torch.inference_mode()
    def forward(self, ids: list[int], meta: dict, all_logits: bool):
        """One decode step on every rank (the same tokens everywhere); rank 0 returns the
        full-vocabulary logits (fp32, CPU)."""
        if self.broken:
            raise RuntimeError(f"decode rank {self.tp_rank}: {self.broken}")
        batch = ForwardBatch(**meta)
        if DecodeGraphs.serves(batch, all_logits):
            logits = self.graphs.run(ids, batch)
            self.static_steps += 1
        else:
            x = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
            logits = self.model.forward_batch(x, batch, self.cache, all_logits=all_logits)
        return logits.float().cpu() if self.tp_rank == 0 else None

    def request_tensors(self, block: int, pages: list[int], num_local_tokens: int) -> dict:
        """This rank's cache of one request (tests compare it with the resharded reference)."""
        out = self.cache.request_tensors(block, pages, num_local_tokens)
        return {kind: {i: t.cpu() for i, t in d.items()} for kind, d in out.items()}

    def stats(self) -> dict:
        return {
            "rank": self.tp_rank,
            "handoff_bytes": self.handoff_bytes,
            "handoff_s": self.handoff_s,
            "handoffs": self.num_handoffs,
            "static_steps": self.static_steps,
            "graphs": len(self.graphs.graphs),
        }

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DecodeGroupRunner:
    """A TP (+DCP) decode group behind the runner protocol: `submit` sends one decode batch
    to every rank, `wait` returns rank 0's logits. `import_request` hands a request over.
    Decode batches come padded to a power of two (`pads_decode`)."""

    depth = 1
    pads_decode = True

    def __init__(self, ranks: list, *, config: K3Config, layout: ParallelLayout):
        """ranks: the rank actors, joined in the replica's group (`world.spawn_runners`)."""
        self.ranks, self.config, self.layout = ranks, config, layout
        self.dcp_size = layout.dcp_size
        self.labels = [f"decode rank {r}" for r in range(layout.tp_size)]

    call_timeout_s = CALL_TIMEOUT_S

    def _get(self, refs: list) -> list:
        return get_within(refs, self.call_timeout_s, self.labels)

    def members(self) -> list[tuple[str, object]]:
        """(label, actor handle) of every rank: what the replica's watchdog pings."""
        return list(zip(self.labels, self.ranks))

    def submit(self, ids: list[int], batch: ForwardBatch, all_logits: bool):
        meta = batch_meta(batch)
        return [a.forward.remote(ids, meta, all_logits) for a in self.ranks]

    def wait(self, refs):
        return self._get(refs)[0]  # every rank's ref: a failing rank raises here

    def cache_specs(self) -> list:
        return self._get([a.cache_spec.remote() for a in self.ranks])

    def apply(self, moves) -> None:
        if moves:
            for a in self.ranks:
                a.apply.remote(moves)

    def import_request(self, block: int, pages: list[int], per_rank: list[list]) -> list:
        """per_rank[r]: the refs of rank r's manifests from every prefill stage, in stage
        order (`PipelineRunner.export_request`)."""
        return [
            a.import_request.remote(block, pages, per_rank[r]) for r, a in enumerate(self.ranks)
        ]

    def stats(self) -> dict:
        ranks = self._get([a.stats.remote() for a in self.ranks])
        return {
            "handoff_bytes_per_rank": [s["handoff_bytes"] for s in ranks],
            "handoff_s_per_rank": [s["handoff_s"] for s in ranks],
            "handoffs": ranks[0]["handoffs"],
            "static_steps": ranks[0]["static_steps"],
            "graphs_per_rank": [s["graphs"] for s in ranks],
        }

    def shutdown(self) -> None:
        shutdown_actors(self.ranks)
