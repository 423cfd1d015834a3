"""Benchmarks (numbers are printed, never asserted). `k3batch bench pipeline`: the fill of a
chunked prefill pipeline against the teaching model. `k3batch bench engine`: single-device
prefill and decode speed, prefill MFU, peak memory and (with --profile) the top ops by GPU time.
`k3batch bench moe` lives in `bench/moe.py`.

MFU counts useful FLOPs as 2 x active parameters per token (`k3batch.bench.roofline.active_params`:
every projection, the top-k routed experts and the shared experts, the LM head; not the
embedding lookup, not the attention scores), over the GPU's bf16 peak (`roofline.gpu_rates`: the
bf16 GEMM measured on the H200, 777 TFLOP/s; another GPU's datasheet derated alike): on the
H200 k3-slice has 6.78 B active parameters, so 100% is about 57k tokens/s; kimi-linear has
3.11 B, so 100% is about 125k tokens/s. The decode roofline is at the same GPU's rates.

Teaching model: n equal chunks through P stages take n + P - 1 chunk-times, in which each stage
works n of them, so the fill (mean busy fraction) is n / (n + P - 1): 5 chunks over 8 stages
fill 5/12 = 42%. Measured: one prompt of n chunks submitted back to back through P stage
actors; each stage's compute intervals (receive and send excluded) over the span from the first
compute start to the last compute end.
"""

import statistics
import time

import torch

from k3batch.engine.config import EngineConfig
from k3batch.model.forward_batch import ForwardBatch
from k3batch.bench.roofline import active_params, gpu_name, gpu_rates


def teaching_fill(num_chunks: int, num_stages: int) -> float:
    return num_chunks / (num_chunks + num_stages - 1)


def pipeline_fill(
    model_dir: str,
    *,
    num_stages: int,
    chunk_counts: list[int],
    chunk_tokens: int,
    device: str,
    repeats: int = 2,
) -> list[dict]:
    from k3batch.actors.world import spawn_runners

    max_len = max(chunk_counts) * chunk_tokens + 1
    cfg = EngineConfig(
        max_num_seqs=1, max_seq_len=max_len, chunk_size=chunk_tokens, max_batch_tokens=chunk_tokens
    )
    pages = list(range(-(-max_len // cfg.page_size)))  # one request: block 0, pages from 0
    runner, _ = spawn_runners(
        model_dir,
        num_stages=num_stages,
        engine_config=cfg,
        device=device,
        dtype=torch.float32 if device == "cpu" else torch.bfloat16,
    )
    rows = []
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = runner.config.vocab_size
        for n in [1, *chunk_counts]:  # the first n = 1 warms every stage up
            best = None
            for _ in range(repeats):
                runner.bubble(reset=True)
                t0 = time.perf_counter()
                handles = []
                for c in range(n):
                    ids = torch.randint(0, vocab, (chunk_tokens,), generator=gen).tolist()
                    batch = ForwardBatch(
                        seq_lens=[chunk_tokens],
                        cached_lens=[c * chunk_tokens],
                        slot_ids=[0],
                        page_tables=[pages],
                    )
                    handles.append(runner.submit(ids, batch, all_logits=False))
                for h in handles:
                    runner.wait(h)
                wall = time.perf_counter() - t0
                stats = runner.bubble(reset=True)
                fill = 1 - stats["bubble"]
                if best is None or fill > best["fill"]:
                    best = {"chunks": n, "fill": fill, "busy": stats["busy"], "wall_s": wall}
            rows.append(best | {"teaching_fill": teaching_fill(n, num_stages)})
    finally:
        runner.shutdown()
    return rows[1:]


def format_fill_table(rows: list[dict], num_stages: int) -> str:
    lines = [
        f"chunked prefill pipeline, P = {num_stages} stages",
        "chunks | measured fill | teaching n/(n+P-1) | bubble | wall s",
    ]
    for r in rows:
        lines.append(
            f"{r['chunks']:6d} | {r['fill']:13.1%} | {r['teaching_fill']:18.1%} | "
            f"{1 - r['fill']:6.1%} | {r['wall_s']:6.2f}"
        )
    return "\n".join(lines)


def run_pipeline_bench(model_dir, *, num_stages, chunk_counts, chunk_tokens, device, address=None):
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address=address, num_cpus=None if address else num_stages + 2, include_dashboard=False
        )
    try:
        return pipeline_fill(
            model_dir,
            num_stages=num_stages,
            chunk_counts=chunk_counts,
            chunk_tokens=chunk_tokens,
            device=device,
        )
    finally:
        if started:
            ray.shutdown()


def _expert_dtype(model) -> str:
    """"mxfp4" when the routed experts are held packed, else their dtype's name."""
    for name, p in model.named_parameters():
        if ".block_sparse_moe.experts." in name:
            return "mxfp4" if p.dtype == torch.uint8 else str(p.dtype).removeprefix("torch.")
    return "none"


def engine_throughput(flavor: str, *, device: str, batch: int, prompt_len: int, new_tokens: int,
                      chunk_size: int, seed: int = 0, profile: bool = False,
                      cuda_graphs: bool = True, overlap: bool = True,
                      expert_dtype: str | None = None, model_dir: str | None = None,
                      moe_gemm: str = "auto", prefix_cache: bool = True) -> dict:  # fmt: skip
    """Single-device engine speed on random weights made on the device, or on the checkpoint at
    `model_dir` (its own flavor; experts as stored unless expert_dtype says otherwise):
    prefill tokens/s over `batch` prompts (median of PREFILL_REPEATS), then decode tokens/s
    with all of them running, and the decode step beside its roofline
    (`k3batch.bench.roofline`: each part's bytes at the GPU's copy bandwidth or its FLOPs at
    its bf16 peak). "prefill_forwards": the forwards one prefill of the batch took: with the
    prefix cache each prompt is also cut at its last page boundary (its checkpoint), so a lone
    8,192-token prompt takes 8,176 tokens and then 16; `prefix_cache=False` cuts it only at
    chunk_size.
    With `profile`, one more prefill and then its first PROFILED_DECODE_STEPS decode steps
    run under the torch profiler, and the row gets "profile" and "decode_profile": the top
    ops by self GPU time (CPU time without CUDA). moe_gemm: the routed experts' grouped GEMM
    ("auto", "torch" or "triton": `k3kernels.moe.experts.fused_experts`), or several,
    comma-separated: the prefills then alternate between them in this one process (the first
    one's order reversed every other round), each the median of its PREFILL_REPEATS, as
    "prefill_by_moe_gemm" {name: [tokens/s, MFU %]}; the decode runs the first."""
    from k3batch.engine.config import EngineConfig
    from k3batch.engine.engine import Engine
    from k3batch.engine.request import Phase, SamplingParams
    from k3batch.model import K3Model, get_flavor
    from k3batch.model.loader import load_model
    from k3batch.model.init import init_random_
    from k3batch.model.moe import Experts

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    if model_dir is not None:
        model = load_model(model_dir, dtype=dtype, device=device,
                           expert_dtype=expert_dtype or "auto").eval()  # fmt: skip
    else:
        model = K3Model(get_flavor(flavor), dtype=dtype, device=device,
                        expert_dtype=expert_dtype or "bf16")  # fmt: skip
        init_random_(model, seed).eval().set_backend("fla" if cuda else "torch")
    build_s = time.perf_counter() - t0
    gemms = moe_gemm.split(",")

    def use_gemm(impl):
        for m in model.modules():
            if isinstance(m, Experts):
                m.gemm_impl = impl

    use_gemm(gemms[0])
    cfg = EngineConfig(max_num_seqs=batch, max_seq_len=prompt_len + new_tokens + 1,
                       chunk_size=chunk_size, max_batch_tokens=max(chunk_size, 8192),
                       cuda_graphs=cuda_graphs, overlap=overlap,
                       prefix_cache=prefix_cache)  # fmt: skip
    t0 = time.perf_counter()
    engine = Engine(model, cfg)  # on CUDA: captures the decode graphs (warm-up included)
    capture_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    first_only = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    forwards: list[int] = []  # engine steps of each prefill (each one forward, overlap aside)

    def prefill(params=sp):
        for i in range(batch):
            engine.add_request(
                str(i), torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params
            )
        sync()
        t, steps = time.perf_counter(), 1
        engine.step()  # admits everything
        while any(r.phase is Phase.PREFILL for r in engine.running):
            engine.step()
            steps += 1
        sync()
        forwards.append(steps)
        return time.perf_counter() - t

    def decode(max_steps=None):
        steps = 0
        t = time.perf_counter()
        while engine.has_unfinished() and steps != max_steps:
            engine.step()
            steps += 1
        sync()
        return time.perf_counter() - t, steps

    prefill(), decode()  # warm-up: kernel compilation and autotuning
    for impl in gemms[1:]:
        use_gemm(impl)
        prefill(first_only)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # the median of PREFILL_REPEATS prefills (one run varied by up to 20% on an H200); then
    # one more prefill, whose requests go on to the timed decode
    times = {impl: [] for impl in gemms}
    for i in range(PREFILL_REPEATS):
        for impl in gemms if i % 2 == 0 else gemms[::-1]:
            use_gemm(impl)
            times[impl].append(prefill(first_only))
    use_gemm(gemms[0])
    prefill()
    t_decode, _ = decode()
    step_ms = 1000 * t_decode / max(new_tokens - 1, 1)  # the first token came with the prefill
    gpu = gpu_name(device)
    tflops, tbps = gpu_rates(gpu)
    floor = _decode_floor(engine, model, prefill, decode, batch * [prompt_len + new_tokens // 2],
                          tflops=tflops, tbps=tbps)  # fmt: skip
    flops_per_token = 2 * active_params(model.config)

    def mfu(tps):
        return round(100 * tps * flops_per_token / 1e12 / tflops, 1)

    tps = {impl: batch * prompt_len / statistics.median(t) for impl, t in times.items()}
    prefill_tps = tps[gemms[0]]
    row = {
        "flavor": flavor if model_dir is None else None, "device": device, "gpu": gpu,
        "peak_tflops": round(tflops, 1), "peak_tbps": round(tbps, 3), "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens, "chunk_size": chunk_size, "build_s": round(build_s, 1),
        "graphs": engine.runner.graphs is not None and bool(engine.runner.graphs.graphs),
        "overlap": engine.overlap,
        "capture_s": round(capture_s, 1),
        "prefill_tokens_per_s": round(prefill_tps, 1),
        "prefill_tflops": round(prefill_tps * flops_per_token / 1e12, 1),
        "prefill_mfu_pct": mfu(prefill_tps), "prefill_forwards": forwards[-1],
        "prefix_cache": prefix_cache,
        "decode_tokens_per_s": round(batch * (new_tokens - 1) / t_decode, 1),
        "decode_step_ms": round(step_ms, 2),
        "decode_floor_ms": round(floor.floor_ms(), 3),
        "decode_roofline_x": round(step_ms / floor.floor_ms(), 2),
        "decode_floor_parts_ms": {k: round(v, 3) for k, v in floor.ms().items()},
        "decode_bytes": floor.bytes, "decode_flops": floor.flops,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "model": model_dir, "expert_dtype": _expert_dtype(model), "moe_gemm": moe_gemm,
        "weights_gib": round(sum(p.nbytes for p in model.parameters()) / 2**30, 1),
        "routed_expert_gib": round(sum(p.nbytes for n, p in model.named_parameters()
                                       if ".block_sparse_moe.experts." in n) / 2**30, 2),
        "arena_gib": round(engine.runner.cache.total_bytes / 2**30, 1),
        "workspace_gib": round((engine.runner.workspace_bytes or 0) / 2**30, 2),
    }  # fmt: skip
    if len(gemms) > 1:
        row["prefill_by_moe_gemm"] = {impl: [round(t, 1), mfu(t)] for impl, t in tps.items()}
    if profile:
        row["profile"] = profile_ops(prefill, cuda)
        row["decode_profile"] = profile_ops(lambda: decode(PROFILED_DECODE_STEPS)[0], cuda)
        decode()
    return row


def _decode_floor(engine, model, prefill, decode, context_lens, **rates):
    """The roofline of the measured decode steps (`k3batch.bench.roofline`): one more prefill, its
    first decode step under a route counter (the experts a step selects), then the rest."""
    from k3batch.bench.roofline import RouteCounter, decode_floor

    prefill()
    engine.runner.eager = True  # graph replays run no module hooks
    with RouteCounter(model) as rc:
        engine.step()
    engine.runner.eager = False
    decode()
    return decode_floor(model, context_lens=context_lens, experts_selected=rc.selected, **rates)


PROFILED_DECODE_STEPS = 8
PREFILL_REPEATS = 3


def profile_ops(run, cuda: bool, top: int = 25) -> dict:
    """{"wall_ms", "total_ms", "ops"}: `run()` (returns its wall seconds) under the profiler;
    on CUDA its top kernels by device time (ops launch them, so counting both would count
    the time twice), on CPU its top ops by self CPU time; each with its share of the total."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts) as prof:
        wall_s = run()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    if cuda:
        events = [e for e in events if e.device_type == DeviceType.CUDA] or events
    events = sorted(events, key=lambda e: getattr(e, attr), reverse=True)
    total_us = sum(getattr(e, attr) for e in events) or 1.0
    ops = [{"op": e.key[:70], "ms": round(getattr(e, attr) / 1000, 2), "calls": e.count,
            "pct": round(100 * getattr(e, attr) / total_us, 1)} for e in events[:top]]  # fmt: skip
    return {"wall_ms": round(1000 * wall_s, 1), "total_ms": round(total_us / 1000, 1), "ops": ops}


def format_profile(profile: dict, what: str = "one prefill") -> str:
    lines = [
        f"{what} under the profiler: wall {profile['wall_ms']} ms, "
        f"op time {profile['total_ms']} ms (kernel time; self CPU time of ops without CUDA)",
        "    ms |     % | calls | op",
    ]
    for o in profile["ops"]:
        lines.append(f"{o['ms']:6.1f} | {o['pct']:5.1f} | {o['calls']:5d} | {o['op']}")
    return "\n".join(lines)
