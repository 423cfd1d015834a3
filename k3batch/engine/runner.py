"""Runners: what the engine calls to run one forward. A runner owns the model's caches.

Protocol: `cache_specs()` lists the byte arenas it holds (one per device: `cache.arena`), and
`dcp_size` says how its MLA pages stripe tokens; `apply(moves)` copies blocks and pages in
every arena (queued by the engine's `CacheManager`, run before any later call);
`submit(ids, batch, all_logits)` starts a forward over packed token ids and returns a handle;
`wait(handle)` returns its logits ([num_seqs, V], or [T, V] with all_logits) where they
were made (the local runner) or on the CPU (actors); the engine samples them where they are.
Calls run in submission order. `depth` is how many forwards may usefully be in flight at once
(1 on one device; the number of stages for a pipeline). A runner that `pads_decode` gets decode
batches padded to a bucket with scratch rows (see `Engine._submit_decode`).
"""

import torch

from k3batch.cache.layout import CacheLayout
from k3batch.cache.paged import PagedCache
from k3batch.engine.config import EngineConfig
from k3batch.engine.graphs import DecodeGraphs
from k3batch.model.forward_batch import ForwardBatch


def arena_bytes(
    layout: CacheLayout, config: EngineConfig, device, *, dcp_size: int = 1, extra: int = 0
) -> int:
    """The arena size of one device: `config.cache_bytes`; else, on a GPU with
    `memory_fraction`, that fraction of its memory minus what is in use (the weights) and a
    reserve (the planner's formula, `k3batch.plan.pool_bytes`); else room for max_num_seqs
    (+ extra) requests of max_seq_len tokens."""
    if config.cache_bytes:
        return config.cache_bytes
    device = torch.device(device)
    if config.memory_fraction and device.type == "cuda":
        from k3batch.plan import DEFAULT_RESERVE_BYTES, pool_bytes

        free, total = torch.cuda.mem_get_info(device)
        return pool_bytes(total, config.memory_fraction, total - free, DEFAULT_RESERVE_BYTES)
    return (config.max_num_seqs + extra) * layout.request_bytes(config.max_seq_len, dcp_size)


class LocalRunner:
    """The whole model on one device; a forward runs at submit time. On CUDA with
    `config.cuda_graphs`, decode steps replay CUDA graphs (`engine/graphs.py`), captured here;
    `static_decode` forces the same static-buffer path without graphs (tests on CPU)."""

    depth = 1
    dcp_size = 1

    def __init__(self, model, config: EngineConfig, *, static_decode: bool = False):
        self.model, self.config = model, model.config
        p = next(model.parameters())
        self.device = p.device
        layout = CacheLayout.build(
            self.config,
            range(self.config.num_hidden_layers),
            page_size=config.page_size,
            dtype_bytes=p.element_size(),
        )
        use_graphs = config.cuda_graphs and p.device.type == "cuda"
        self.pads_decode = use_graphs or static_decode
        # One extra request's room for the scratch rows of padded decode batches.
        total = arena_bytes(layout, config, p.device, extra=int(self.pads_decode))
        self.cache = PagedCache(layout, total, device=p.device, dtype=p.dtype)
        self.graphs = None
        if self.pads_decode:
            self.graphs = DecodeGraphs.build(model, self.cache, config, capture=use_graphs)
        self.eager = False  # set: every forward eager (hooks on modules run; graphs skip them)

    def cache_specs(self) -> list:
        return [self.cache.spec]

    def apply(self, moves) -> None:
        if moves:
            self.cache.apply(moves)

    @torch.inference_mode()
    def submit(self, ids: list[int], batch: ForwardBatch, all_logits: bool):
        if self.graphs is not None and DecodeGraphs.serves(batch, all_logits) and not self.eager:
            return self.graphs.run(ids, batch)
        x = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.forward_batch(x, batch, self.cache, all_logits=all_logits)

    def wait(self, handle):
        return handle
