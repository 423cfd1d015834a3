"""Runners: what the engine calls to run one forward. A runner owns the model's caches.

Protocol: `cache_specs()` lists the byte arenas it holds (one per device: `cache.arena`), and
`dcp_size` says how its MLA pages stripe tokens; `apply(moves)` copies blocks and pages in
every arena (queued by the engine's `CacheManager`, run before any later call);
`submit(ids, batch, all_logits)` starts a forward over packed token ids and returns a handle;
`wait(handle)` returns its logits ([num_seqs, V], or [T, V] with all_logits) where they
were made (the local runner) or on the CPU (actors); the engine samples them where they are.
Calls run in submission order. `depth` is how many forwards may usefully be in flight at once
(1 on one device; the number of stages for a pipeline). A runner that `pads_decode` gets decode
batches padded to a bucket with scratch rows (see `Engine._decode`). A runner that
`feeds_tokens` takes `submit(..., feed=tokens)`: a device tensor of the previous decode step's
sampled ids, which ids < 0 stand for (id -1 - i is feed[i]), so that step's tokens need not
reach the host first (the engine's overlapped decode).
"""

import dataclasses

import torch

from k3batch.cache.layout import CacheLayout
from k3batch.cache.manager import CacheManager
from k3batch.cache.paged import PagedCache
from k3batch.engine.config import CPU_MAX_NUM_SEQS, EngineConfig
from k3batch.engine.graphs import DecodeGraphs, fill_fed
from k3batch.model.forward_batch import ForwardBatch


GPU_MEMORY_FRACTION = 0.9  # of a GPU for weights + workspace + arena, when the config sets none
GPU_SLACK_BYTES = 2 * 2**30  # beyond the measured workspace: graph pools, allocator slack
MAX_AUTO_SEQS = 256  # max_num_seqs sized from the arena stops here (decode graph buckets)
SCRATCH = "\0scratch"  # the request of padded decode batches' dummy rows (`Engine._decode`)


def memory_account(runner, config: EngineConfig, prefix_cache: bool) -> CacheManager:
    """The memory account of a runner's arenas (the engine's; a decode group has its own). A
    runner that pads decode batches gets the scratch request (one block, one page) that its
    padding rows use."""
    static = config.memory_pool == "static"
    pads = getattr(runner, "pads_decode", False)
    pool = CacheManager(
        runner.cache_specs(),
        page_size=config.page_size,
        static_blocks=config.max_num_seqs + pads if static else None,
        prefix_cache=prefix_cache,
        dcp_size=runner.dcp_size,
    )
    if pads and pool.admit(SCRATCH, [], 1) is None:
        raise ValueError("the cache pool has no room for the scratch rows of decode batches")
    return pool
GPU_GROUP_SEQS = 64  # max_num_seqs of a replica of actors on GPUs, when the config sets none


def arena_bytes(layout: CacheLayout, config: EngineConfig, device, *, dcp_size: int = 1,
                extra: int = 0, workspace: int | None = None) -> int:  # fmt: skip
    """The arena size of one device: `config.cache_bytes`; else, on a GPU with
    `memory_fraction` or a measured `workspace` (then the fraction defaults to
    GPU_MEMORY_FRACTION), that fraction of its memory minus what is in use (the weights) and a
    reserve: the workspace + GPU_SLACK_BYTES, or the planner's DEFAULT_RESERVE_BYTES where
    nothing was measured (`k3batch.parallel.plan.pool_bytes`); else room for max_num_seqs (+ extra)
    requests of max_seq_len tokens."""
    if config.cache_bytes:
        return config.cache_bytes
    device = torch.device(device)
    if device.type == "cuda" and (config.memory_fraction or workspace is not None):
        from k3batch.parallel.plan import DEFAULT_RESERVE_BYTES, pool_bytes

        free, total = torch.cuda.mem_get_info(device)
        fraction = config.memory_fraction or GPU_MEMORY_FRACTION
        reserve = DEFAULT_RESERVE_BYTES if workspace is None else workspace + GPU_SLACK_BYTES
        return pool_bytes(total, fraction, total - free, reserve)
    seqs = config.max_num_seqs or CPU_MAX_NUM_SEQS
    return (seqs + extra) * layout.request_bytes(config.max_seq_len, dcp_size)


def sized(config: EngineConfig, *, cuda: bool, seqs_fit: int | None = None) -> EngineConfig:
    """`config` with its automatic fields (0) filled: max_batch_tokens (`batch_tokens`), and
    max_num_seqs: on a GPU the `seqs_fit` requests of max_seq_len tokens that the arena holds,
    at most MAX_AUTO_SEQS, or GPU_GROUP_SEQS where no one arena decides (a replica of actors);
    on the CPU CPU_MAX_NUM_SEQS."""
    seqs = config.max_num_seqs
    if not seqs and cuda:
        seqs = GPU_GROUP_SEQS if seqs_fit is None else min(MAX_AUTO_SEQS, max(1, seqs_fit))
    return dataclasses.replace(config, max_num_seqs=seqs or CPU_MAX_NUM_SEQS,
                               max_batch_tokens=config.batch_tokens(cuda))  # fmt: skip


WARM_TAIL = 37  # tokens of each warm-up continuation chunk: odd, after a cached prefix


def measure_workspace(model, config: EngineConfig, layout: CacheLayout) -> int:
    """Bytes that the largest prefill step allocates beyond the weights and the arena: one
    forward of max_batch_tokens tokens (requests of chunk_size tokens, the shape the engine
    plans) on a scratch cache, measured by the CUDA allocator's peak. It runs before the
    arena exists. It is also the prefill's warm-up: Triton compiles a kernel again for integer
    arguments that are not multiples of 16 or equal to 1, and for chunks with a cached prefix,
    so the first forward's requests then continue by WARM_TAIL tokens: all but the first
    together (the steady state of a long prompt's chunks: many sequences, cached prefixes),
    then the first alone. These cover each batch-dependent integer both ways; a kernel that
    takes two of them leaves them unspecialized instead (`k3kernels.moe.route`'s blocked sort),
    since their mixed patterns come only with a job's batches. With the decode graphs'
    capture, a job's steps then compile nothing (one H200, k3-slice, 1,024 prompts of 1,024 tokens with only the lone continuation: the
    first run's prefill steps took 76 s, 24.6 s once Triton's cache held them). Compiled
    kernels and fla's tuning results persist in Triton's cache directory, so a restarted
    replica compiles nothing either. Then `model.warm_up`: what fla tunes by token count
    (its norms), for every size up to max_batch_tokens."""
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    tokens, chunk = config.batch_tokens(True), config.chunk_size
    lens = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
    n, per = len(lens), -(-(chunk + WARM_TAIL) // layout.page_size)
    scratch = PagedCache(layout, n * layout.request_bytes(chunk + WARM_TAIL), device=dev,
                         dtype=dtype)  # fmt: skip
    tables = [list(range(i * per, (i + 1) * per)) for i in range(n)]
    first = ForwardBatch(seq_lens=lens, cached_lens=[0] * n, slot_ids=list(range(n)),
                         page_tables=tables)  # fmt: skip
    tails = [ForwardBatch(seq_lens=[WARM_TAIL] * len(rows), cached_lens=[lens[i] for i in rows],
                          slot_ids=rows, page_tables=[tables[i] for i in rows])
             for rows in (list(range(1, n)), [0]) if rows]  # fmt: skip
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        for batch in (first, *tails):
            ids = torch.zeros(batch.num_tokens, dtype=torch.long, device=dev)
            model.forward_batch(ids, batch, scratch)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del scratch
    with torch.inference_mode():  # after the peak: its buffers are not a forward's
        model.warm_up(tokens)
    torch.cuda.empty_cache()
    return peak


class LocalRunner:
    """The whole model on one device; a forward runs at submit time. On CUDA with
    `config.cuda_graphs`, decode steps replay CUDA graphs (`engine/graphs.py`), captured here;
    `static_decode` forces the same static-buffer path without graphs (tests on CPU)."""

    depth = 1
    dcp_size = 1
    feeds_tokens = True

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
        cuda = p.device.type == "cuda"
        use_graphs = config.cuda_graphs and cuda
        self.pads_decode = use_graphs or static_decode
        extra = int(self.pads_decode)  # one request's room for the scratch rows of padded decodes
        # Sized up front: the largest prefill step's workspace, then the arena from what is left.
        self.workspace_bytes = measure_workspace(model, config, layout) if cuda else None
        total = arena_bytes(layout, config, p.device, extra=extra, workspace=self.workspace_bytes)
        fit = total // layout.request_bytes(config.max_seq_len) - extra
        self.engine_config = config = sized(config, cuda=cuda, seqs_fit=fit)
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
    def submit(self, ids: list[int], batch: ForwardBatch, all_logits: bool, feed=None):
        if self.graphs is not None and DecodeGraphs.serves(batch, all_logits) and not self.eager:
            return self.graphs.run(ids, batch, feed)
        x = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        if feed is not None:
            x = fill_fed(x, feed)
        return self.model.forward_batch(x, batch, self.cache, all_logits=all_logits)

    def wait(self, handle):
        return handle
