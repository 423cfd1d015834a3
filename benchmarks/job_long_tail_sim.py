"""Long-tail output lengths through the job and the engine alone on a simulated GPU (`bench job
--device sim`'s: Kimi Linear on one H100 by default, `k3batch.bench.sim_device`): does the job
keep its replica as full as the engine alone keeps itself while a few long rows hold units open?

    python benchmarks/job_long_tail_sim.py [--num-prompts 1024] [--input-len 1024] \\
        [--min-out 16] [--max-out 512] [--batch-rows 256] [--device sim]

Row i asks for min(max_out, min_out + an exponential draw of mean (max_out - min_out) / 4)
new tokens (seed 0) through its `max_new_tokens` column, EOS ignored; the engine alone gets the
same prompts and lengths. Prints each side's output tok/s (the job's after start-up) and step
accounts (`actors.serve.StepAccount`): a job that starves its replica runs a smaller mean
decode batch and more steps with room and none waiting than the engine alone.
"""

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from k3batch.bench.job import account_text, placed, run_engine_alone
from k3batch.bench.sim_device import SimDevice, SimReplica, sim_engine, write_sim_checkpoint
from k3batch.driver.job import run_job
from k3batch.driver.jobspec import InputSpec, JobSpec, OutputSpec, ReplicaSpec
from k3batch.engine.config import EngineConfig
from k3batch.engine.request import SamplingParams
from k3batch.engine.runner import MAX_AUTO_SEQS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="kimi-linear")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--min-out", type=int, default=16)
    p.add_argument("--max-out", type=int, default=512)
    p.add_argument("--batch-rows", type=int, default=256)
    p.add_argument("--device", default="sim", help="sim[:DECODE_MS,PREFILL_MS,ARENA_GIB]")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="long-tail-"))
    model = work / "model"
    write_sim_checkpoint(a.flavor, model)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 100_000, size=(a.num_prompts, a.input_len)).tolist()
    draws = rng.exponential((a.max_out - a.min_out) / 4, size=a.num_prompts)
    outs = np.minimum(a.min_out + draws.astype(int), a.max_out).tolist()
    data = work / "prompts.parquet"
    pq.write_table(pa.table({"prompt_token_ids": pa.array(prompts, pa.list_(pa.int32())),
                             "max_new_tokens": outs}), data)  # fmt: skip
    sampling = SamplingParams(temperature=0, max_new_tokens=a.max_out, ignore_eos=True)
    engine = EngineConfig(max_seq_len=a.input_len + a.max_out + 1)
    sim = SimDevice.parse(a.device)
    spec = JobSpec(model=str(model), name="long-tail",
                   input=InputSpec(path=str(data), batch_rows=a.batch_rows),
                   output=OutputSpec(path=str(work / "out")), sampling=sampling, engine=engine,
                   replicas=ReplicaSpec(num_replicas=1, device="cpu",
                                        max_inflight_rows=2 * MAX_AUTO_SEQS))  # fmt: skip
    report = run_job(spec, replica_cls=SimReplica, replica_kw={"sim": sim})
    run_s = report.stage_s["run"]
    up = report.started_at + report.stage_s["startup"]
    job_tps = report.output_tokens / run_s
    print(f"{a.num_prompts} prompts x {a.input_len} -> {a.min_out}..{a.max_out} tokens "
          f"(mean {np.mean(outs):.0f}), {a.device}, batch_rows {a.batch_rows}")  # fmt: skip
    print(f"job: {job_tps:.0f} output tok/s after start-up, {report.peak_open_units} units open "
          f"at most; {account_text(placed(report.engine_steps[0], up, up + run_s))}")
    eng, _ = sim_engine(model, engine, sim)
    samplings = [dataclasses.replace(sampling, max_new_tokens=n) for n in outs]
    seconds, tokens, account = run_engine_alone(eng, prompts, samplings)
    print(f"engine alone: {tokens / seconds:.0f} output tok/s; job / engine = "
          f"{job_tps / (tokens / seconds):.3f}; {account_text(account)}")
    print(f"({time.strftime('%Y-%m-%d')}, work dir {work})")


if __name__ == "__main__":
    main()
