"""PrefillStageActor: one pipeline stage (a contiguous range of layers) as a Ray actor.

A stage loads only its layers' tensors, keeps every request's caches for those layers across
chunks in its arena (`cache.paged`; the engine places blocks and pages, the same indices on
every stage), and moves activations stage to stage with
torch.distributed point-to-point (gloo on CPU, NCCL on GPU) inside the actors; nothing goes
through the object store except the last stage's logits. Calls run one at a time in
submission order, so consecutive chunks flow through the stages like a conveyor: stage s works
on chunk c while stage s-1 works on chunk c+1, and a stage's send overlaps its next chunk.

Stages are world ranks 0..P-1 of the replica's group; with a decode group, its ranks follow
(P..P+N-1) and every stage hands its layers of a finished request to each of them over the
same group (`export_request`, `parallel.handoff`).
"""

import time
from collections import deque

import torch
import torch.distributed as dist

from k3batch.actors.placement import (
    actor_device,
    free_endpoint,
    freeze_start_up,
    join_process_group,
    member_info,
)
from k3batch.cache.layout import CacheLayout
from k3batch.cache.paged import PagedCache
from k3batch.engine.config import EngineConfig
from k3batch.engine.runner import arena_bytes
from k3batch.model.forward_batch import ForwardBatch
from k3batch.model.loader import load_model
from k3batch.parallel import handoff
from k3batch.parallel.group import create_groups
from k3batch.parallel.layout import ParallelLayout
from k3batch.parallel.pipeline import bank_size, pack_stream, unpack_stream

# Compute intervals a stage remembers (the newest); enough for bubble statistics of any bench,
# bounded for a job of millions of chunks.
BUSY_WINDOW = 4096


class PrefillStageActor:
    def __init__(
        self,
        model_dir: str,
        layer_range: tuple[int, int],
        *,
        rank: int,
        num_stages: int,
        decode_layout: ParallelLayout | None = None,
        engine_config: EngineConfig,
        device: str,
        dtype: torch.dtype,
    ):
        """decode_layout: the decode group this stage hands requests to (None: none)."""
        self.rank, self.num_stages, self.decode_layout = rank, num_stages, decode_layout
        self.device = actor_device(device)
        self.model = load_model(model_dir, dtype=dtype, device=self.device, layer_range=layer_range)
        self.config, self.dtype = self.model.config, dtype
        layout = CacheLayout.build(
            self.config,
            range(*layer_range),
            page_size=engine_config.page_size,
            dtype_bytes=dtype.itemsize,
        )
        total = arena_bytes(layout, engine_config, self.device)
        self.cache = PagedCache(layout, total, device=self.device, dtype=dtype)
        # What the kernels tune by batch size, for every batch the stage can get, before the
        # first one, as the single-device runner does in `measure_workspace` (fla's gated norm
        # tunes tens of launches for each new bucket). Nothing on the CPU's torch backend.
        self.model.warm_up(engine_config.batch_tokens(self.device.type == "cuda"))
        # Wall-clock compute intervals (the newest BUSY_WINDOW); receive and send are excluded.
        self.busy: deque[tuple[float, float]] = deque(maxlen=BUSY_WINDOW)
        self._send = None  # (work, tensor) of the last isend
        self._handoffs: list = []  # (work, buffer) of handoff sends not known to be complete
        freeze_start_up()

    def endpoint(self) -> tuple[str, int]:
        return free_endpoint()

    def init_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        assert rank == self.rank, (rank, self.rank)  # stages come first in the world
        join_process_group(self.device.type, host, port, rank, world_size)
        if self.decode_layout is not None:
            create_groups(self.decode_layout, first_rank=self.num_stages)  # collective
            stages, ranks = range(self.num_stages), range(self.num_stages, world_size)
            handoff.connect(list(stages), list(ranks), rank, self.device)

    def ping(self) -> dict:
        return member_info() | {"role": "prefill", "rank": self.rank}

    @torch.inference_mode()
    def forward(self, ids: list[int] | None, meta: dict, all_logits: bool):
        """Run this stage's layers on one batch. The first stage embeds `ids`; the others
        receive the stream from the previous stage. The last stage returns logits (fp32, CPU);
        the others send the stream on and return None."""
        batch = ForwardBatch(**meta)
        first, last = self.model.layer_range
        if self.rank == 0:
            t0 = time.time()
            stream = self.model.embed(torch.tensor(ids, dtype=torch.long, device=self.device))
        else:
            n = bank_size(first, self.config.attn_res_block_size) + 1
            buf = torch.empty(
                n, batch.num_tokens, self.config.hidden_size, dtype=self.dtype, device=self.device
            )
            dist.recv(buf, src=self.rank - 1)
            t0 = time.time()
            stream = unpack_stream(buf)
        stream = self.model.run_layers(stream, batch, self.cache)
        if self.rank == self.num_stages - 1:
            h = self.model.final_hidden(stream)
            if not all_logits:
                h = h[batch.last_token_idx]
            out = self.model.lm_head(h).float().cpu()
            self.busy.append((t0, time.time()))
            return out
        packed = pack_stream(stream).contiguous()
        self.busy.append((t0, time.time()))
        if self._send is not None:
            self._send[0].wait()
        self._send = (dist.isend(packed, dst=self.rank + 1), packed)
        return None

    def cache_spec(self):
        return self.cache.spec

    def apply(self, moves) -> None:
        self.cache.apply(moves)

    def export_request(self, block: int, pages: list[int], num_tokens: int):
        """Send this stage's layers of one request to every decode rank r (world rank P + r),
        resharded and packed into one buffer each, without waiting for the ranks to receive;
        returns the manifests, one per rank (call with num_returns = tp_size: each rank fetches
        its own). The buffers are copies: the engine may free the request's block and pages."""
        layout = self.decode_layout
        full = self.cache.request_tensors(block, pages, num_tokens)
        self._handoffs = [(w, b) for w, b in self._handoffs if not w.is_completed()]
        manifests = []
        for r in range(layout.tp_size):
            pieces = handoff.reshard_request(full, self.config, layout, r)
            buf, manifest = handoff.pack(pieces, self.device)
            self._handoffs.append((dist.isend(buf, dst=self.num_stages + r), buf))
            manifests.append(manifest)
        return manifests if len(manifests) > 1 else manifests[0]

    def request_tensors(self, block: int, pages: list[int], num_tokens: int) -> dict:
        """This stage's cache of one request (tests compare it with one device)."""
        out = self.cache.request_tensors(block, pages, num_tokens)
        return {kind: {i: t.cpu() for i, t in d.items()} for kind, d in out.items()}

    def stats(self) -> dict:
        return {"rank": self.rank, "layers": self.model.layer_range, "busy": list(self.busy)}

    def reset_stats(self) -> None:
        self.busy.clear()

    def shutdown(self) -> None:
        if self._send is not None:
            self._send[0].wait()
        if dist.is_initialized():
            dist.destroy_process_group()
