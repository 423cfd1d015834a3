"""`k3batch bench mla-decode` / `mla-prefill` / `kda-decode` / `kda-prefill`: attention kernels
alone on one GPU.

mla-decode: the paged absorbed decode kernel (split-K + merge) over B sequences of a fixed
context, pages handed out in a shuffled order; reports the bandwidth on the latent bytes it
reads (B * context * (L + R) * itemsize) against the H200's measured copy bandwidth.
mla-prefill: the varlen flash prefill kernel (expanded form, causal, optional cached prefix);
reports useful TFLOP/s (causal pairs only) against the measured bf16 GEMM peak.
kda-decode: the in-place recurrent KDA step over B sequences (K3 heads), states in shuffled
arena blocks; reports the bandwidth on the state bytes (read and written, fp32) against the
copy bandwidth, and fla's recurrent kernel on the same inputs for comparison.
kda-prefill: our two KDA prefill kernels (the short conv, the chunk recurrence) as the model
calls them; reports each one's bandwidth on the bytes it must move.
Times are medians of `triton.testing.do_bench` (L2 flushed between runs), except mla-decode's:
replays of a CUDA graph of the call, as the engine's decode step runs it (do_bench's timing of
the eager call took in ~20 us of the host's launches: 0.188 against 0.165 ms at 12 heads).
`sweep=True` times each launch configuration too (after the default; `on_row` gets each row)
and reports the best; each result carries its kernel's tuned-table "key" (`k3kernels.tuned`) and
the best "launch" to save there (`save_best`, what `--sweep --save-tuned` calls). "default" is
the launch the kernel picks today: its tuned entry where this GPU has one, else its rule.
Each launch of a sweep compiles once (0.3-8 s each for these kernels, compiled for sm_90 on a
2-core CPU machine), which is most of a sweep's time: the grids are kept short.
"""

import importlib
import itertools
import math
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from k3batch.bench.roofline import device_rates


def _median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def time_ms(fn, repeats: int, graph: bool = True) -> float:
    """Median CUDA-event time of fn after a warm-up; with graph, of the replay of a CUDA graph
    of fn (what the engine's decode step runs), so that the host's launch time, which exceeds
    the GPU's at a few tokens, is left out."""
    if graph:
        fn = graph_replay(fn)
    fn()  # warm-up: Triton compilation, CUTLASS setup (or the graph's first replay)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_replay(fn):
    """The replay of a CUDA graph of fn, captured after one eager call (Triton compilation,
    CUTLASS setup)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sustained_clock(fn, seconds: float = 2.0) -> dict:
    """{"sm_mhz", "watts"}: medians of nvidia-smi's samples (every 100 ms) while a CUDA graph
    of fn replays for `seconds`, after one second of replays to let the clock settle; {}
    without nvidia-smi. A kernel that holds the board at its power limit runs at a lower SM
    clock (one H200, the routed-expert GEMMs of `bench moe`: ~1,335 of 1,980 MHz at 695 of
    700 W, `benchmarks/kernels_h200.txt`), so its share of a peak measured on another kernel
    depends on what it draws."""
    if shutil.which("nvidia-smi") is None:
        return {}
    replay = graph_replay(fn)

    def replay_for(s):
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            replay()
            torch.cuda.synchronize()  # a bounded queue: the samples then match the work

    replay_for(1.0)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    bus = getattr(props, "pci_bus_id", None)
    select = [] if bus is None else [
        f"--id={props.pci_domain_id:08X}:{bus:02X}:{props.pci_device_id:02X}.0"]
    query = ["--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"]
    smi = subprocess.Popen(["nvidia-smi", *select, *query], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        replay_for(seconds)
    finally:
        smi.terminate()
    return clock_medians(smi.communicate()[0])


def clock_medians(smi_csv: str) -> dict:
    """{"sm_mhz", "watts"} of nvidia-smi's "MHz, W" lines (medians; lines that do not parse,
    such as "[N/A]", are skipped); {} if none does."""
    samples = []
    for line in smi_csv.splitlines():
        try:
            mhz, watts = (float(v) for v in line.split(","))
        except ValueError:
            continue
        samples.append((mhz, watts))
    if not samples:
        return {}
    return {"sm_mhz": round(statistics.median(m for m, _ in samples)),
            "watts": round(statistics.median(w for _, w in samples), 1)}


def _sweep(configs: list[dict], time_cfg, rate, on_row=None) -> list[dict]:
    """Each launch config timed: cfg | {"ms", **rate(ms)}, or cfg | {"error"} for one the
    device refuses (out of shared memory or registers); on_row sees each timed row."""
    tried = []
    for cfg in configs:
        try:
            ms = time_cfg(cfg)
        except Exception as e:
            tried.append(cfg | {"error": type(e).__name__})
            continue
        tried.append(cfg | {"ms": ms} | rate(ms))
        if on_row:
            on_row(tried[-1])
    return tried


def decode_inputs(batch: int, context_len: int, heads: int, *, kv_lora: int = 512,
                  rope: int = 64, page_size: int = 64, dtype=torch.bfloat16,
                  seed: int = 0):  # fmt: skip
    """(q [B, H, C], pool [P, page_size, C], page_rows [B, pages], seq_lens [B] int32) on CUDA;
    the pool is one tensor with pages in a random order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    C, per_seq = kv_lora + rope, math.ceil(context_len / page_size)
    P = batch * per_seq
    pool = torch.randn(P, page_size, C, device="cuda", dtype=dtype, generator=g)
    rows = torch.randperm(P, device="cuda", generator=g).view(batch, per_seq)
    q = torch.randn(batch, heads, C, device="cuda", dtype=dtype, generator=g)
    lens = torch.full((batch,), context_len, dtype=torch.int32, device="cuda")
    return q, pool, rows, lens


def run_mla_decode_bench(*, batch: int = 64, context_len: int = 8192, heads: int = 96,
                         page_size: int = 64, sweep: bool = False,
                         on_row=None) -> dict:  # fmt: skip
    from k3kernels.mla import decode as K

    kv_lora, rope = 512, 64
    q, pool, rows, lens = decode_inputs(batch, context_len, heads, kv_lora=kv_lora, rope=rope,
                                        page_size=page_size)  # fmt: skip
    scale = (128 + rope) ** -0.5
    nbytes = batch * context_len * (kv_lora + rope) * pool.dtype.itemsize
    m = K.num_splits_for(batch, heads, context_len)  # the engine's split count
    base = K.launch_config(batch, heads, page_size, kv_lora, rope) | {"num_splits": m}

    def time_cfg(cfg):
        launch = {k: v for k, v in cfg.items() if k != "num_splits"}

        def fn():
            return K.mla_decode(q, pool, rows, lens, kv_lora=kv_lora, scale=scale,
                                num_splits=cfg["num_splits"], config=launch)  # fmt: skip

        return time_ms(fn, repeats=50)

    default_ms = time_cfg(base)
    rate = lambda ms: {"tbps": nbytes / ms / 1e9}  # noqa: E731
    tried = []
    if sweep:  # the tiles at the engine's split count (`num_splits_for`)
        configs = [t | {"num_splits": m} for t in mla_decode_tiles(heads)]
        tried = _sweep(configs, time_cfg, rate, on_row)
    ok = [t for t in tried if "ms" in t]
    best = min(ok, key=lambda t: t["ms"]) if ok else base | {"ms": default_ms}
    tbps = nbytes / default_ms / 1e9
    return {
        "batch": batch, "context_len": context_len, "heads": heads, "page_size": page_size,
        "latent_bytes": nbytes, "default": base | {"ms": default_ms, "tbps": tbps},
        "default_fraction_of_copy": tbps / device_rates()[1],
        "best": best | {"tbps": nbytes / best["ms"] / 1e9},
        "best_fraction_of_copy": nbytes / best["ms"] / 1e9 / device_rates()[1],
        "sweep": sorted(ok, key=lambda t: t["ms"])[:15],
        "errors": [t for t in tried if "error" in t][:10],
        "key": K.table_key(batch, heads, kv_lora, rope, page_size),
        "launch": {k: best[k] for k in ("block_h", "block_n", "num_warps", "num_stages")},
    }  # fmt: skip


def mla_decode_tiles(heads: int) -> list[dict]:
    """The MLA decode tiles a sweep times, each at the engine's split count (the split count is
    a constexpr: every count is a compile of every tile, ~2 s each). A TP / DCP rank's few
    heads: one 16-head block, 32- or 64-token tiles, 2-8 warps, 2-4 stages. More heads: 64-head
    blocks on the two-warpgroup loop (8 warps) and 32-head blocks on one (4 warps), 16-64-token
    tiles (16: one page of the engine's 16-token pages, one page row a tile), 2 stages (3 at
    the rule's tile). At 96 heads x 64 x 8K one H200 (`benchmarks/mla_h200.jsonl`) ran 1 stage
    1.28x slower than the best, 32-head blocks on 8 warps 1.34x: not swept."""
    if heads <= 16:
        grid = itertools.product((16,), (32, 64), (2, 4, 8), (2, 3, 4))
    else:
        grid = [(64, 64, 8, 2), (64, 64, 8, 3), (64, 32, 8, 2),
                *((32, bn, 4, 2) for bn in (16, 32, 64))]  # fmt: skip
    return [dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns)
            for bh, bn, nw, ns in grid]  # fmt: skip


def run_mla_prefill_bench(*, seq_lens=(8192,), cached_lens=None, heads: int = 96,
                          sweep: bool = False, on_row=None) -> dict:  # fmt: skip
    from k3kernels.mla import prefill as K

    Dn, R, Dv, L = 128, 64, 128, 512
    cached = list(cached_lens or [0] * len(seq_lens))
    k_lens = [c + n for c, n in zip(cached, seq_lens)]
    T, S = sum(seq_lens), sum(k_lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(T, heads, Dn + R, device="cuda", dtype=dt, generator=g)
    kv = torch.randn(S, heads, Dn + Dv, device="cuda", dtype=dt, generator=g)
    latent = torch.randn(S, L + R, device="cuda", dtype=dt, generator=g)

    def cu(lens):
        return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")

    cu_q, cu_k = cu(seq_lens), cu(k_lens)
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(seq_lens, cached))  # causal (q, k)
    flops = 2 * pairs * heads * (Dn + R + Dv)
    base = K.launch_config(T, heads, Dn, R, Dv)

    def run(cfg):
        return K.mla_prefill(q, kv[..., :Dn], latent[:, L:], kv[..., Dn:], cu_q, cu_k,
                             max_seqlen_q=max(seq_lens), scale=(Dn + R) ** -0.5,
                             **cfg)  # fmt: skip

    def time_cfg(cfg):
        return _median_ms(lambda: run(cfg))

    default_ms = time_cfg(base)
    tried = []
    if sweep:  # query blocks of 128 rows on 8 or 4 warps and of 64 on 4 (8 warps: two
        # warpgroups of 32 rows, under the 64 of an MMA), key blocks of 64 or 128, 2 stages, 3
        # at the default tile (at 128 x 128, 3 stages exceed shared memory); each compiles once
        # (~3.5 s)
        grid = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 2),
                (64, 64, 4, 2), (64, 128, 4, 2)]  # fmt: skip
        configs = [dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                   for bm, bn, nw, ns in grid]  # fmt: skip
        tried = _sweep(configs, time_cfg, lambda ms: {"tflops": flops / ms / 1e9}, on_row)
    ok = [t for t in tried if "ms" in t]
    best = min(ok, key=lambda t: t["ms"]) if ok else base | {"ms": default_ms}
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run(base)
    peak_extra = torch.cuda.max_memory_allocated() - before
    return {
        "seq_lens": list(seq_lens), "cached_lens": cached, "heads": heads, "flops": flops,
        "default": base | {"ms": default_ms, "tflops": flops / default_ms / 1e9},
        "default_fraction_of_bf16_peak": flops / default_ms / 1e9 / device_rates()[0],
        "best": best | {"tflops": flops / best["ms"] / 1e9},
        "sweep": sorted(ok, key=lambda t: t["ms"])[:10],
        "errors": [t for t in tried if "error" in t][:10],
        "peak_extra_bytes": peak_extra,
        "key": K.table_key(T, heads, Dn, R, Dv), "launch": {k: best[k] for k in base},
    }  # fmt: skip


def run_kda_decode_bench(*, batch: int = 64, heads: int = 96, head_dim: int = 128,
                         sweep: bool = False, fla: bool = True,
                         on_row=None) -> dict:  # fmt: skip
    from k3kernels.kda import recurrent_decode as K

    N, H, D = batch, heads, head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    NB = 2 * N + 1
    pool = torch.randn(NB, H, D, D, device="cuda", generator=g) * 0.1
    slots = torch.randperm(NB, device="cuda", generator=g)[:N]
    q, k, v, f = (torch.randn(N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(4))  # fmt: skip
    b = torch.randn(N, H, device="cuda", generator=g)
    A_log = torch.rand(H, device="cuda", generator=g).mul(15).add(1).log()
    dt_bias = torch.randn(H * D, device="cuda", generator=g) * 0.5 - 1.0
    args = (q, k, v, f, b, A_log, dt_bias)
    kw = dict(lower_bound=-5.0, scale=D**-0.5, state_pool=pool, slots=slots)
    nbytes = 2 * N * H * D * D * 4  # state read and written
    base = K.launch_config(N, H, D, D)

    def time_cfg(cfg):
        return _median_ms(lambda: K.kda_decode_(*args, **kw, **cfg))

    default_ms = time_cfg(base)
    rate = lambda ms: {"tbps": nbytes / ms / 1e9}  # noqa: E731
    tried = []
    if sweep:
        configs = [dict(block_v=bv, num_warps=nw)
                   for bv, nw in itertools.product((32, 64, 128), (2, 4, 8, 16))]  # fmt: skip
        tried = _sweep(configs, time_cfg, rate, on_row)
    ok = [t for t in tried if "ms" in t]
    best = min(ok, key=lambda t: t["ms"]) if ok else base | {"ms": default_ms}
    fla_ms = _median_ms(lambda: _fla_recurrent_step(*args, **kw)) if fla else None
    fla_row = {"ms": fla_ms} | rate(fla_ms) if fla else {}
    return {
        "batch": N, "heads": H, "head_dim": D, "state_bytes": nbytes,
        "default": base | {"ms": default_ms} | rate(default_ms),
        "default_fraction_of_copy": rate(default_ms)["tbps"] / device_rates()[1],
        "best": best | rate(best["ms"]),
        "fla": fla_row,
        "fla_fraction_of_copy": fla_row["tbps"] / device_rates()[1] if fla else None,
        "sweep": sorted(ok, key=lambda t: t["ms"])[:10],
        "errors": [t for t in tried if "error" in t][:10],
        "key": K.table_key(N, H, D, D), "launch": {k: best[k] for k in base},
    }  # fmt: skip


def run_kda_prefill_bench(*, tokens: int = 8192, seqs: int = 1, heads: int = 96,
                          head_dim: int = 128, sweep: bool = False,
                          on_row=None) -> dict[str, dict]:  # fmt: skip
    """Our two KDA prefill kernels as the model calls them, on `seqs` sequences sharing
    `tokens`, cold: {"kda-conv": the short conv over q|k|v (a column block of the fused
    projection, three parts out, q and k L2-normed), "kda-chunk-state": the chunk recurrence}.
    Bandwidth on the bytes each must move (the conv: x read, y written; the chunk state: kg, w
    and u read, each chunk's last gates, h and v_new written) against the copy bandwidth."""
    from k3kernels.kda import chunk_state as S
    from k3kernels.kda import conv_prefill as C
    from k3kernels.kda.varlen import CHUNK_SIZE, as_varlen

    H, D, W, T = heads, head_dim, 4, tokens
    lens = [T // seqs + (i < T % seqs) for i in range(seqs)]
    cu = as_varlen([0, *itertools.accumulate(lens)], torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    slots = torch.randperm(2 * seqs + 1, device="cuda", generator=g)[:seqs]
    warm = torch.zeros(seqs, dtype=torch.long, device="cuda")
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    # the conv's input: q|k|v, the first 3C columns of the fused projection
    proj = torch.randn(T, 3 * H * D + 2 * D + H, generator=g, **bf16)
    x, weight = proj[:, : 3 * H * D], torch.randn(3 * H * D, W, device="cuda", generator=g)
    conv_pool = torch.zeros(2 * seqs + 1, 3 * H * D, W - 1, **bf16)
    parts = dict(num_parts=3, norm_parts=2, head_dim=D)
    # the chunk recurrence's inputs: WY terms of unit scale, gates decaying within each chunk
    kg, w, u = (torch.randn(T, H, D, generator=g, **bf16) * 0.1 for _ in range(3))
    gk = -torch.rand(T, H, D, device="cuda", generator=g).mul(0.05).cumsum(0)
    state_pool = torch.zeros(2 * seqs + 1, H, D, D, device="cuda")
    chunks = sum(-(-n // CHUNK_SIZE) for n in lens)
    kernels = {
        "kda-conv": (
            C.launch_config(T, 3 * H * D, W, 3, 2), 2 * x.numel() * x.element_size(),
            lambda cfg: C.short_conv_prefill_(x, weight, conv_pool, slots, warm, cu, **parts,
                                              **cfg),
            [dict(block_t=bt, block_c=bc, num_warps=nw)
             for bt, bc, nw in itertools.product((16, 32, 64), (256, 512, 1024), (4, 8))],
            C.table_key(T, 3 * H * D, W, 3, 2)),
        "kda-chunk-state": (
            S.launch_config(seqs, H, D, D, x.device),
            (3 * T * H * D + chunks * H * D * D + T * H * D) * 2 + chunks * H * D * 4,
            lambda cfg: S.chunk_state_prefill_(kg, w, u, gk, state_pool=state_pool, slots=slots,
                                               warm=warm, cu_seqlens=cu, **cfg),
            [dict(block_v=bv, num_warps=nw, num_stages=ns)
             for bv, nw, ns in itertools.product((16, 32, 64), (4, 8), (2, 3))],
            S.table_key(seqs, H, D, D)),
    }  # fmt: skip
    out = {}
    for name, (base, nbytes, run, grid, key) in kernels.items():
        rate = lambda ms, n=nbytes: {"tbps": n / ms / 1e9}  # noqa: E731
        default_ms = _median_ms(lambda: run(base))
        tried = []
        if sweep:
            tried = _sweep(grid, lambda cfg, run=run: _median_ms(lambda: run(cfg)), rate,
                           on_row and (lambda row, n=name: on_row({"kernel": n} | row)))
        ok = [t for t in tried if "ms" in t]
        best = min(ok, key=lambda t: t["ms"]) if ok else base | {"ms": default_ms}
        out[name] = {
            "tokens": T, "seqs": seqs, "heads": H, "head_dim": D, "bytes": nbytes,
            "default": base | {"ms": default_ms} | rate(default_ms),
            "default_fraction_of_copy": rate(default_ms)["tbps"] / device_rates()[1],
            "best": best | rate(best["ms"]),
            "sweep": sorted(ok, key=lambda t: t["ms"])[:10],
            "errors": [t for t in tried if "error" in t][:10],
            "key": key, "launch": {k: best[k] for k in base},
        }  # fmt: skip
    return out


def _fla_recurrent_step(q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, state_pool,
                        slots):  # fmt: skip
    """fla-core 0.6.0's recurrent KDA kernel in place (V in blocks of 32), for comparison."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    N, H, D = q.shape
    return fused_recurrent_kda_fwd(
        q=q.view(N, 1, H, D), k=k.view(N, 1, H, D), v=v.view(N, 1, H, D), g=f.view(N, 1, H, D),
        beta=b.view(N, 1, H), A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        scale=scale, initial_state=state_pool, output_final_state=True,
        inplace_final_state=True, ssm_state_indices=slots, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip


# bench name -> (kernel module, its table in the op's tuned file)
TABLES = {"mla-decode": ("k3kernels.mla.decode", "decode"),
          "mla-prefill": ("k3kernels.mla.prefill", "prefill"),
          "kda-decode": ("k3kernels.kda.recurrent_decode", "decode"),
          "kda-conv": ("k3kernels.kda.conv_prefill", "conv_prefill"),
          "kda-chunk-state": ("k3kernels.kda.chunk_state", "chunk_state")}  # fmt: skip


def save_best(name: str, r: dict) -> Path:
    """A swept bench result's best launch (`r["launch"]`) into the current GPU's tuned table of
    that kernel under its shape's key (`r["key"]`), the other entries kept; returns the file."""
    from k3kernels import tuned

    if not r["sweep"]:
        raise ValueError(f"{name}: no swept launch ran; nothing to save")
    module, table = TABLES[name]
    path = importlib.import_module(module).TUNED_DIR / tuned.file_name(torch.cuda.get_device_name())
    tuned.save(path, table, r["key"], r["launch"])
    return path


def format_result(name: str, r: dict) -> str:
    d, b = r["default"], r["best"]
    if "tbps" in d:
        unit, ref = "TB/s", device_rates()[1]
    else:
        unit, ref = "TFLOP/s", device_rates()[0]
    key = "tbps" if unit == "TB/s" else "tflops"
    cfg = {k: v for k, v in d.items() if k not in ("ms", key)}
    bcfg = {k: v for k, v in b.items() if k not in ("ms", key)}
    return (
        f"{name}: default {d['ms']:.3f} ms, {d[key]:.2f} {unit} ({d[key] / ref:.0%} of {ref}) "
        f"{cfg}\n{name}: best    {b['ms']:.3f} ms, {b[key]:.2f} {unit} ({b[key] / ref:.0%}) {bcfg}"
    )
