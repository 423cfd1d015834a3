"""`k3batch bench ...`: the benchmark commands (engine, kernels, MoE, layouts, the job)."""

import json

import click


@click.group()
def bench():
    """Benchmarks: they print numbers (and save them with --json)."""


@bench.command("pipeline")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--stages", default=8, show_default=True, type=int)
@click.option(
    "--chunks",
    default="1,2,3,4,5,6,8,12,16,24,32",
    show_default=True,
    help="Comma-separated chunk counts.",
)
@click.option("--chunk-tokens", default=64, show_default=True, type=int)
@click.option("--device", default="cpu", show_default=True)
@click.option("--address", default=None, help="Ray cluster; default: a local Ray.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_pipeline(model_dir, stages, chunks, chunk_tokens, device, address, json_path):
    """Measured fill of a chunked PP prefill against the teaching model n/(n+P-1)."""
    from k3batch.bench.engine import format_fill_table, run_pipeline_bench

    counts = [int(c) for c in chunks.split(",")]
    rows = run_pipeline_bench(
        model_dir,
        num_stages=stages,
        chunk_counts=counts,
        chunk_tokens=chunk_tokens,
        device=device,
        address=address,
    )
    click.echo(format_fill_table(rows, stages))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"stages": stages, "chunk_tokens": chunk_tokens, "device": device, "rows": rows},
                f,
                indent=1,
            )


def _append_jsonl(path: str | None, rows: list[dict]) -> None:
    """Append rows to a JSON-lines file (the benchmarks' --json), when a path is given."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def _int_list(ctx, param, value: str) -> list[int]:
    """"16,256" -> [16, 256]."""
    try:
        return [int(v) for v in str(value).split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected integers, comma-separated") from None


SAVE_TUNED_HELP = ("With --sweep: write the fastest launch into this GPU's tuned table "
                   "(kernels/<op>/tuned/<GPU>.json) under this shape's key.")


def _check_save_tuned(sweep: bool, save_tuned: bool) -> None:
    if save_tuned and not sweep:
        raise click.UsageError("--save-tuned needs --sweep (it saves the sweep's best)")


def _save_tuned(name: str, result: dict, save_tuned: bool) -> None:
    """With save_tuned, the kernel bench's best launch into this GPU's tuned table."""
    if save_tuned:
        from k3batch.bench.kernels import save_best

        try:
            path = save_best(name, result)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"tuned table {path} <- {result['key']}: {result['launch']}")


def _moe_gemms(ctx, param, value: str) -> str:
    from k3kernels.moe.experts import GEMM_IMPLS

    bad = [v for v in value.split(",") if v not in GEMM_IMPLS]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not one of {', '.join(GEMM_IMPLS)}")
    return value


@bench.command("engine")
@click.option("--flavor", default="k3-debug", show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--batch", default=8, show_default=True, type=int)
@click.option("--prompt-len", default=512, show_default=True, type=int)
@click.option("--new-tokens", default=32, show_default=True, type=int)
@click.option("--chunk-size", default=2048, show_default=True, type=int)
@click.option("--profile", is_flag=True, help="Also print the top ops of prefill and decode.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True)
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="Launch each decode step before the host takes the last one's tokens.")
@click.option("--expert-dtype", type=click.Choice(["bf16", "mxfp4"]), default=None,
              help="Routed experts in memory (mxfp4: packed, W4A16); default bf16 on random "
              "weights, as stored with --model.")  # fmt: skip
@click.option("--model", "model_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="A checkpoint instead of random weights (--flavor is then ignored).")
@click.option("--moe-gemm", default="auto", show_default=True, callback=_moe_gemms,
              help="Grouped GEMM of the routed experts: auto (bf16: Triton on Hopper, else "
              "torch; MXFP4: the Gluon kernel at decode sizes on Hopper, else Triton's), torch "
              "(MXFP4: dequantized per call) or triton; several, comma-separated "
              "(torch,triton): prefill alternates between them in one process, a median each.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="As the engine's: with it a prompt is also cut at its last page boundary.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_engine(flavor, device, batch, prompt_len, new_tokens, chunk_size, profile, cuda_graphs,
                 overlap, expert_dtype, model_dir, moe_gemm, prefix_cache, json_path):  # fmt: skip
    """Single-device engine throughput, prefill MFU and peak memory on random weights or a
    checkpoint."""
    from k3batch.actors.build import default_device
    from k3batch.bench.engine import engine_throughput, format_profile

    row = engine_throughput(
        flavor,
        device=device or default_device(),
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        chunk_size=chunk_size,
        profile=profile,
        cuda_graphs=cuda_graphs,
        overlap=overlap,
        expert_dtype=expert_dtype,
        model_dir=model_dir,
        moe_gemm=moe_gemm,
        prefix_cache=prefix_cache,
    )
    if profile:
        from k3batch.bench.engine import PROFILED_DECODE_STEPS

        click.echo(format_profile(row["profile"]))
        click.echo(format_profile(row["decode_profile"], f"{PROFILED_DECODE_STEPS} decode steps"))
    click.echo(json.dumps({k: v for k, v in row.items() if "profile" not in k}))
    click.echo(
        f"decode step {row['decode_step_ms']} ms; roofline {row['decode_floor_ms']} ms "
        f"({row['decode_roofline_x']}x) = {row['decode_floor_parts_ms']} ms: each part's bytes "
        f"at {row['peak_tbps']:.2f} TB/s or FLOPs at {row['peak_tflops']:.0f} TFLOP/s "
        f"({row['gpu']}'s, `roofline.gpu_rates`), whichever takes longer"
    )
    _append_jsonl(json_path, [row])


@bench.command("moe")
@click.option("--flavor", default="k3-slice", show_default=True)
@click.option("--tokens", default="8192", show_default=True, callback=_int_list,
              help="Tokens; several, comma-separated (16,256): one run each, in one process.")
@click.option("--layers", default=None, type=int, help="MoE layers (default: all of the flavor).")
@click.option("--repeats", default=10, show_default=True, type=int)
@click.option("--rounds", default=3, show_default=True, type=int,
              help="Times per row, the rows in turn; each row's median is reported.")
@click.option("--expert-dtype", type=click.Choice(["bf16", "mxfp4"]), default="bf16",
              show_default=True, help="mxfp4: also the packed experts through the W4A16 kernel.")
@click.option("--sweep", is_flag=True,
              help="Also time the Triton GEMM of this format over launch configs.")
@click.option("--save-tuned", is_flag=True,
              help="With --sweep: write the fastest into this GPU's tuned table, under the "
              "flavor's two GEMM shapes at this many tokens (kernels/moe/tuned/<GPU>.json).")
@click.option("--clocks", is_flag=True,
              help="Also the SM clock and board power each row runs at (nvidia-smi; 3 s a row).")
@click.option("--profile", is_flag=True,
              help="Also the GPU time of each kernel of the pass the model runs (torch profiler).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_moe(flavor, tokens, layers, repeats, rounds, expert_dtype, sweep, save_tuned, clocks,
              profile, json_path):  # fmt: skip
    """Routed experts alone (CUDA): TFLOP/s, % of the bf16 GEMM peak, TB/s on expert bytes."""
    from k3batch.bench.engine import format_profile
    from k3batch.bench.moe import PROFILED_PASSES, format_moe_table, moe_throughput, save_best

    _check_save_tuned(sweep, save_tuned)
    for num_tokens in tokens:
        try:
            rows = moe_throughput(flavor, num_tokens=num_tokens, num_layers=layers,
                                  repeats=repeats, rounds=rounds, expert_dtype=expert_dtype,
                                  sweep=sweep, clocks=clocks, profile=profile)  # fmt: skip
            click.echo(format_moe_table(rows))
            for row in rows:
                if "profile" in row:
                    click.echo(format_profile(row["profile"], f"{row['impl']}, "
                                              f"{PROFILED_PASSES} eager passes"))  # fmt: skip
            if save_tuned:
                saved = save_best(rows, expert_dtype, flavor, num_tokens)
                click.echo(f"tuned table {saved['path']} <- {expert_dtype} {saved['keys']}: "
                           f"{saved['config']}")  # fmt: skip
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        _append_jsonl(json_path, rows)


@bench.command("host")
@click.option("--flavor", default="k3-slice", show_default=True)
@click.option("--num-prompts", default=1024, show_default=True, type=int)
@click.option("--input-len", default=1024, show_default=True, type=int)
@click.option("--output-len", default=256, show_default=True, type=int)
@click.option("--arena-gib", default=88.5, show_default=True, type=float,
              help="The device arena to account for (k3-slice on one H200: 88.5 GiB).")
@click.option("--profile", is_flag=True, help="Also print the top functions (cProfile).")
@click.option("--metrics", is_flag=True,
              help="Record the replica's Prometheus metrics as a job does (a local Ray).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_host(flavor, num_prompts, input_len, output_len, arena_gib, profile, metrics,
               json_path):  # fmt: skip
    """The engine's host time per prefill and decode step of a job's schedule, with a runner
    that computes nothing (no device needed)."""
    from k3batch.bench.host import host_replay

    row = host_replay(flavor, num_prompts=num_prompts, input_len=input_len,
                      output_len=output_len, arena_gib=arena_gib, profile=profile,
                      metrics=metrics)  # fmt: skip
    if profile:
        click.echo(row.pop("profile"))
    click.echo(json.dumps(row))
    _append_jsonl(json_path, [row])


@bench.command("job")
@click.option("--flavor", default="k3-slice", show_default=True)
@click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False),
              help="Checkpoint (default: a random one of the flavor written under --work-dir).")
@click.option("--work-dir", default="out/bench-job", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--num-prompts", default=1024, show_default=True, type=int)
@click.option("--input-len", default=1024, show_default=True, type=int)
@click.option("--output-len", default=256, show_default=True, type=int)
@click.option("--device", default="auto", show_default=True)
@click.option("--replicas", "num_replicas", default=1, show_default=True, type=int)
@click.option("--max-num-seqs", default=0, show_default=True, type=int,
              help="0: sized by the engine (on a GPU, from the arena).")
@click.option("--chunk-size", default=None, type=int,
              help="Prompt tokens per request per prefill step (default: the engine's).")
@click.option("--pp", default=1, show_default=True, type=int, help="Prefill stages per replica.")
@click.option("--tp", default=1, show_default=True, type=int, help="Decode ranks per replica.")
@click.option("--disaggregate", is_flag=True,
              help="A decode group apart from prefill also at tp = 1 (pp = tp = 1: 2 GPUs).")
@click.option("--no-engine", is_flag=True, help="Skip the engine-alone run.")
@click.option("--experts", type=click.Choice(["auto", "bf16", "mxfp4"]), default="auto",
              show_default=True,
              help="Routed experts of the checkpoint written (auto: MXFP4 for K3 flavors, bf16 "
                   "for Kimi Linear; kimi-linear on one H100 needs mxfp4).")  # fmt: skip
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_job(flavor, model_dir, work_dir, num_prompts, input_len, output_len, device,
              num_replicas, max_num_seqs, chunk_size, pp, tp, disaggregate, no_engine,
              experts, json_path):  # fmt: skip
    """The batch job on random-token prompts: rows/s, tokens/s, and against the engine alone."""
    from k3batch.bench.job import format_job_bench, run_job_bench

    layout = {"pp": pp, "tp": tp, "disaggregate": disaggregate}
    row = run_job_bench(flavor, work_dir, num_prompts=num_prompts, input_len=input_len,
                        output_len=output_len, device=device, model_dir=model_dir,
                        num_replicas=num_replicas, max_num_seqs=max_num_seqs, layout=layout,
                        chunk_size=chunk_size, engine_alone=not no_engine,
                        experts=experts)  # fmt: skip
    click.echo(json.dumps(row))
    click.echo(format_job_bench(row))
    _append_jsonl(json_path, [row])


@bench.command("layouts")
@click.option("--flavor", default="k3-slice", show_default=True)
@click.option("--gpus", default=8, show_default=True, type=int, help="Devices of this host.")
@click.option("--device", default="cuda", show_default=True, help="cuda, or cpu (gloo) to try.")
@click.option("--prompt-len", default=8192, show_default=True, type=int)
@click.option("--chunk-sizes", default="1024,2048,4096", show_default=True)
@click.option("--decode-batch", default=32, show_default=True, type=int)
@click.option("--context-len", default=8192, show_default=True, type=int)
@click.option("--repeats", default=2, show_default=True, type=int, help="Timed runs (best kept).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_layouts(flavor, gpus, device, prompt_len, chunk_sizes, decode_batch, context_len,
                  repeats, json_path):  # fmt: skip
    """PP-N vs TP-N prefill and TP-N vs TP-N + DCP-N decode on N devices (random weights)."""
    from k3batch.bench.layouts import LayoutBench, run_layout_bench

    bench = LayoutBench(flavor=flavor, num_devices=gpus, device=device, prompt_len=prompt_len,
                        chunk_sizes=tuple(int(c) for c in chunk_sizes.split(",")),
                        decode_batch=decode_batch, context_len=context_len,
                        repeats=repeats)  # fmt: skip
    try:
        rows = run_layout_bench(bench)  # prints each row as it is measured
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    _append_jsonl(json_path, [r | {"flavor": flavor, "gpus": gpus} for r in rows])


@bench.command("comm")
@click.option("--flavor", default="k3", show_default=True)
@click.option("--gpus", default=8, show_default=True, type=int)
@click.option("--p2p-gbps", required=True, type=float, help="Point-to-point bandwidth, GB/s.")
@click.option("--busbw-gbps", required=True, type=float, help="All-reduce bus bandwidth, GB/s.")
def bench_comm(flavor, gpus, p2p_gbps, busbw_gbps):
    """Bytes PP-N and TP-N prefill move per 1K tokens, and the exposed time at given bandwidths
    (computed; no GPU needed)."""
    from k3batch.bench.layouts import comm_bytes_per_1k, projected_comm_ms_per_1k
    from k3batch.model import get_flavor

    config = get_flavor(flavor)
    vol = comm_bytes_per_1k(config, gpus)
    ms = projected_comm_ms_per_1k(config, gpus, p2p_gbps=p2p_gbps, busbw_gbps=busbw_gbps)
    click.echo(f"{flavor}, {gpus} devices, bf16 activations, per 1K prompt tokens:")
    click.echo(f"  tp{gpus}: {vol['tp'] / 1e6:,.1f} MB per rank ({vol['tp_all_reduces']} "
               f"all-reduces) -> {ms['tp']:.2f} ms at {busbw_gbps:g} GB/s bus "
               "bandwidth")  # fmt: skip
    click.echo(f"  pp{gpus}: {vol['pp'] / 1e6:,.1f} MB at the widest stage boundary"
               f" -> {ms['pp']:.2f} ms at {p2p_gbps:g} GB/s point to point")  # fmt: skip


def _csv(ctx, param, value):
    """A comma-separated option as a tuple (of ints where the option takes numbers); None when
    not given."""
    if value is None:
        return None
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if param.name in ("parts", "experts"):
        return items
    try:
        return tuple(int(v) for v in items)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a list of integers") from None


@bench.command("calibrate")
@click.option("--flavor", default="k3", show_default=True)
@click.option("--device", default=None, help="cuda or cpu (default: cuda when available).")
@click.option("--parts", callback=_csv,
              help="Of embed,kda,mla,dense_ffn,moe,attn_res,head (default: all).")
@click.option("--tp", callback=_csv,
              help="TP degrees, measured in this order (default 1,8,16,2,4; CPU 1,2).")
@click.option("--dcp", callback=_csv,
              help="DCP degrees of MLA decode, each where it divides tp (default 1,8,16).")
@click.option("--prefill-tokens", callback=_csv, help="Chunk tokens (default 1024,...,16384).")
@click.option("--prefill-seqs", callback=_csv,
              help="Sequences per chunk for kda, mla and head (default 1,8).")
@click.option("--prefill-contexts", callback=_csv,
              help="Cached tokens before an MLA chunk (default 8192,32768).")
@click.option("--decode-batches", callback=_csv, help="Default 1,4,16,64,256.")
@click.option("--contexts", callback=_csv,
              help="Cached tokens per sequence at MLA decode (default 1024,8192,32768,131072).")
@click.option("--experts", callback=_csv, help="Routed experts' dtypes (default bf16,mxfp4).")
@click.option("--repeats", type=int, help="Timed calls per point, the median kept (default 5).")
@click.option("--budget-s", default=480.0, show_default=True, type=float,
              help="No point starts after this many seconds.")
@click.option("--peak-flops", type=float,
              help="FLOP/s the efficiency is taken against (default: the GPU's, "
                   "`roofline.gpu_rates`; the H200's measured 777e12).")  # fmt: skip
@click.option("--peak-bytes-per-s", type=float,
              help="Bytes/s the efficiency is taken against (default: the GPU's; the H200's "
                   "measured 4.26e12).")  # fmt: skip
@click.option("--commit", default=None, help="For the header (default: git rev-parse HEAD).")
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False),
              help="JSONL table, appended (default: calibration_<gpu>[_<flavor>].jsonl).")
def bench_calibrate(flavor, device, commit, out_path, **given):
    """Each part of one layer timed alone on one device at the layouts' shapes: the calibration
    table of the simulation (`k3batch.sim.calibration`)."""
    from click.core import ParameterSource

    from k3batch.actors.build import default_device
    from k3batch.bench.calibrate import CalibrateSpec, default_out, run_calibration

    ctx = click.get_current_context()  # the command as given, for the table's header
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    args = [f"{flags[k]} {','.join(map(str, v)) if isinstance(v, tuple) else v}"
            for k, v in ctx.params.items()
            if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE]  # fmt: skip
    device = device or default_device()
    try:
        spec = CalibrateSpec.for_device(device, flavor=flavor, **given).validate()
        points = run_calibration(spec, out_path := out_path or default_out(device, flavor),
                                 command=" ".join(["k3batch bench calibrate", *args]),
                                 commit=commit, log=click.echo)  # fmt: skip
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"{len(points)} points -> {out_path}")


@bench.command("mla-decode")
@click.option("--batch", default="64", show_default=True, callback=_int_list,
              help="Sequences; several, comma-separated (1,16,64): one run each, in one process.")
@click.option("--context-len", default="8192", show_default=True, callback=_int_list,
              help="Cached tokens per sequence: one for every --batch, or one per --batch.")
@click.option("--heads", default=96, show_default=True, type=int, help="Query heads (96: K3).")
@click.option("--page-size", default=64, show_default=True, type=int,
              help="Tokens per page (the engine's default: 16).")
@click.option("--sweep", is_flag=True, help="Time the launch configurations; report the best.")
@click.option("--save-tuned", is_flag=True, help=SAVE_TUNED_HELP)
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_mla_decode(batch, context_len, heads, page_size, sweep, save_tuned, json_path):
    """Paged MLA decode kernel: bandwidth on the latent bytes read vs the copy bandwidth."""
    from k3batch.bench.kernels import format_result, run_mla_decode_bench

    _check_save_tuned(sweep, save_tuned)
    if len(context_len) not in (1, len(batch)):
        raise click.UsageError(f"{len(context_len)} context lengths for {len(batch)} batches")
    for b, n in zip(batch, context_len * len(batch) if len(context_len) == 1 else context_len):
        r = run_mla_decode_bench(batch=b, context_len=n, heads=heads, page_size=page_size,
                                 sweep=sweep,
                                 on_row=lambda row: click.echo(json.dumps(row)))  # fmt: skip
        click.echo(format_result("mla-decode", r))
        _save_tuned("mla-decode", r, save_tuned)
        _append_jsonl(json_path, [r])


@bench.command("kda-decode")
@click.option("--batch", default="64", show_default=True, callback=_int_list,
              help="Sequences; several, comma-separated (1,16,64): one run each, in one process.")
@click.option("--heads", default=96, show_default=True, type=int, help="KDA heads (96: K3).")
@click.option("--sweep", is_flag=True, help="Time the launch configurations; report the best.")
@click.option("--save-tuned", is_flag=True, help=SAVE_TUNED_HELP)
@click.option("--fla/--no-fla", default=True, show_default=True,
              help="Also time fla's recurrent kernel (its first call may autotune).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_kda_decode(batch, heads, sweep, save_tuned, fla, json_path):
    """In-place KDA decode step: bandwidth on the fp32 states read and written vs the copy
    bandwidth (fla's recurrent kernel beside it)."""
    from k3batch.bench.kernels import format_result, run_kda_decode_bench

    _check_save_tuned(sweep, save_tuned)
    for b in batch:
        r = run_kda_decode_bench(batch=b, heads=heads, sweep=sweep, fla=fla,
                                 on_row=lambda row: click.echo(json.dumps(row)))  # fmt: skip
        click.echo(format_result("kda-decode", r))
        if fla:
            click.echo(f"kda-decode: fla     {r['fla']['ms']:.3f} ms, {r['fla']['tbps']:.2f} "
                       f"TB/s ({r['fla_fraction_of_copy']:.0%})")  # fmt: skip
        _save_tuned("kda-decode", r, save_tuned)
        _append_jsonl(json_path, [r])


@bench.command("kda-prefill")
@click.option("--tokens", default=8192, show_default=True, type=int, help="Packed tokens.")
@click.option("--seqs", default="1", show_default=True, callback=_int_list,
              help="Sequences sharing the tokens; several, comma-separated (1,8): one run each.")
@click.option("--heads", default=96, show_default=True, type=int, help="KDA heads (96: K3).")
@click.option("--sweep", is_flag=True, help="Time the launch configurations; report the best.")
@click.option("--save-tuned", is_flag=True, help=SAVE_TUNED_HELP)
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_kda_prefill(tokens, seqs, heads, sweep, save_tuned, json_path):
    """Our KDA prefill kernels (short conv, chunk recurrence) as the model calls them:
    bandwidth on the bytes each must move vs the copy bandwidth."""
    from k3batch.bench.kernels import format_result, run_kda_prefill_bench

    _check_save_tuned(sweep, save_tuned)
    for n in seqs:
        results = run_kda_prefill_bench(tokens=tokens, seqs=n, heads=heads, sweep=sweep,
                                        on_row=lambda row: click.echo(json.dumps(row)))  # fmt: skip
        for name, r in results.items():
            click.echo(format_result(name, r))
            _save_tuned(name, r, save_tuned)
            _append_jsonl(json_path, [{"kernel": name} | r])


@bench.command("mla-prefill")
@click.option("--seq-lens", default="8192", show_default=True, help="New tokens per sequence.")
@click.option("--cached-lens", default=None, help="Cached prefix per sequence (default 0).")
@click.option("--heads", default=96, show_default=True, type=int)
@click.option("--sweep", is_flag=True, help="Time the launch configurations; report the best.")
@click.option("--save-tuned", is_flag=True, help=SAVE_TUNED_HELP)
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_mla_prefill(seq_lens, cached_lens, heads, sweep, save_tuned, json_path):
    """MLA prefill flash kernel: useful TFLOP/s vs the bf16 GEMM peak."""
    from k3batch.bench.kernels import format_result, run_mla_prefill_bench

    _check_save_tuned(sweep, save_tuned)
    lens = [int(n) for n in seq_lens.split(",")]
    cached = [int(n) for n in cached_lens.split(",")] if cached_lens else None
    r = run_mla_prefill_bench(seq_lens=lens, cached_lens=cached, heads=heads, sweep=sweep,
                              on_row=lambda row: click.echo(json.dumps(row)))
    click.echo(format_result("mla-prefill", r))
    _save_tuned("mla-prefill", r, save_tuned)
    _append_jsonl(json_path, [r])
