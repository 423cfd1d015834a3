"""`k3batch bench layouts`: PP-N against TP-N prefill, and TP-N against TP-N + DCP-N decode, on N
devices of one host (NCCL; gloo on CPU, where the numbers mean nothing but the code runs).
Random weights made on the devices; no checkpoint, no Ray: N processes, one per device.

Prefill: one prompt of `prompt_len` tokens in chunks of `chunk_size`, back to back, through
  PP-N: stage r holds its layers (`split_layers`) whole; the stream (AttnRes bank + partial
        sum, [bank + 1, T, D]) goes stage to stage with isend / recv, as the prefill actors do;
  TP-N: every rank holds its shards of every layer (the decode group's rank model) and
        all-reduces after each row-parallel layer.
  Throughput = prompt_len / wall time (the best of `repeats`, after a warm-up).
Exposed communication per 1K prompt tokens:
  TP: every all-reduce is exposed (NCCL runs on the compute stream, nothing overlaps it), so
      exposed = 2 all-reduces of [T, D] per layer, each timed alone with every rank ready
      (min of 5), per 1K tokens. Beside it, the time the ranks measured inside their
      collectives during the run (CUDA events): that adds the wait for the slowest rank.
  PP: a stage receives chunk c + 1 only after computing chunk c, so each chunk's transfer is
      on the critical path once, in parallel across stages: exposed = the transfer time of one
      chunk's stream at the widest boundary (measured by a ping with both sides ready), per
      1K tokens of that chunk. The receive waits the stages measured (transfer + waiting for
      the stage before, the pipeline fill included) are reported beside it.
  Bytes moved per 1K tokens by each layout are computed (per rank: 2(N-1)/N of each
  all-reduced tensor for TP, ring algorithm; [bank + 1, T, D] per boundary for PP; the sizes
  are `k3batch.sim.comm`'s).
Decode: `decode_batch` requests with `context_len` cached tokens (the cache holds zeros: speed
  only), `decode_steps` steps, for TP-N and TP-N + DCP-N; logical capacity is the planner's
  formula (`plan.capacity_tokens`) on the memory each GPU has left after weights and the
  benchmark's cache, less the activation reserve.
"""

import dataclasses
import json
import os
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3batch.cache.layout import CacheLayout
from k3batch.cache.paged import PagedCache
from k3batch.model import K3Model, get_flavor
from k3batch.model.forward_batch import ForwardBatch
from k3batch.model.init import init_random_
from k3batch.parallel.group import ParallelGroup, create_groups
from k3batch.parallel.layout import ParallelLayout, split_layers
from k3batch.parallel.pipeline import bank_size, pack_stream, unpack_stream
from k3batch.parallel.tp import build_rank_model
from k3batch.parallel.plan import DEFAULT_RESERVE_BYTES, capacity_tokens
from k3batch.sim.comm import boundary_stream_bytes, tp_all_reduce_bytes

PAGE_SIZE = 64


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayoutBench:
    flavor: str = "k3-slice"
    num_devices: int = 8
    device: str = "cuda"
    prompt_len: int = 8192
    chunk_sizes: tuple[int, ...] = (1024, 2048, 4096)
    decode_batch: int = 32
    context_len: int = 8192
    decode_steps: int = 16
    repeats: int = 2


def comm_bytes_per_1k(config, num_devices: int, dtype_bytes: int = 2) -> dict:
    """Bytes each layout moves per 1K prompt tokens, from the volumes of `k3batch.sim.comm`:
    TP-N, per rank, 2(N-1)/N of every ring all-reduce of a forward (two per layer: the
    attention's [T, D] and the FFN's, a MoE layer's fp32 [T, Din + D]); PP-N, at the widest
    stage boundary (the slowest transfer sets the pace), the stream [bank + 1, T, D]."""
    N, L = num_devices, config.num_hidden_layers
    return {
        "tp": int(tp_all_reduce_bytes(config, range(L), 1000, dtype_bytes) * 2 * (N - 1) / N),
        "pp": max(boundary_stream_bytes(config, N, 1000, dtype_bytes), default=0),
        "tp_all_reduces": 2 * L,  # per chunk of prompt tokens
    }


def projected_comm_ms_per_1k(config, num_devices: int, *, p2p_gbps: float,
                             busbw_gbps: float) -> dict:  # fmt: skip
    """Exposed communication per 1K prompt tokens from the volumes above and two bandwidths
    (GB/s): point-to-point for PP, all-reduce bus bandwidth for TP (time = bytes moved per
    rank / bus bandwidth)."""
    v = comm_bytes_per_1k(config, num_devices)
    return {"pp": v["pp"] / (p2p_gbps * 1e6), "tp": v["tp"] / (busbw_gbps * 1e6)}


def run_layout_bench(bench: LayoutBench) -> list[dict]:
    """Spawn one process per device; rank 0 prints each row as it is measured. Returns the
    rows."""
    if bench.device == "cuda" and torch.cuda.device_count() < bench.num_devices:
        raise ValueError(
            f"num_devices = {bench.num_devices} > {torch.cuda.device_count()} visible GPUs"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        mp.spawn(_worker, args=(bench, port, out), nprocs=bench.num_devices, join=True)
        with open(out) as f:
            return [json.loads(line) for line in f]


def _worker(rank: int, bench: LayoutBench, port: int, out_path: str) -> None:
    cuda = bench.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=bench.num_devices,
        timeout=timedelta(seconds=600),
        device_id=torch.device("cuda", rank) if cuda else None,
    )

    def report(row):  # as soon as measured: a run cut short keeps what it has
        if rank == 0:
            print(format_rows([row]), flush=True)
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    try:
        ctx = _Context(bench, rank)
        for chunk in bench.chunk_sizes:
            report(_pp_prefill(ctx, chunk))
        del ctx.stage
        ctx.free()
        for chunk in bench.chunk_sizes:
            report(_tp_prefill(ctx, chunk))
        del ctx.tp_model
        ctx.free()
        for dcp in sorted({1, bench.num_devices}):
            report(_decode(ctx, dcp))
            ctx.free()
    finally:
        dist.destroy_process_group()


class _Context:
    def __init__(self, bench: LayoutBench, rank: int):
        self.bench, self.rank, self.N = bench, rank, bench.num_devices
        self.device = torch.device("cuda", rank) if bench.device == "cuda" else torch.device("cpu")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.config = get_flavor(bench.flavor)
        gen = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(0, self.config.vocab_size, (bench.prompt_len,), generator=gen)
        cfg = self.config
        self.ranges = split_layers(cfg.num_hidden_layers, self.N, cfg.attn_res_block_size)
        self.stage = self._init(K3Model(cfg, layer_range=self.ranges[rank], dtype=self.dtype,
                                        device=self.device))  # fmt: skip
        self.tp_model = self.timed_tp = None

    def _init(self, model):
        backend = "fla" if self.device.type == "cuda" else "torch"
        return init_random_(model, seed=0).eval().set_backend(backend)

    def free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def cache(self, layer_ids, *, num_requests, num_tokens, tp_size=1, dcp_size=1):
        layout = CacheLayout.build(self.config, layer_ids, page_size=PAGE_SIZE,
                                   dtype_bytes=self.dtype.itemsize, tp_size=tp_size)  # fmt: skip
        pages = layout.request_pages(num_tokens, dcp_size)
        total = num_requests * layout.request_bytes(num_tokens, dcp_size)
        cache = PagedCache(layout, total, device=self.device, dtype=self.dtype, dcp_size=dcp_size)
        return cache, [list(range(i * pages, (i + 1) * pages)) for i in range(num_requests)]

    def max_over_ranks(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def mean_over_ranks(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / self.N


class _Stopwatch:
    """Total time spent in some calls: CUDA events on the current stream (what the GPU spent
    between the call's first and last kernel), or the host clock on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.reset()

    def reset(self) -> None:
        self.events, self.cpu_s = [], 0.0

    def time(self, fn, *args):
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn(*args)
            self.cpu_s += time.perf_counter() - t0
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        self.events.append((start, end))
        return out

    def seconds(self) -> float:
        if self.events:
            torch.cuda.synchronize()
        return self.cpu_s + sum(a.elapsed_time(b) for a, b in self.events) / 1e3


class _TimedGroup(_Stopwatch):
    """A ParallelGroup whose collectives are timed."""

    def __init__(self, group: ParallelGroup, cuda: bool):
        super().__init__(cuda)
        self.inner, self.group, self.rank, self.size = group, group.group, group.rank, group.size

    def all_reduce(self, t):
        return self.time(self.inner.all_reduce, t)

    def all_gather(self, t, dim):
        return self.time(self.inner.all_gather, t, dim)

    def all_to_all(self, tensors):
        return self.time(self.inner.all_to_all, tensors)


def _chunks(bench: LayoutBench, chunk: int):
    return [(s, min(chunk, bench.prompt_len - s)) for s in range(0, bench.prompt_len, chunk)]


def _pp_prefill(ctx: _Context, chunk: int) -> dict:
    """One prompt through the pipeline of stages, chunk after chunk."""
    b, r, N, D = ctx.bench, ctx.rank, ctx.N, ctx.config.hidden_size
    first, last = ctx.ranges[r]
    cache, (pages,) = ctx.cache(range(first, last), num_requests=1, num_tokens=b.prompt_len)
    rows = bank_size(first, ctx.config.attn_res_block_size) + 1
    best, recv_s = None, 0.0
    for rep in range(b.repeats + 1):  # the first is a warm-up
        dist.barrier()
        ctx.sync()
        t0, waits, pending = time.perf_counter(), _Stopwatch(ctx.device.type == "cuda"), None
        for start, n in _chunks(b, chunk):
            batch = ForwardBatch(seq_lens=[n], cached_lens=[start], slot_ids=[0],
                                 page_tables=[pages])  # fmt: skip
            with torch.inference_mode():
                if r == 0:
                    stream = ctx.stage.embed(ctx.prompt[start : start + n].to(ctx.device))
                else:
                    buf = torch.empty(rows, n, D, dtype=ctx.dtype, device=ctx.device)
                    waits.time(dist.recv, buf, r - 1)
                    stream = unpack_stream(buf)
                stream = ctx.stage.run_layers(stream, batch, cache)
                if r == N - 1:
                    ctx.stage.lm_head(ctx.stage.final_hidden(stream)[-1:])
                else:
                    packed = pack_stream(stream).contiguous()
                    if pending is not None:
                        pending.wait()
                    pending = (dist.isend(packed, dst=r + 1), packed)[0]
        if pending is not None:
            pending.wait()
        ctx.sync()
        wall = ctx.max_over_ranks(time.perf_counter() - t0)
        if rep and (best is None or wall < best):
            best, recv_s = wall, ctx.mean_over_ranks(waits.seconds())
    transfer_s = _transfer_time(ctx, chunk)
    del cache
    per_1k = 1000 / b.prompt_len
    return {
        "phase": "prefill", "layout": f"pp{N}", "chunk_size": chunk,
        "tokens_per_s": round(b.prompt_len / best, 1), "wall_s": round(best, 4),
        "exposed_comm_ms_per_1k": round(1e3 * transfer_s * 1000 / min(chunk, b.prompt_len), 3),
        "recv_wait_ms_per_1k": round(1e3 * recv_s * per_1k, 3),
        "comm_bytes_per_1k": comm_bytes_per_1k(ctx.config, N, ctx.dtype.itemsize)["pp"],
    }  # fmt: skip


def _transfer_time(ctx: _Context, chunk: int) -> float:
    """Seconds to move one chunk's widest stream from rank N-2 to N-1, both sides ready (min of
    5 pings); 0 with one device."""
    if ctx.N == 1:
        return 0.0
    width = comm_bytes_per_1k(ctx.config, ctx.N, 1)["pp"] // 1000  # [bank + 1, D] elements
    rows = width // ctx.config.hidden_size
    n = min(chunk, ctx.bench.prompt_len)
    buf = torch.zeros(rows, n, ctx.config.hidden_size, dtype=ctx.dtype, device=ctx.device)
    best = float("inf")
    for _ in range(6):
        dist.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        if ctx.rank == ctx.N - 2:
            dist.send(buf, dst=ctx.N - 1)
        elif ctx.rank == ctx.N - 1:
            dist.recv(buf, src=ctx.N - 2)
        ctx.sync()
        best = min(best, ctx.max_over_ranks(time.perf_counter() - t0))
    return best


def _rank_model(ctx: _Context, layout: ParallelLayout):
    tp, dcp = create_groups(layout)
    ctx.timed_tp = _TimedGroup(tp, ctx.device.type == "cuda")
    model = build_rank_model(ctx.config, layout, ctx.timed_tp, dcp, dtype=ctx.dtype,
                             device=ctx.device)  # fmt: skip
    return ctx._init(model)


def _tp_prefill(ctx: _Context, chunk: int) -> dict:
    b, N = ctx.bench, ctx.N
    if ctx.tp_model is None:
        ctx.tp_model = _rank_model(ctx, ParallelLayout(tp_size=N))
    layers = range(ctx.config.num_hidden_layers)
    cache, (pages,) = ctx.cache(layers, num_requests=1, num_tokens=b.prompt_len, tp_size=N)
    best = comm = None
    for rep in range(b.repeats + 1):
        dist.barrier()
        ctx.sync()
        ctx.timed_tp.reset()
        t0 = time.perf_counter()
        for start, n in _chunks(b, chunk):
            batch = ForwardBatch(seq_lens=[n], cached_lens=[start], slot_ids=[0],
                                 page_tables=[pages])  # fmt: skip
            with torch.inference_mode():
                ctx.tp_model.forward_batch(ctx.prompt[start : start + n].to(ctx.device), batch,
                                           cache)  # fmt: skip
        ctx.sync()
        wall = ctx.max_over_ranks(time.perf_counter() - t0)
        if rep and (best is None or wall < best):
            best, comm = wall, ctx.mean_over_ranks(ctx.timed_tp.seconds())
    del cache
    L, T = ctx.config.num_hidden_layers, min(chunk, b.prompt_len)
    return {
        "phase": "prefill", "layout": f"tp{N}", "chunk_size": chunk,
        "tokens_per_s": round(b.prompt_len / best, 1), "wall_s": round(best, 4),
        "exposed_comm_ms_per_1k": round(1e3 * 2 * L * _all_reduce_time(ctx, T) * 1000 / T, 3),
        "collective_wait_ms_per_1k": round(1e3 * comm * 1000 / b.prompt_len, 3),
        "comm_bytes_per_1k": comm_bytes_per_1k(ctx.config, N, ctx.dtype.itemsize)["tp"],
    }  # fmt: skip


def _all_reduce_time(ctx: _Context, num_tokens: int) -> float:
    """Seconds of one all-reduce of [num_tokens, D] over all ranks, every rank ready (min of 5)."""
    if ctx.N == 1:
        return 0.0
    buf = torch.zeros(num_tokens, ctx.config.hidden_size, dtype=ctx.dtype, device=ctx.device)
    best = float("inf")
    for _ in range(6):
        dist.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        ctx.sync()
        best = min(best, ctx.max_over_ranks(time.perf_counter() - t0))
    return best


def _decode(ctx: _Context, dcp_size: int) -> dict:
    b, N = ctx.bench, ctx.N
    layout = ParallelLayout(tp_size=N, dcp_size=dcp_size)
    model = _rank_model(ctx, layout)
    layers = range(ctx.config.num_hidden_layers)
    total = b.context_len + b.decode_steps + 2
    cache, tables = ctx.cache(layers, num_requests=b.decode_batch, num_tokens=total,
                              tp_size=N, dcp_size=dcp_size)  # fmt: skip
    ids = torch.zeros(b.decode_batch, dtype=torch.long, device=ctx.device)
    B = b.decode_batch

    def step(pos):
        batch = ForwardBatch(seq_lens=[1] * B, cached_lens=[pos] * B, slot_ids=list(range(B)),
                             page_tables=tables)  # fmt: skip
        with torch.inference_mode():
            model.forward_batch(ids, batch, cache)

    step(b.context_len)  # warm-up
    step(b.context_len + 1)
    dist.barrier()
    ctx.sync()
    t0 = time.perf_counter()
    for s in range(b.decode_steps):
        step(b.context_len + 2 + s)
    ctx.sync()
    wall = ctx.max_over_ranks(time.perf_counter() - t0)
    row = {
        "phase": "decode", "layout": f"tp{N}" + (f"-dcp{dcp_size}" if dcp_size > 1 else ""),
        "batch": B, "context_len": b.context_len,
        "tokens_per_s": round(B * b.decode_steps / wall, 1),
        "step_ms": round(1e3 * wall / b.decode_steps, 2),
    }  # fmt: skip
    if ctx.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(ctx.device)
        pool = free + cache.total_bytes - DEFAULT_RESERVE_BYTES
        lay = cache.layout
        state = len(lay.kda_layers) * lay.state_bytes
        cap = capacity_tokens(pool, state, lay.token_bytes / dcp_size, b.context_len)
        row |= {
            "pool_gib": round(pool / 2**30, 1),
            "capacity_tokens": int(ctx.mean_over_ranks(cap)),
        }
    return row


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["phase"] == "prefill":
            if "recv_wait_ms_per_1k" in r:
                extra = f" (stage receive waits {r['recv_wait_ms_per_1k']} ms)"
            else:
                extra = f" (time in collectives {r['collective_wait_ms_per_1k']} ms)"
            lines.append(
                f"prefill {r['layout']:>5} chunk {r['chunk_size']:>5}: {r['tokens_per_s']:>10,.0f} "
                f"tok/s; exposed comm {r['exposed_comm_ms_per_1k']} ms / 1K tokens{extra}; "
                f"moves {r['comm_bytes_per_1k'] / 1e6:.1f} MB / 1K tokens"
            )
        else:
            cap = f"; capacity {r['capacity_tokens']:,} tokens" if "capacity_tokens" in r else ""
            lines.append(
                f"decode {r['layout']:>9} batch {r['batch']} at {r['context_len']}: "
                f"{r['tokens_per_s']:,.0f} tok/s, {r['step_ms']} ms/step{cap}"
            )
    return "\n".join(lines)
