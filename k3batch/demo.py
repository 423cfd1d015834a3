"""`make demo`: a tiny random-weight K3 checkpoint, a sample Parquet file of prompts, and a real
batch job over it on a local Ray (`jobs/debug_cpu.toml`). Prints where the output and the
report are. The weights are random, so the generated text is noise; the job is real."""

import shutil
import sys
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq

from k3batch.driver import run_job
from k3batch.driver.jobspec import load_job_spec
from k3batch.model.weights import init_checkpoint

PROMPTS = [
    "Hello, K3.",
    "Write a haiku about linear attention.",
    "What is 2 + 2?",
    "Summarize the plot of Hamlet in one sentence.",
    "Translate 'good morning' to French.",
    "List three prime numbers.",
    None,
    "",  # two bad rows: they get an error, the job goes on
]


def main(job_file: str = "jobs/debug_cpu.toml") -> int:
    spec = load_job_spec(job_file)
    model_dir = Path(spec.model)
    if not (model_dir / "config.json").exists():
        init_checkpoint("k3-debug", model_dir, seed=0)
        click.echo(f"wrote a random-weight k3-debug checkpoint to {model_dir}")
    Path(spec.input.path).parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"prompt": PROMPTS, "topic": [f"t{i}" for i in range(len(PROMPTS))]})
    pq.write_table(table, spec.input.path)
    shutil.rmtree(spec.output.path, ignore_errors=True)  # a fresh run each time
    report = run_job(spec)
    click.echo(report.summary())
    first = pq.read_table(spec.output.path).slice(0, 1).to_pylist()[0]
    click.echo(f"first row: {first}")
    click.echo(f"output: {spec.output.path}/\nreport: {spec.output.path}/_k3batch_report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
