"""`k3batch bench job`: the batch job end to end against the engine alone, same workload.

Writes a random-weight checkpoint of a flavor (MXFP4 experts for K3 flavors, bf16 for Kimi
Linear, as the official checkpoints store them, unless `experts` says otherwise: kimi-linear's
bf16 checkpoint is 98 GB, its MXFP4 one 29 GB) unless one is given, a Parquet file of N prompts
of random token ids (the `random` dataset of vLLM's and SGLang's offline benchmarks: fixed input
and output lengths, EOS ignored), runs `run_job` on it, then the same prompts through one engine
in this process (after the job has released its devices, warmed up first on two other prompts
of the same length: its warm-up is not timed). Prints rows/s, input and output tokens/s of the
job (over its wall time, and from start-up's end to the last row written: `stage_s["run"]`,
which leaves out the shutdown) and its output tokens/s as a fraction of the engine's.

Where each side's time went: the replica's `StepAccount` (its engine thread: steps by kind,
the decode batch, the host's time between steps, time with no rows, the slowest steps) and the
same account of the engine alone, plus each side's first step's delay into its window and its
last step's lead on the window's end (`job_engine`, `engine_steps`): first step + the steps'
seconds + between steps + no rows + tail = the window (one replica; the first and the tail on
the clocks of the driver's and the replica's hosts), so a gap between the two sides is in one
of these terms. The windows differ in one thing the accounts show: the engine alone's warm-up
(a generate on two prompts like the timed ones) is untimed, the job's replica has only
start-up's (the workspace prefill and its continuation chunks, the decode graphs' capture), so
a first use in the run that start-up did not cover (a kernel variant compiled or loaded, the
allocator growing, a library handle made on the replica's engine thread) is timed in the job
alone: it shows as slow early steps in the job's account and not in the engine's.

Device "sim" (or "sim:DECODE_MS,PREFILL_MS,ARENA_GIB"): no weights, the replica and the engine
alone on a GPU simulated on the wall clock (`bench.sim_device`: by default Kimi Linear on one
H100), so that the job's own overhead against the engine alone shows on a CPU.
"""

import gc
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from k3batch.actors.placement import freeze_start_up
from k3batch.actors.serve import StepAccount, account_line
from k3batch.engine.config import EngineConfig
from k3batch.engine.request import SamplingParams
from k3batch.driver.report import handoff_line


def write_random_prompts(path: Path, num_prompts: int, input_len: int, vocab: int,
                         seed: int = 0) -> list[list[int]]:  # fmt: skip
    """num_prompts rows {id, prompt_token_ids} of input_len token ids drawn uniformly from
    [1, vocab); returns the prompts."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(num_prompts, input_len), dtype=np.int64)
    table = pa.table({
        "id": pa.array([str(i) for i in range(num_prompts)]),
        "prompt_token_ids": pa.array(ids.tolist(), type=pa.list_(pa.int32())),
    })  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return ids.tolist()


def run_job_bench(flavor: str, work_dir, *, num_prompts: int, input_len: int,
                  output_len: int, device: str = "auto", model_dir=None, seed: int = 0,
                  num_replicas: int = 1, max_num_seqs: int = 0, layout: dict | None = None,
                  chunk_size: int | None = None, engine_alone: bool = True,
                  experts: str = "auto") -> dict:  # fmt: skip
    """The job and (engine_alone) the single engine on the same prompts; a row of numbers.
    layout: the replicas' pp, tp, dcp, disaggregate (default: one device each); chunk_size:
    the engine's prompt tokens per request per prefill step (default: EngineConfig's);
    experts: the routed experts of the checkpoint written (`init_checkpoint`'s argument; the
    replicas keep MXFP4 ones packed); device "sim[:...]": see the module doc (one device per
    replica)."""
    from k3batch.actors.build import build_engine, default_device
    from k3batch.bench.sim_device import SimDevice, SimReplica, sim_engine, write_sim_checkpoint
    from k3batch.driver.job import run_job
    from k3batch.driver.jobspec import InputSpec, JobSpec, OutputSpec, ReplicaSpec
    from k3batch.engine.runner import MAX_AUTO_SEQS
    from k3batch.model.config import K3Config
    from k3batch.model.weights import init_checkpoint

    work = Path(work_dir)
    sim = SimDevice.parse(device) if device.startswith("sim") else None
    dev = "cpu" if sim else default_device() if device == "auto" else device
    if model_dir is None and sim:
        model_dir = work / f"model-{flavor}-sim"
        write_sim_checkpoint(flavor, model_dir)
    elif model_dir is None:
        model_dir = work / (f"model-{flavor}" + ("" if experts == "auto" else f"-{experts}"))
        if not (model_dir / "config.json").exists():
            init_checkpoint(flavor, model_dir, seed, experts, device=dev)  # the model is freed
            if dev == "cuda":  # the job's replica needs the memory
                import torch

                torch.cuda.empty_cache()
    vocab = K3Config.from_hf(model_dir).vocab_size
    data = work / f"prompts-{num_prompts}x{input_len}.parquet"
    prompts = write_random_prompts(data, num_prompts, input_len, vocab, seed)
    sampling = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    chunk = {} if chunk_size is None else {"chunk_size": chunk_size}
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_seq_len=input_len + output_len + 1,
                          **chunk)  # fmt: skip
    out = work / f"out-{time.strftime('%Y%m%d-%H%M%S')}"
    # a simulated GPU's replica: the window a GPU replica gets (JobSpec.inflight_rows)
    window = {"max_inflight_rows": max(64, 2 * (max_num_seqs or MAX_AUTO_SEQS))} if sim else {}
    spec = JobSpec(model=str(model_dir), name="bench-job", input=InputSpec(path=str(data)),
                   output=OutputSpec(path=str(out)), sampling=sampling, engine=engine,
                   replicas=ReplicaSpec(num_replicas=num_replicas, device=dev, **window,
                                        **(layout or {})))  # fmt: skip
    replica = {"replica_cls": SimReplica, "replica_kw": {"sim": sim}} if sim else {}
    report = run_job(spec, **replica)
    if not report.is_complete:
        raise RuntimeError(f"the benchmark job left rows without output: {report.missing}")
    wall, startup = report.wall_s, report.stage_s["startup"]
    sizing = report.sizing[0] if report.sizing else {}
    row = {
        "flavor": flavor, "num_prompts": num_prompts, "input_len": input_len,
        "output_len": output_len, "device": device, "num_replicas": num_replicas,
        "chunk_size": engine.chunk_size,
        "max_num_seqs": sizing.get("max_num_seqs", max_num_seqs), "sizing": sizing,
        "job_wall_s": round(wall, 2),
        "job_startup_s": round(startup, 2),
        "job_rows_per_s": round(report.rows_written / wall, 2),
        "job_input_tokens_per_s": round(report.prompt_tokens / wall, 1),
        "job_output_tokens_per_s": round(report.output_tokens / wall, 1),
        "job_output_tokens_per_s_after_startup": round(
            report.output_tokens / max(report.stage_s["run"], 1e-9), 1),
        "output_tokens": report.output_tokens, "layout": layout or {},
    }  # fmt: skip
    if report.decode_groups:
        row["handoff"] = [handoff_line(d) for d in report.decode_groups]
    if report.engine_steps:  # the window: from start-up's end to the last row written
        up = report.started_at + startup
        row["job_engine"] = [placed(a, up, up + report.stage_s["run"])
                             for a in report.engine_steps]  # fmt: skip
    if engine_alone:
        if sim:
            eng, _ = sim_engine(model_dir, engine, sim)
        else:
            eng, _ = build_engine(str(model_dir), engine, device=dev)
        # warm-up (compile, autotune) on prompts of the same length that share no prefix with
        # the timed ones (the prefix cache would spare those their prefill)
        eng.generate([p[::-1] for p in prompts[:2]], sampling)
        engine_s, tokens, account = run_engine_alone(eng, prompts, sampling)
        row["engine_output_tokens_per_s"] = round(tokens / engine_s, 1)
        row["job_vs_engine"] = round(row["job_output_tokens_per_s_after_startup"]
                                     / row["engine_output_tokens_per_s"], 3)  # fmt: skip
        row["engine_steps"] = account
    return row


def run_engine_alone(engine, prompts: list[list[int]],
                     sampling: SamplingParams | list[SamplingParams]):  # fmt: skip
    """(seconds, output tokens, the steps' account placed in its window) of the prompts through
    the engine (one sampling, or one per prompt), stepped as `Engine.generate` steps it, each
    step counted as the replica counts its own, and with the objects made before it kept out
    of garbage collections as the replica keeps its start-up's (`freeze_start_up`; undone
    after, since this is the caller's process)."""
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    account = StepAccount.of(engine)
    freeze_start_up()
    try:
        t0, t0_unix = time.perf_counter(), time.time()
        for i, (ids, sp) in enumerate(zip(prompts, samplings)):
            engine.add_request(str(i), ids, sp)
        tokens = 0
        while engine.has_unfinished():
            start = time.perf_counter()
            finished = engine.step()
            account.engine_step(engine, start, time.perf_counter() - start, finished)
            tokens += sum(len(r.output_token_ids) for r in finished)
        seconds = time.perf_counter() - t0
    finally:
        gc.unfreeze()
    return seconds, tokens, placed(account.to_dict(), t0_unix, t0_unix + seconds)


def placed(account: dict, start: float, end: float) -> dict:
    """An account with its first step's delay after `start` and its last step's lead on `end`
    (Unix times: the timed window)."""
    first, last = account["first_step_at"], account["last_step_at"]
    return account | {"first_step_s": None if first is None else round(first - start, 3),
                      "tail_s": None if last is None else round(end - last, 3)}  # fmt: skip


def format_job_bench(row: dict) -> str:
    lines = [
        f"job: {row['num_prompts']} prompts x {row['input_len']} tokens -> {row['output_len']} "
        f"new tokens, {row['flavor']}, {row['num_replicas']} replica(s) {row['layout']}, "
        f"device {row['device']}",
        f"  wall {row['job_wall_s']:.1f} s (start-up {row['job_startup_s']:.1f} s), "
        f"{row['job_rows_per_s']:.2f} rows/s, input {row['job_input_tokens_per_s']:.0f} tok/s, "
        f"output {row['job_output_tokens_per_s']:.0f} tok/s "
        f"({row['job_output_tokens_per_s_after_startup']:.0f} after start-up)",
    ]
    if row.get("sizing"):
        from k3batch.driver.report import sizing_line

        lines.append(f"  replica sizing: {sizing_line(row['sizing'])}")
    lines += [f"  handoff: {h}" for h in row.get("handoff", [])]
    for i, a in enumerate(row.get("job_engine", [])):
        lines.append(f"  replica {i} engine: {account_text(a)}")
    if "engine_output_tokens_per_s" in row:
        lines.append(
            f"  engine alone: output {row['engine_output_tokens_per_s']:.0f} tok/s; job after "
            f"start-up / engine = {row['job_vs_engine']:.2f}"
        )
        lines.append(f"  engine alone's engine: {account_text(row['engine_steps'])}")
    return "\n".join(lines)


def account_text(a: dict) -> str:
    """A `placed` account in a line: where its first and last steps fell in the window, then
    `actors.serve.account_line`."""
    if a["first_step_s"] is None:
        return "no steps"
    return (f"first step {a['first_step_s']:.2f} s in, last {a['tail_s']:.2f} s before the "
            f"end; {account_line(a)}")  # fmt: skip
