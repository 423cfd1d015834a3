"""The `k3batch` command line. Each command parses flags, builds typed config and calls one
library function."""

import json

import click

from k3batch.cli_jobs import register as register_job_commands


@click.group()
def main():
    """k3batch: batch inference for the Kimi K3 model family on Ray."""


@main.command("init-checkpoint")
@click.option(
    "--flavor",
    default="k3-debug",
    show_default=True,
    help="Named config (k3-debug, k3-slice, kimi-linear-debug, ...).",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--experts", type=click.Choice(["auto", "mxfp4", "bf16"]), default="auto",
              show_default=True,
              help="Routed experts as stored: auto is MXFP4 for K3 flavors, bf16 for Kimi Linear.")
@click.argument("out", type=click.Path(file_okay=False))
def init_checkpoint_cmd(flavor, seed, experts, out):
    """Write a random-weight checkpoint in the official Hugging Face layout to OUT."""
    from k3batch.model.weights import init_checkpoint

    try:
        init_checkpoint(flavor, out, seed, experts)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {flavor} checkpoint (seed {seed}) to {out}")


@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--prompt", "prompts", multiple=True, required=True, help="Repeat for several prompts."
)
@click.option(
    "--chat/--no-chat",
    default=False,
    help="Wrap each prompt as a user message in the chat template.",
)
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--seed", default=None, type=int)
@click.option("--ignore-eos", is_flag=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
def generate(
    model_dir, prompts, chat, max_new_tokens, temperature, top_p, top_k, seed, ignore_eos, device
):
    """Generate from PROMPTs on one device and print the completions."""
    from k3batch.engine.request import SamplingParams
    from k3batch.generate import generate_text

    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
        ).validate()
        outputs = generate_text(model_dir, list(prompts), sampling, chat=chat, device=device)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    for prompt, (text, res) in zip(prompts, outputs):
        click.echo(f"--- {prompt!r} -> [{res.finish_reason}, {len(res.output_token_ids)} tokens]")
        click.echo(text)


def replica_count(text: str):
    """--replicas: "4" (fixed) or "1-4" (elastic, min-max)."""
    from k3batch.jobspec import ReplicaRange

    low, sep, high = str(text).partition("-")
    try:
        return ReplicaRange(min=int(low), max=int(high)) if sep else int(low)
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected N or MIN-MAX, e.g. 4 or 1-4") from None


_RUN_FLAGS = [
    # (flag, dotted field, type, help)
    ("--model", "model", str, "Checkpoint directory (official HF layout)."),
    ("--input", "input.path", str, "Parquet file, directory, glob or URI."),
    ("--output", "output.path", str, "Output directory or URI."),
    ("--name", "name", str, "Job name (report, logs)."),
    ("--address", "address", str, "Ray cluster to join; default: start a local Ray."),
    ("--batch-rows", "input.batch_rows", int, "Rows per unit of work and output shard."),
    ("--max-new-tokens", "sampling.max_new_tokens", int, None),
    ("--temperature", "sampling.temperature", float, None),
    ("--top-p", "sampling.top_p", float, None),
    ("--top-k", "sampling.top_k", int, None),
    ("--seed", "sampling.seed", int, None),
    ("--replicas", "replicas.num_replicas", replica_count, "Replicas: N, or MIN-MAX (elastic)."),
    ("--pp", "replicas.pp", int, "Pipeline-parallel prefill stages per replica."),
    ("--tp", "replicas.tp", int, "Tensor-parallel decode ranks per replica."),
    ("--dcp", "replicas.dcp", int, "Decode context parallelism for the MLA latent."),
    ("--device", "replicas.device", str, "auto, cpu or cuda."),
    ("--accelerator-type", "replicas.accelerator_type", str, "e.g. H200."),
    ("--max-inflight-rows", "replicas.max_inflight_rows", int, "Rows in flight per replica."),
    ("--max-num-seqs", "engine.max_num_seqs", int, "Requests decoded together per replica."),
    ("--max-seq-len", "engine.max_seq_len", int, "Prompt + output tokens per request."),
    ("--chunk-size", "engine.chunk_size", int, "Prompt tokens per request per prefill step."),
    ("--page-size", "engine.page_size", int, "Tokens per MLA page."),
    ("--memory-pool", "engine.memory_pool", click.Choice(["unified", "static"]), None),
    ("--memory-fraction", "engine.memory_fraction", float, "Of each GPU, weights + cache."),
]


def _run_options(fn):
    for flag, field, typ, help_ in reversed(_RUN_FLAGS):
        dest = field.replace(".", "__")
        fn = click.option(flag, dest, type=typ, default=None, help=help_)(fn)
    for flag, field in (
        ("--logprobs/--no-logprobs", "output__logprobs"),
        ("--ignore-eos/--no-ignore-eos", "sampling__ignore_eos"),
        ("--prefix-cache/--no-prefix-cache", "engine__prefix_cache"),
    ):
        fn = click.option(flag, field, default=None)(fn)
    return fn


@main.command()
@click.argument("job", required=False, type=click.Path(dir_okay=False))
@_run_options
def run(job, **flags):
    """Run the batch job JOB (a .toml or .yaml spec); flags override its fields."""
    from k3batch.driver import run_job
    from k3batch.jobspec import JobSpec, load_job_spec, with_overrides

    try:
        spec = load_job_spec(job) if job else JobSpec()
        spec = with_overrides(spec, {k.replace("__", "."): v for k, v in flags.items()})
        report = run_job(spec)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(report.summary())
    click.echo(f"output: {spec.output.path}\nreport: {spec.output.path}/_k3batch_report.json")
    if report.unreadable_inputs or not report.is_complete:
        raise SystemExit(2)


# The job fields an eval takes from flags (its input and sampling are its own).
_EVAL_SECTIONS = ("model", "name", "address", "output.path", "input.batch_rows", "replicas",
                  "engine")  # fmt: skip


def _eval_options(fn):
    for flag, field, typ, help_ in reversed(_RUN_FLAGS):
        if field.startswith(_EVAL_SECTIONS):
            dest = field.replace(".", "__")
            fn = click.option(flag, dest, type=typ, default=None, help=help_)(fn)
    flag = "--prefix-cache/--no-prefix-cache"
    return click.option(flag, "engine__prefix_cache", default=None)(fn)


@main.command("eval")
@click.argument("suite", required=False, type=click.Path(dir_okay=False))
@click.option("--lm-eval", "lm_eval_tasks", default=None,
              help="Comma-separated lm-eval tasks from its registry (pip install k3batch[eval]).")
@click.option("--include-path", default=None, help="With --lm-eval: a folder of task YAMLs.")
@click.option("--num-fewshot", type=int, default=None, help="With --lm-eval.")
@click.option("--limit", type=int, default=None, help="The first LIMIT items of each task.")
@click.option("--seed", type=int, default=None, help="Sampling seed (default: the suite's).")
@click.option("--job", "job_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A job spec: its model, address, [replicas] and [engine] are used.")
@_eval_options
def eval_cmd(suite, lm_eval_tasks, include_path, num_fewshot, limit, seed, job_file, **flags):
    """Evaluate a model on SUITE (a task YAML, see evals/) or on lm-eval tasks, as a batch job:
    results.json and per-item records under --output; a rerun resumes."""
    from k3batch.jobspec import JobSpec, load_job_spec, with_overrides

    if (suite is None) == (lm_eval_tasks is None):
        raise click.UsageError("give a SUITE file or --lm-eval TASKS")
    try:
        spec = load_job_spec(job_file) if job_file else JobSpec(name="k3batch-eval")
        spec = with_overrides(spec, {k.replace("__", "."): v for k, v in flags.items()})
        if not spec.output.path:
            raise ValueError("output.path: no output given (--output)")
        if suite is None:
            from k3batch.eval.harness import run_lm_eval, write_lm_eval_results

            tasks = [t for t in lm_eval_tasks.split(",") if t]
            results = run_lm_eval(tasks, spec, include_path=include_path,
                                  num_fewshot=num_fewshot, limit=limit, seed=seed or 0)  # fmt: skip
            click.echo(write_lm_eval_results(results, spec.output.path))
            return
        from k3batch.eval import load_suite, run_eval

        result = run_eval(load_suite(suite, limit=limit, seed=seed), spec)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(result.summary())
    click.echo(f"results: {spec.output.path}/results.json")
    if not result.report.is_complete:
        raise SystemExit(2)


@main.group()
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
    from k3batch.bench import format_fill_table, run_pipeline_bench

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


@bench.command("engine")
@click.option("--flavor", default="k3-debug", show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--batch", default=8, show_default=True, type=int)
@click.option("--prompt-len", default=512, show_default=True, type=int)
@click.option("--new-tokens", default=32, show_default=True, type=int)
@click.option("--chunk-size", default=2048, show_default=True, type=int)
@click.option("--profile", is_flag=True, help="Also print the top ops of prefill and decode.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True)
@click.option("--expert-dtype", type=click.Choice(["bf16", "mxfp4"]), default="bf16",
              show_default=True, help="Routed experts in memory (mxfp4: packed, W4A16).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_engine(flavor, device, batch, prompt_len, new_tokens, chunk_size, profile, cuda_graphs,
                 expert_dtype, json_path):  # fmt: skip
    """Single-device engine throughput, prefill MFU and peak memory on random weights."""
    from k3batch.actors.build import default_device
    from k3batch.bench import engine_throughput, format_profile

    row = engine_throughput(
        flavor,
        device=device or default_device(),
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        chunk_size=chunk_size,
        profile=profile,
        cuda_graphs=cuda_graphs,
        expert_dtype=expert_dtype,
    )
    if profile:
        from k3batch.bench import PROFILED_DECODE_STEPS

        click.echo(format_profile(row["profile"]))
        click.echo(format_profile(row["decode_profile"], f"{PROFILED_DECODE_STEPS} decode steps"))
    click.echo(json.dumps({k: v for k, v in row.items() if "profile" not in k}))
    click.echo(
        f"decode step {row['decode_step_ms']} ms; roofline {row['decode_floor_ms']} ms "
        f"({row['decode_roofline_x']}x) = {row['decode_bytes']} bytes at 4.26 TB/s"
    )
    _append_jsonl(json_path, [row])


@bench.command("moe")
@click.option("--flavor", default="k3-slice", show_default=True)
@click.option("--tokens", default=8192, show_default=True, type=int)
@click.option("--layers", default=None, type=int, help="MoE layers (default: all of the flavor).")
@click.option("--repeats", default=10, show_default=True, type=int)
@click.option("--expert-dtype", type=click.Choice(["bf16", "mxfp4"]), default="bf16",
              show_default=True, help="mxfp4: also the packed experts through the W4A16 kernel.")
@click.option("--sweep", is_flag=True,
              help="Also time the Triton GEMM of this format over launch configs.")
@click.option("--save-tuned", is_flag=True,
              help="With --sweep: write the fastest into this GPU's tuned table.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_moe(flavor, tokens, layers, repeats, expert_dtype, sweep, save_tuned, json_path):
    """Routed experts alone (CUDA): TFLOP/s, % of the bf16 GEMM peak, TB/s on expert bytes."""
    from k3batch.bench_moe import format_moe_table, moe_throughput, save_best
    from k3batch.model import get_flavor

    try:
        rows = moe_throughput(flavor, num_tokens=tokens, num_layers=layers, repeats=repeats,
                              expert_dtype=expert_dtype, sweep=sweep)  # fmt: skip
        click.echo(format_moe_table(rows))
        if sweep and save_tuned:
            experts = get_flavor(flavor).num_experts
            cfg = save_best(rows, expert_dtype, tokens, experts)
            click.echo(f"tuned table <- {expert_dtype} at {tokens} tokens: {cfg}")
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    _append_jsonl(json_path, rows)


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
@click.option("--max-num-seqs", default=64, show_default=True, type=int)
@click.option("--no-engine", is_flag=True, help="Skip the engine-alone run.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_job(flavor, model_dir, work_dir, num_prompts, input_len, output_len, device,
              num_replicas, max_num_seqs, no_engine, json_path):  # fmt: skip
    """The batch job on random-token prompts: rows/s, tokens/s, and against the engine alone."""
    from k3batch.bench_job import format_job_bench, run_job_bench

    row = run_job_bench(flavor, work_dir, num_prompts=num_prompts, input_len=input_len,
                        output_len=output_len, device=device, model_dir=model_dir,
                        num_replicas=num_replicas, max_num_seqs=max_num_seqs,
                        engine_alone=not no_engine)  # fmt: skip
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
    from k3batch.bench_layouts import LayoutBench, run_layout_bench

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
    from k3batch.bench_layouts import comm_bytes_per_1k, projected_comm_ms_per_1k
    from k3batch.model import get_flavor

    config = get_flavor(flavor)
    vol = comm_bytes_per_1k(config, gpus)
    ms = projected_comm_ms_per_1k(config, gpus, p2p_gbps=p2p_gbps, busbw_gbps=busbw_gbps)
    click.echo(f"{flavor}, {gpus} devices, bf16 activations, per 1K prompt tokens:")
    click.echo(f"  tp{gpus}: {vol['tp'] / 1e6:,.1f} MB per rank ({vol['tp_all_reduces']} all-reduces)"
               f" -> {ms['tp']:.2f} ms at {busbw_gbps:g} GB/s bus bandwidth")  # fmt: skip
    click.echo(f"  pp{gpus}: {vol['pp'] / 1e6:,.1f} MB at the widest stage boundary"
               f" -> {ms['pp']:.2f} ms at {p2p_gbps:g} GB/s point to point")  # fmt: skip


@bench.command("mla-decode")
@click.option("--batch", default=64, show_default=True, type=int)
@click.option("--context-len", default=8192, show_default=True, type=int)
@click.option("--heads", default=96, show_default=True, type=int, help="Query heads (96: K3).")
@click.option("--page-size", default=64, show_default=True, type=int)
@click.option("--sweep", is_flag=True, help="Time the launch configurations; report the best.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_mla_decode(batch, context_len, heads, page_size, sweep, json_path):
    """Paged MLA decode kernel: bandwidth on the latent bytes read vs the copy bandwidth."""
    from k3batch.bench_kernels import format_result, run_mla_decode_bench

    r = run_mla_decode_bench(batch=batch, context_len=context_len, heads=heads,
                             page_size=page_size, sweep=sweep,
                             on_row=lambda row: click.echo(json.dumps(row)))  # fmt: skip
    click.echo(format_result("mla-decode", r))
    _append_jsonl(json_path, [r])


@bench.command("kda-decode")
@click.option("--batch", default=64, show_default=True, type=int)
@click.option("--heads", default=96, show_default=True, type=int, help="KDA heads (96: K3).")
@click.option("--sweep", is_flag=True, help="Time the launch configurations; report the best.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_kda_decode(batch, heads, sweep, json_path):
    """In-place KDA decode step: bandwidth on the fp32 states read and written vs the copy
    bandwidth (fla's recurrent kernel beside it)."""
    from k3batch.bench_kernels import format_result, run_kda_decode_bench

    r = run_kda_decode_bench(batch=batch, heads=heads, sweep=sweep,
                             on_row=lambda row: click.echo(json.dumps(row)))  # fmt: skip
    click.echo(format_result("kda-decode", r))
    click.echo(f"kda-decode: fla     {r['fla']['ms']:.3f} ms, {r['fla']['tbps']:.2f} TB/s "
               f"({r['fla_fraction_of_copy']:.0%})")  # fmt: skip
    _append_jsonl(json_path, [r])


@bench.command("mla-prefill")
@click.option("--seq-lens", default="8192", show_default=True, help="New tokens per sequence.")
@click.option("--cached-lens", default=None, help="Cached prefix per sequence (default 0).")
@click.option("--heads", default=96, show_default=True, type=int)
@click.option("--sweep", is_flag=True, help="Time the launch configurations; report the best.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def bench_mla_prefill(seq_lens, cached_lens, heads, sweep, json_path):
    """MLA prefill flash kernel: useful TFLOP/s vs the bf16 GEMM peak."""
    from k3batch.bench_kernels import format_result, run_mla_prefill_bench

    lens = [int(n) for n in seq_lens.split(",")]
    cached = [int(n) for n in cached_lens.split(",")] if cached_lens else None
    r = run_mla_prefill_bench(seq_lens=lens, cached_lens=cached, heads=heads, sweep=sweep,
                              on_row=lambda row: click.echo(json.dumps(row)))
    click.echo(format_result("mla-prefill", r))
    _append_jsonl(json_path, [r])


@main.command("plan")
@click.option("--flavor", default="k3", show_default=True, help="Named config (k3: MXFP4 experts).")
@click.option("--model", "model_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Checkpoint directory: plan its config.json instead of --flavor.")  # fmt: skip
@click.option("--gpu", default="h200", show_default=True, help="h200, h100, b200 or gb300.")
@click.option("--pp", default=None, type=int, help="Prefill pipeline stages (default 1).")
@click.option("--tp", default=None, type=int, help="Decode tensor parallelism (default 8).")
@click.option("--dcp", default=None, type=int, help="Decode context parallelism (default 1).")
@click.option("--requests", "min_requests", default=None, type=int,
              help="Search only: requests of --context-len one decode group must hold "
                   "(default 32).")  # fmt: skip
@click.option("--memory-fraction", default=0.9, show_default=True, type=float)
@click.option("--page-size", default=64, show_default=True, type=int, help="Tokens per MLA page.")
@click.option("--context-len", default=None, type=int,
              help="Tokens per request (default: 1048576 for one layout, 131072 for the "
                   "search).")  # fmt: skip
@click.option("--cache-gib", default=None, type=float,
              help="One layout only: cache pool per GPU (default: what is left).")  # fmt: skip
@click.option("--reserve-gib", default=4.0, show_default=True, type=float, help="Activations.")
def plan_cmd(flavor, model_dir, gpu, pp, tp, dcp, min_requests, memory_fraction, page_size,
             context_len, cache_gib, reserve_gib):  # fmt: skip
    """Print weights and cache bytes per GPU and the context capacity of a layout.

    With --pp, --tp or --dcp: that layout (the others at their defaults). With none of them:
    search for the layout of the fewest GPUs per replica that holds the weights plus --requests
    requests of --context-len tokens per decode group; print every layout tried with why it
    does not fit (which side, GB over), then the chosen layout's plan."""
    from k3batch.model.config import K3Config
    from k3batch.plan import (
        DEFAULT_MIN_REQUESTS,
        DEFAULT_SEARCH_CONTEXT,
        GiB,
        checkpoint_config,
        make_plan,
        smallest_layout,
    )

    search = pp is None and tp is None and dcp is None
    if search and cache_gib is not None:
        raise click.UsageError(
            "--cache-gib needs a layout (--pp/--tp/--dcp): the search sizes the cache from "
            "memory (--memory-fraction, --reserve-gib)"
        )
    if not search and min_requests is not None:
        raise click.UsageError(
            "--requests sets the search's workload: drop --pp/--tp/--dcp to search, or drop "
            "--requests"
        )
    if min_requests is not None and min_requests < 1:
        raise click.UsageError(f"--requests = {min_requests} must be >= 1")
    or_default = lambda value, default: default if value is None else value  # noqa: E731
    kw = {"name": model_dir or flavor, "gpu": gpu, "memory_fraction": memory_fraction,
          "page_size": page_size, "reserve_bytes": int(reserve_gib * GiB)}  # fmt: skip
    try:
        config = K3Config.from_hf(model_dir) if model_dir else checkpoint_config(flavor)
        if search:
            found = smallest_layout(
                config, **kw, min_requests=or_default(min_requests, DEFAULT_MIN_REQUESTS),
                context_len=or_default(context_len, DEFAULT_SEARCH_CONTEXT),
            )  # fmt: skip
        else:
            plan = make_plan(
                config, **kw, pp_size=or_default(pp, 1), tp_size=or_default(tp, 8),
                dcp_size=or_default(dcp, 1), context_len=or_default(context_len, 1 << 20),
                cache_bytes=None if cache_gib is None else int(cache_gib * GiB),
            )  # fmt: skip
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if not search:
        click.echo(str(plan))
        return
    click.echo(str(found))
    if found.chosen is None:
        raise click.ClickException("no layout fits: see the table above")


register_job_commands(main)

if __name__ == "__main__":
    main()
