"""The `k3batch` command line. Each command parses flags, builds typed config and calls one
library function."""

from pathlib import Path

import click

from k3batch.bench.cli import bench
from k3batch.cli.jobs import register as register_job_commands


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
    from k3batch.driver.jobspec import ReplicaRange

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
    ("--max-inflight-rows", "replicas.max_inflight_rows", int,
     "Rows in flight per replica (0: twice max_num_seqs)."),
    ("--max-num-seqs", "engine.max_num_seqs", int,
     "Requests run together per replica (0: sized by the engine)."),
    ("--max-seq-len", "engine.max_seq_len", int, "Prompt + output tokens per request."),
    ("--chunk-size", "engine.chunk_size", int, "Prompt tokens per request per prefill step."),
    ("--page-size", "engine.page_size", int, "Tokens per MLA page."),
    ("--memory-pool", "engine.memory_pool", click.Choice(["unified", "static"]), None),
    ("--memory-fraction", "engine.memory_fraction", float,
     "Of each GPU: weights, workspace, cache (0: 0.9)."),
]


def _run_options(fn):
    for flag, field, typ, help_ in reversed(_RUN_FLAGS):
        dest = field.replace(".", "__")
        fn = click.option(flag, dest, type=typ, default=None, help=help_)(fn)
    for flag, field in (
        ("--logprobs/--no-logprobs", "output__logprobs"),
        ("--ignore-eos/--no-ignore-eos", "sampling__ignore_eos"),
        ("--prefix-cache/--no-prefix-cache", "engine__prefix_cache"),
        ("--metrics/--no-metrics", "metrics"),
    ):
        fn = click.option(flag, field, default=None)(fn)
    return fn


@main.command()
@click.argument("job", required=False, type=click.Path(dir_okay=False))
@_run_options
def run(job, **flags):
    """Run the batch job JOB (a .toml or .yaml spec); flags override its fields."""
    from k3batch.driver import run_job
    from k3batch.driver.health import CrashLoopError
    from k3batch.driver.jobspec import JobSpec, load_job_spec, with_overrides

    try:
        spec = load_job_spec(job) if job else JobSpec()
        spec = with_overrides(spec, {k.replace("__", "."): v for k, v in flags.items()})
        report = run_job(spec)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except CrashLoopError as e:  # exit 1 with the replica's cause; a rerun resumes
        raise click.ClickException(
            f"{e}\nreport: {spec.output.path}/_k3batch_report.json (committed rows are kept: "
            "fix the cause and rerun to resume)"
        ) from None
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
    from k3batch.driver.jobspec import JobSpec, load_job_spec, with_overrides

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
@click.option("--experts", type=click.Choice(["auto", "bf16", "mxfp4"]), default="auto",
              show_default=True,
              help="Routed experts in memory: auto as the checkpoint stores them (k3 MXFP4, "
                   "Kimi Linear bf16); mxfp4 as `init-checkpoint --experts mxfp4` keeps them.")
@click.option("--estimate", is_flag=True,
              help="Estimate a job on a cluster: every layout that fits (or the one of --pp/--tp/"
                   "--dcp) run on a simulated clock; see docs/planning.md.")  # fmt: skip
@click.option("--cluster", default=None,
              help="--estimate: a preset (h200x8, h200x8x4, gb300x4x2, gb300-nvl72) or a TOML/JSON "
                   "file (default: one node of --gpu).")  # fmt: skip
@click.option("--nodes", default=None, type=int, help="--estimate: nodes of the cluster.")
@click.option("--job", "job_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="--estimate: a job spec; its input files' prompts (tokenized as the job does), "
                   "sampling and engine settings are the workload.")  # fmt: skip
@click.option("--num-prompts", default=1_000_000, show_default=True, type=int,
              help="--estimate without --job.")
@click.option("--input-len", default=8192, show_default=True, type=int,
              help="--estimate without --job: prompt tokens.")  # fmt: skip
@click.option("--output-len", default=1024, show_default=True, type=int,
              help="--estimate without --job: new tokens.")  # fmt: skip
@click.option("--max-num-seqs", default=0, type=int,
              help="--estimate without --job: the engine's (0: as the engine sizes it).")
@click.option("--chunk-size", default=None, type=int,
              help="--estimate without --job: the engine's (default 8192).")  # fmt: skip
@click.option("--calibration", default=None, type=click.Path(exists=True, dir_okay=False),
              help="--estimate: the calibration table (default: the recorded one, "
              "benchmarks/calibration_h200.jsonl, else _h100).")  # fmt: skip
def plan_cmd(flavor, model_dir, gpu, pp, tp, dcp, min_requests, memory_fraction, page_size,
             context_len, cache_gib, reserve_gib, experts, estimate, cluster, nodes, job_path,
             num_prompts, input_len, output_len, max_num_seqs, chunk_size,
             calibration):  # fmt: skip
    """Print weights and cache bytes per GPU and the context capacity of a layout.

    With --pp, --tp or --dcp: that layout (the others at their defaults; --tp 1 alone is one
    GPU, a single-device engine: kimi-linear on an H200, or an H100 with --experts mxfp4).
    With none of them: search for the layout of the fewest GPUs per replica that holds the
    weights plus --requests requests of --context-len tokens per decode group; print every
    layout tried with why it does not fit (which side, GB over), then the chosen layout's plan."""
    from k3batch.model.config import K3Config
    from k3batch.parallel.plan import GiB, checkpoint_config, make_plan, with_experts
    from k3batch.parallel.search import (
        DEFAULT_MIN_REQUESTS,
        DEFAULT_SEARCH_CONTEXT,
        smallest_layout,
    )

    if estimate:
        _estimate(flavor=flavor, model_dir=model_dir, gpu=gpu, pp=pp, tp=tp, dcp=dcp,
                  memory_fraction=memory_fraction, reserve_gib=reserve_gib, experts=experts,
                  cluster=cluster, nodes=nodes, job_path=job_path, num_prompts=num_prompts,
                  input_len=input_len, output_len=output_len, max_num_seqs=max_num_seqs,
                  chunk_size=chunk_size, calibration=calibration)  # fmt: skip
        return
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
        config = with_experts(config, experts)
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


def _estimate(*, flavor, model_dir, gpu, pp, tp, dcp, memory_fraction, reserve_gib, experts,
              cluster, nodes, job_path, num_prompts, input_len, output_len, max_num_seqs,
              chunk_size, calibration) -> None:  # fmt: skip
    """`plan --estimate`: see `k3batch.sim.estimate`."""
    from k3batch.engine.config import EngineConfig
    from k3batch.model.config import K3Config
    from k3batch.parallel.plan import GiB, checkpoint_config, with_experts
    from k3batch.sim.calibration import Calibration
    from k3batch.sim.cluster import cluster_from
    from k3batch.sim.estimate import DEFAULT_TABLE, estimate_job
    from k3batch.sim.workload import Workload, workload_from_job

    try:
        spec_cluster = cluster or f"{gpu}x{8 if gpu != 'gb300' else 4}"
        where = cluster_from(spec_cluster, nodes=nodes)
        if job_path:
            from k3batch.driver.jobspec import load_job_spec

            job = load_job_spec(job_path)
            workload = workload_from_job(job)
            engine_config, model_dir = job.engine, model_dir or job.model
        else:
            workload = Workload.fixed(num_prompts, input_len, output_len)
            engine_config = EngineConfig(max_num_seqs=max_num_seqs, chunk_size=chunk_size or 8192)
        config = K3Config.from_hf(model_dir) if model_dir else checkpoint_config(flavor)
        config = with_experts(config, experts)
        table = calibration or DEFAULT_TABLE
        if not Path(table).exists():
            raise ValueError(f"no calibration table at {table}: give --calibration (a table "
                             "written by `k3batch bench calibrate`)")  # fmt: skip
        layouts = None
        if pp is not None or tp is not None or dcp is not None:
            layouts = [(pp or 1, tp or 8, dcp or 1)]
        result = estimate_job(config, model_dir or flavor, where, workload,
                              calibration=Calibration.load(table), engine_config=engine_config,
                              layouts=layouts, memory_fraction=memory_fraction,
                              reserve_bytes=int(reserve_gib * GiB))  # fmt: skip
    except (ValueError, KeyError) as e:
        raise click.UsageError(str(e)) from None
    click.echo(str(result))
    if result.best is None:
        raise click.ClickException(f"{result.no_estimate()}: see the table above")


main.add_command(bench)
register_job_commands(main)
