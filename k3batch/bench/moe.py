"""`k3batch bench moe`: the routed experts alone, against the GPU's bf16 GEMM peak.

The workload is one prefill chunk through every MoE layer of a flavor (k3-slice: 7 layers,
8,192 tokens, top-2 of 112 experts, latent width 3584, expert width 3072), each layer with its
own random bf16 weights and routes drawn like a router's (top-k of random scores, so about
T k / E slots per expert). Useful FLOPs: 2 T k (3 D I) per layer (gate-up 2 D 2 I, down 2 I D).
Rows: "experts" / "gemm" (the whole `fused_experts` pass: sort, gather, grouped GEMMs, fused
activation, combine; the two grouped GEMMs alone on pre-sorted rows, the ceiling of this
design) with torch's grouped GEMM, "experts-triton" / "gemm-triton" the same with the Triton
grouped GEMM (`k3kernels.moe.grouped_gemm_triton`, what the model runs on an H200),
"torch-elementwise" (the pass with torch activation and combine, to show what fusing buys)
and "loop-before" (the per-expert loop this replaced: counts read on the host, two GEMMs for
gate and up, torch activation, index_add_).
Two reference rows, measured in the same process: "dense-gemm" (torch.mm of two 8,192^2
random matrices, 10 times: this GPU's bf16 peak as it runs here, next to the 777 TFLOP/s that
the ratios use) and, at prefill shapes, "bmm-uniform" (cuBLAS's batched GEMM on the ideal
routes, every expert exactly T k / E rows, the same weights: what these GEMMs reach without
routing's uneven groups). Each counts its own FLOPs and bytes. One H200 (8b2d625, `--clocks`):
dense-gemm 680.5 TFLOP/s (87.6% of 777: every GEMM here runs at the board's 700 W cap, the SM
clock at 1,185-1,480 of 1,980 MHz), bmm-uniform 14.88 ms, gemm-triton 17.62 ms.
A row that fails reports its error instead of a time.
With `--expert-dtype mxfp4` the experts are quantized and kept packed: "experts-mxfp4" and
"gemm-mxfp4" run the W4A16 kernels the pass picks (`experts.pick_gemm`: the Gluon kernel
`k3kernels.moe.w4a16_decode` at decode sizes on sm_90, else the Triton kernel
`k3kernels.moe.w4a16`), "experts-mxfp4-triton" and "gemm-mxfp4-triton" the Triton kernel
always (swept rows: its tiles), their TB/s counted on the packed bytes (0.53 B per weight),
beside the bf16 rows on the same weights' dequantized values. Where the Gluon kernel splits K
(one or two tokens), "gemm-mxfp4" leaves its fp32 parts unsummed (the pass sums them in the
activation and the combine).
First H200 run (torch 2.11): experts 22.0 ms = 345 TFLOP/s (44% of peak), gemm 20.1 ms = 378
TFLOP/s (49%), torch-elementwise 35.0 ms (28%): the grouped GEMMs' tile waste (see
grouped_gemm.py) bounds this design, not the sort, activation or combine (2 ms together).
Times are CUDA-event medians of replays of a CUDA graph of a whole pass over all layers
("loop-before", which reads counts on the host, runs eagerly): at a few tokens an eager pass is
bound by the host's launches (7 layers at 1 token, MXFP4: ~4 ms eager for 0.25 ms of kernels).
At decode shapes (few tokens) the column that matters is TB/s: the bytes of the experts the
routes touch (each read once) over the time, against the copy bandwidth (4.26 TB/s on the
H200; every % is of the GPU's own rates, `roofline.device_rates`).
"% of roofline" puts each time beside the least the GPU needs (`roofline_ms`): the FLOPs at
the bf16 peak or the expert bytes at the copy bandwidth, whichever takes longer. At k3-slice
prefill the bytes do: ~146 rows per expert (8,192 x 2 / 112) do 2 x 146 FLOPs per 2-byte
weight, 146 FLOP per byte, under the H200's ridge of 777 / 4.26 = 182. The 7 layers' 51.8 GB
of bf16 experts take 12.2 ms at the copy bandwidth, their 7.58 TFLOP 9.8 ms at the peak: 60%
of the bf16 peak (16.2 ms) is 75% of that roofline, for the GEMMs and for everything around
them, whose own traffic (gather, activation, combine: ~1.1 GB a layer) the roofline leaves out.
"""

import itertools
import json
import statistics
import time
from functools import partial

import torch

from k3batch.bench.engine import profile_ops
from k3batch.bench.kernels import sustained_clock, time_ms
from k3batch.model import get_flavor
from k3batch.bench.roofline import device_rates, roofline_ms
from k3kernels.moe.act import moe_act
from k3kernels.moe.experts import fused_experts, pick_gemm
from k3kernels.moe.grouped_gemm import grouped_mm
from k3kernels.moe.grouped_gemm_triton import grouped_mm_triton, regime
from k3kernels.moe.mxfp4 import round_to_mxfp4_
from k3kernels.moe.permute import sort_slots


def _layer_inputs(config, num_tokens: int, gen, device):
    D = config.routed_expert_hidden_size or config.hidden_size
    E, I, k = config.num_experts, config.moe_intermediate_size, config.num_experts_per_token

    def randn(*shape, std):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16)

    x = randn(num_tokens, D, std=1.0)
    w13 = randn(E, 2 * I, D, std=D**-0.5)
    w2 = randn(E, D, I, std=I**-0.5)
    scores = torch.rand(num_tokens, E, generator=gen, device=device)
    ids = scores.topk(k, dim=-1).indices
    weights = scores.gather(-1, ids)
    return x, w13, w2, ids, weights


def moe_throughput(flavor: str = "k3-slice", *, num_tokens: int = 8192, num_layers=None,
                   repeats: int = 10, rounds: int = 3, seed: int = 0,
                   expert_dtype: str = "bf16", sweep: bool = False,
                   clocks: bool = False, profile: bool = False) -> list[dict]:  # fmt: skip
    """Rows {"impl", "ms", "tflops", "pct_peak", "weight_tbps"} for the routed experts of
    `num_layers` MoE layers (default: all of the flavor's) at `num_tokens` tokens, on CUDA,
    activations bf16. expert_dtype "mxfp4": the experts quantized and kept packed, rows
    "experts-mxfp4" / "gemm-mxfp4" (the W4A16 kernel, TB/s on the packed bytes) beside the
    bf16 "experts" / "gemm" rows of the same weights' dequantized values. Each row's "ms" is
    the median of `rounds` times ("ms_rounds"), each the median of `repeats` calls, the rows
    taken in turn in each round. sweep: also the Triton GEMM of that format over
    `sweep_configs` (rows named "<impl> <config json>"; bf16 rows time the gate-up GEMM's
    gather and activation too, each in the GEMM or a pass of its own: `gemm_swept`); the best
    goes into the GPU's tuned table (`k3kernels/moe/tuned/`). profile: the row of the pass the
    model runs ("experts-mxfp4", else "experts-triton") also gets "profile", its kernels' GPU
    time over PROFILED_PASSES eager passes (`k3batch.bench.engine.profile_ops`). clocks: each
    CUDA-graph row also gets the SM clock and board power it ran at (`sustained_clock`, 3 s a
    row)."""
    if not torch.cuda.is_available():
        raise ValueError("bench moe needs a CUDA device")
    config = get_flavor(flavor)
    if num_layers is None:
        num_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = [_layer_inputs(config, num_tokens, gen, device) for _ in range(num_layers)]
    kw = dict(act=config.hidden_act, beta=config.situ_beta, linear_beta=config.situ_linear_beta)
    D = layers[0][0].shape[1]
    k, I = config.num_experts_per_token, config.moe_intermediate_size
    flops = num_layers * 2 * num_tokens * k * 3 * D * I
    touched = sum(int(ids.unique().numel()) for _, _, _, ids, _ in layers)
    weight_bytes = touched * 3 * D * I * 2  # bf16 w13 [2I, D] + w2 [D, I] per expert
    packed_bytes = touched * 3 * D * I * 17 // 32  # MXFP4: 4 bits + one byte per 32 values
    if expert_dtype == "mxfp4":
        # the bf16 rows then run on the same weights' dequantized values
        packed = [(round_to_mxfp4_(w13), round_to_mxfp4_(w2)) for _, w13, w2, _, _ in layers]
    elif expert_dtype != "bf16":
        raise ValueError(f"expert_dtype = {expert_dtype!r}; expected bf16 or mxfp4")
    # Each GEMM row runs on the values the pass would give it: x's sorted rows, and the
    # activation of the gate-up GEMM's output (zeros, as an uninitialized buffer may hold, made
    # the same GEMMs ~15% faster on the H200: the tensor cores' power depends on the data).
    sorted_rows, slot_tokens = [], []
    for x, w13, w2, ids, _ in layers:
        order = sort_slots(ids, config.num_experts)
        xs = x.index_select(0, order.token_M)
        h = moe_act(grouped_mm(xs, w13, order.offs_E), kw["act"], kw["beta"], kw["linear_beta"])
        sorted_rows.append((xs, h, order.offs_E))
        slot_tokens.append(order.token_M)

    def experts(use_triton, impl="torch"):
        def run():
            for x, w13, w2, ids, w in layers:
                fused_experts(x, w13, w2, ids, w, use_triton=use_triton, gemm_impl=impl, **kw)

        return run

    def gemm_only(impl="torch"):
        gemm = grouped_mm_triton if impl == "triton" else grouped_mm

        def run():
            for (x, w13, w2, _, _), (xs, h, offs) in zip(layers, sorted_rows):
                gemm(xs, w13, offs)
                gemm(h, w2, offs)

        return run

    def gemm_swept(cfg, gemm_fn=grouped_mm_triton, weights=None):
        """A swept prefill launch (bf16, or the W4A16 kernel's on `weights`, the packed pairs)
        as the pass runs it, from x to the down GEMM's output: the gate-up GEMM's rows gathered
        first (index_select) or, with "gather", read by index in the GEMM; the activation after
        it (`moe_act`) or, with "act", in it; then the down GEMM. So each way is timed with the
        work it leaves to a pass of its own."""
        fold = {name: cfg.get(name, False) for name in ("gather", "act")}
        gemm = partial(gemm_fn, **{k: v for k, v in cfg.items() if k not in fold})
        pairs = weights or [(w13, w2) for _, w13, w2, _, _ in layers]

        def run():
            for (x, _, _, _, _), (w13, w2), (_, h, offs), tok in zip(layers, pairs, sorted_rows,
                                                                     slot_tokens):  # fmt: skip
                xs = x if fold["gather"] else x.index_select(0, tok)
                rows = (xs, w13, offs, tok) if fold["gather"] else (xs, w13, offs)
                if fold["act"]:
                    gemm(*rows, **kw)
                else:
                    moe_act(gemm(*rows), kw["act"], kw["beta"], kw["linear_beta"])
                gemm(h, w2, offs)

        return run

    def loop_before():
        for x, w13, w2, ids, w in layers:
            _loop_experts(x, w13, w2, ids, w, **kw)

    def experts_mxfp4(impl="auto"):
        def run():
            for (x, _, _, ids, w), (w13, w2) in zip(layers, packed):
                fused_experts(x, w13, w2, ids, w, use_triton=True, gemm_impl=impl, **kw)

        return run

    def gemm_mxfp4(impl="auto", cfg=None):
        """The pass's W4A16 GEMMs for gemm_impl impl (the Gluon decode kernel where it applies,
        its rows interleaved beforehand, as the pass's gather and activation write them); a
        swept config: the Triton kernel with those tiles."""
        from k3kernels.moe.interleave import gather_interleaved
        from k3kernels.moe.w4a16 import grouped_mm_mxfp4

        if cfg:
            gemm, interleaved = partial(grouped_mm_mxfp4, **cfg), False
        else:
            gemm, interleaved, _ = pick_gemm(*packed[0], num_tokens * k, layers[0][0], impl)
        rows = [(gather_interleaved(xs), gather_interleaved(h), offs) if interleaved
                else (xs, h, offs) for xs, h, offs in sorted_rows]  # fmt: skip

        def run():
            for (w13, w2), (xs, h, offs) in zip(packed, rows):
                gemm(xs, w13, offs)
                gemm(h, w2, offs)

        return run

    # References measured in the same process, each with its own FLOPs and bytes: this GPU's
    # dense bf16 GEMM (its peak here, at its power cap), and cuBLAS on the ideal routes (every
    # expert exactly T k / E rows, one batched GEMM per projection): what the GEMMs of this
    # pass can reach on this machine without routing's uneven groups.
    n = 8192
    a, b = (torch.randn(n, n, generator=gen, device=device).to(torch.bfloat16) for _ in range(2))
    own = {"dense-gemm": (10 * 2 * n**3, 10 * 3 * n * n * 2)}

    def dense():
        for _ in range(10):
            torch.mm(a, b)

    R = num_tokens * k // config.num_experts
    uniform = [tuple(torch.randn(config.num_experts, R, width, generator=gen, device=device)
                     .to(torch.bfloat16) for width in (D, I))
               for _ in range(num_layers if R >= 64 else 0)]  # fmt: skip

    def bmm_uniform():
        for (_, w13, w2, _, _), (x, h) in zip(layers, uniform):
            torch.bmm(x, w13.transpose(1, 2))
            torch.bmm(h, w2.transpose(1, 2))

    rows = []
    impls = [("experts", experts(True)), ("gemm", gemm_only()),
             ("experts-triton", experts(True, impl="triton")),
             ("gemm-triton", gemm_only(impl="triton")),
             ("torch-elementwise", experts(False)), ("loop-before", loop_before),
             ("dense-gemm", dense)]  # fmt: skip
    if uniform:  # prefill shapes only
        impls.append(("bmm-uniform", bmm_uniform))
        per_layer = config.num_experts * 3 * D * I
        own["bmm-uniform"] = (num_layers * 2 * R * per_layer, num_layers * per_layer * 2)
    if expert_dtype == "mxfp4":
        beside = ("experts", "gemm", "experts-triton", "gemm-triton", "dense-gemm", "bmm-uniform")
        impls = [("experts-mxfp4", experts_mxfp4()), ("gemm-mxfp4", gemm_mxfp4()),
                 ("experts-mxfp4-triton", experts_mxfp4("triton")),
                 ("gemm-mxfp4-triton", gemm_mxfp4("triton")),
                 *(row for row in impls if row[0] in beside)]  # fmt: skip
    if sweep:  # the Triton kernel of this weight format over launch configs, as "<impl> {cfg}"
        decode = regime(num_tokens * k, config.num_experts) == "decode"
        if expert_dtype == "bf16":
            gemm, name = gemm_swept, "gemm-triton"
        elif decode:
            gemm, name = gemm_mxfp4, "gemm-mxfp4"
        else:  # with the folds, as the pass runs them
            from k3kernels.moe.w4a16 import grouped_mm_mxfp4

            gemm = partial(gemm_swept, gemm_fn=grouped_mm_mxfp4, weights=packed)
            name = "gemm-mxfp4"
        impls += [(f"{name} {json.dumps(cfg)}", gemm(cfg=cfg))
                  for cfg in sweep_configs(decode, bf16=expert_dtype == "bf16")]  # fmt: skip
    times = {impl: [] for impl, _ in impls}
    errors = {}
    # The rows in turn, so that a drift of the GPU's clocks over the run does not favour the
    # rows timed first or last; the reference GEMMs after the others: they run at the board's
    # power cap, and the row after dense-gemm in each round, the same kernel as another row,
    # measured 5-7% slower than that row on the H200.
    reference = [row for row in impls if row[0] in own]
    for group in ([row for row in impls if row[0] not in own], reference):
        for _ in range(rounds):
            for impl, fn in group:
                if impl in errors:
                    continue
                try:  # "loop-before" reads counts on the host: eager
                    times[impl].append(time_ms(fn, repeats, graph=impl != "loop-before"))
                except Exception as e:  # an experimental row must not hide the others
                    errors[impl] = f"{type(e).__name__}: {e}"[:300]
    for impl, fn in impls:
        if impl in errors:
            rows.append({"impl": impl, "error": errors[impl]})
            continue
        ms = statistics.median(times[impl])
        row_flops, bytes_read = own.get(impl, (flops, weight_bytes))
        if "mxfp4" in impl:
            bytes_read = packed_bytes
        tflops, peak = row_flops / ms / 1e9, device_rates()
        rows.append({"impl": impl, "flavor": flavor, "layers": num_layers, "tokens": num_tokens,
                     "ms": round(ms, 3), "ms_rounds": [round(t, 3) for t in times[impl]],
                     "tflops": round(tflops, 1),
                     "weight_tbps": round(bytes_read / ms / 1e9, 2),
                     "pct_peak": round(100 * tflops / peak[0], 1),
                     "pct_roofline": round(100 * roofline_ms(row_flops, bytes_read, *peak) / ms, 1),
                     })  # fmt: skip
        if clocks and impl != "loop-before":
            rows[-1] |= sustained_clock(fn)
        if profile and impl == ("experts-mxfp4" if expert_dtype == "mxfp4" else "experts-triton"):
            rows[-1]["profile"] = profile_ops(partial(_timed, fn, PROFILED_PASSES), cuda=True)
    return rows


PROFILED_PASSES = 10


def _timed(fn, n: int) -> float:
    """Wall seconds of n eager calls of fn, the GPU drained."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def save_best(rows: list[dict], expert_dtype: str, flavor: str, num_tokens: int) -> dict:
    """The fastest swept config into the current GPU's tuned table (the JSON file that
    `launch_config` reads), table expert_dtype, under the keys of the flavor's two GEMMs (gate-up
    and down) at num_tokens tokens (`grouped_gemm_triton.table_key`), other entries kept;
    returns {"config", "keys", "path"}."""
    from k3kernels import tuned
    from k3kernels.moe import grouped_gemm_triton as G

    swept = [r for r in rows if "{" in r["impl"] and "ms" in r]
    if not swept:
        raise ValueError("no swept config ran")
    best = min(swept, key=lambda r: r["ms"])
    cfg = json.loads(best["impl"].split(" ", 1)[1])
    config = get_flavor(flavor)
    D = config.routed_expert_hidden_size or config.hidden_size
    I, E = config.moe_intermediate_size, config.num_experts
    M = num_tokens * config.num_experts_per_token
    keys = [G.table_key(M, E, 2 * I, D), G.table_key(M, E, D, I)]
    path = G.TUNED_DIR / tuned.file_name(torch.cuda.get_device_name())
    for key in keys:
        tuned.save(path, expert_dtype, key, cfg)
    return {"config": cfg, "keys": keys, "path": str(path)}


def sweep_configs(decode: bool, bf16: bool = False) -> list[dict]:
    """Launch configs of the Triton grouped GEMMs (bf16 and W4A16) that `--sweep` times; bf16:
    the bf16 kernel's prefill tiles, block_m + block_t rows (see `grouped_mm_triton`). Each
    compiles once (0.3-8 s, sm_90 on a CPU), so the grids hold what came within ~20% of the best
    at k3-slice (`benchmarks/moe_k3slice_h200.jsonl`) and the row splits that matter at other
    shapes."""
    keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    tail_keys = ("block_m", "block_t", *keys[1:])
    if decode:  # k3-slice, W4A16 at 1-256 tokens: the best tile with 32- or 256-wide columns
        # took 1.10-1.81x the best at each size, with 2 stages 1.04-1.23x, so neither is swept
        # (256-wide columns: fewer W4A16 instructions per weight in the SASS and fewer
        # registers than 16 x 128 x 256, but 3.24-3.51 ms against 2.90 at 64 tokens, 8630319)
        grid = itertools.product((16,), (64, 128), (64, 128, 256), (2, 4), (3, 4))
        return [dict(zip(keys, values)) for values in grid]
    if not bf16:  # W4A16, 128-wide columns and inputs, 4 warps, 3 stages: at k3-slice prefill
        # (8,192 tokens) 256-wide columns, 8 warps or 4 stages took 1.23x the best, 64-wide
        # inputs 1.36x, 64-row tiles 1.24x, 2 stages 1.81x. 256-row tiles, which unpack an
        # expert's weight tile once where 128-row ones (two per ~146-row expert) unpack it
        # twice, took 32.0-59.6 ms at 8,192 tokens (256 x {64, 128} x {64, 128}, 8 warps, 2-4
        # stages) against 26.1 for the then tuned 128 x 128 x 128 (one H200, 2026-12-02). An
        # expert's last tile of at most block_t rows as a block_t-row tile: 128 + 32 rows x 128
        # x 128 (4 warps, 3 stages) 21.2 ms, 128 + 64 22.9, 256-wide columns 78-82 (599b3ae).
        # 128 + 0 and 128 + 64 cover 256 rows an expert exactly (Kimi Linear at 8,192 tokens:
        # 8,192 x 8 / 256). These tiles compile in 1.4-7.9 s each.
        # Each with its rows read by index (the pass's default), in and out of the
        # activation; one also from a gathered copy.
        rows = ((128, 0), (128, 32), (128, 64), (64, 0))
        tiles = [dict(zip(tail_keys, (bm, bt, 128, 128, 4, 3))) for bm, bt in rows]
        return [t | {"gather": True, "act": act} for act in (False, True) for t in tiles] + [
            tiles[1] | {"gather": False, "act": False}]
    # bf16: 128-input steps (3 stages at most) took 16.5 ms against 15.5-16.2 (fab7054); a
    # 16-row tail 1.21x the best (k3-slice prefill)
    # gather: the gate-up GEMM reads its rows of x by index (pointer loads, not TMA) instead of
    # from an index_select copy: tried with the row splits that cover Kimi Linear's 256 rows
    # an expert and k3-slice's ~146. act: the gate-up GEMM applies the activation (each tile
    # in and out of both ways, so the table holds whichever was faster)
    tiles = ((128, 4, 3), (128, 8, 3), (256, 8, 4))  # (block_n, num_warps, num_stages)
    configs = [dict(zip(tail_keys, (128, bt, bn, 64, nw, ns)))
               for bt, (bn, nw, ns) in itertools.product((0, 32, 64), tiles)]  # fmt: skip
    configs += [c | {"gather": True} for c in configs if c["block_t"]]
    configs.append(dict(block_m=64, block_t=32, block_n=128, block_k=64, num_warps=4,
                        num_stages=3))  # fmt: skip
    return [c | {"act": act} for act in (False, True) for c in configs]


def _loop_experts(x_TD, w13, w2, ids_Tk, weights_Tk, *, act, beta, linear_beta):
    """The routed experts as computed before the grouped GEMMs (base commit 998277b)."""
    I = w2.shape[2]
    out = torch.zeros(x_TD.shape[0], x_TD.shape[1], dtype=torch.float32, device=x_TD.device)
    flat = ids_Tk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token = order // ids_Tk.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel, tok = order[start : start + n], token[start : start + n]
        start += n
        xe = x_TD[tok]
        g, u = (xe @ w13[e, :I].t()).float(), (xe @ w13[e, I:].t()).float()
        if act == "situ":
            up = linear_beta * torch.tanh(u / linear_beta)
            h = beta * torch.tanh(g / beta) * torch.sigmoid(g) * up
        else:
            h = torch.nn.functional.silu(g) * u
        ye = (h.to(x_TD.dtype) @ w2[e].t()).float() * weights_Tk.reshape(-1)[sel, None]
        out.index_add_(0, tok, ye)
    return out


def format_moe_table(rows: list[dict]) -> str:
    r0 = next((r for r in rows if "error" not in r), {"flavor": "?", "layers": "?", "tokens": "?"})
    tflops, tbps = device_rates()
    lines = [
        f"routed experts, {r0['flavor']}: {r0['layers']} layers x {r0['tokens']} tokens, bf16; "
        f"peak {tflops:.0f} TFLOP/s, copy {tbps:.2f} TB/s",
        "impl                 |       ms | TFLOP/s | % of peak | expert TB/s | % of copy | "
        "% of roofline" + (" |  SM MHz |  watts" if any("sm_mhz" in r for r in rows) else ""),
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:20s} | error: {r['error']}")
            continue
        lines.append(
            f"{r['impl']:20s} | {r['ms']:8.3f} | {r['tflops']:7.1f} | {r['pct_peak']:8.1f}% | "
            f"{r['weight_tbps']:11.2f} | {100 * r['weight_tbps'] / tbps:8.1f}% | "
            f"{r['pct_roofline']:12.1f}%"
            + (f" | {r['sm_mhz']:7d} | {r['watts']:6.1f}" if "sm_mhz" in r else "")
        )
    return "\n".join(lines)
