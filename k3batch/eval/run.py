"""`run_eval(suite, job)`: a suite as one batch job, then the scoring pass.

Layout of the eval's output directory (`job.output.path`):
    requests.parquet   the job's input: one row per engine request (`requests.py`), written
                       once; a rerun must build the same table (else it is refused)
    records/           the job's output: exactly-once shards with each row's prompt
                       log-probabilities, greedy flags and completions (`k3batch run`)
    items.jsonl        one record per item: the scored token ids, each choice's
                       log-likelihood and greedy flag, completions and answers, errors
    results.json       per task: each metric's value and standard error, items, errors
                       (and, for a task with group_by, the same per group)

The job is `k3batch run`'s (same driver: resume, row errors, progress, report), so killing an
eval at any point and running it again redoes only the unfinished shards, and scoring, a pure
function of the committed rows, writes the same `results.json`. `run_requests` is the part the
lm-eval backend shares: a table of requests in, the output rows back in request order.
"""

import dataclasses
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from k3batch.driver import run_job
from k3batch.engine.request import SamplingParams
from k3batch.eval.requests import build_requests
from k3batch.eval.score import format_table, score
from k3batch.eval.suite import SuiteSpec
from k3batch.driver.jobspec import InputSpec, JobSpec, OutputSpec
from k3batch.driver.report import JobReport, cache_line
from k3batch.tokenizer import Tokenizer

log = logging.getLogger(__name__)

RESULTS_NAME = "results.json"
ITEMS_NAME = "items.jsonl"


@dataclasses.dataclass
class EvalResult:
    results: dict  # what results.json holds
    records: list[dict]  # what items.jsonl holds, one per item
    report: JobReport  # the batch job's report (this run's part: resumed rows are not in it)

    def summary(self) -> str:
        lines = [format_table(self.results)]
        lines += [f"replica {i} cache: {cache_line(c)}" for i, c in enumerate(self.report.cache)]
        return "\n".join(lines)


def run_eval(suite: SuiteSpec, job: JobSpec, *, progress_stream=None) -> EvalResult:
    """Run every task of `suite` with the model, resources and engine settings of `job`
    (its input and sampling are the eval's own); write results and records under
    job.output.path; ValueError for a bad suite or job before anything starts."""
    out = Path(job.output.path)
    if not job.model or not (Path(job.model) / "config.json").is_file():
        raise ValueError(f"model: {job.model!r} has no config.json")
    table = build_requests(suite, Tokenizer.from_dir(job.model), job.engine.max_seq_len)
    rows, report = run_requests(table, out, job, progress_stream=progress_stream)
    num_items = {t.name: 0 for t in suite.tasks}
    groups = {t.name: {} for t in suite.tasks if t.group_by is not None}  # item -> its group
    columns = (table.column(c).to_pylist() for c in ("task", "item", "group"))
    for task, item, group in zip(*columns):
        num_items[task] = max(num_items[task], item + 1)
        if task in groups:
            groups[task][item] = group
    results, records = score(suite, [r for r in rows if r is not None], num_items, groups)
    results["model"] = job.model
    results["complete"] = report.is_complete
    _write_atomic(out / ITEMS_NAME, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    _write_atomic(out / RESULTS_NAME, json.dumps(results, indent=1, sort_keys=True) + "\n")
    return EvalResult(results, records, report)


def run_requests(table: pa.Table, out: Path, job: JobSpec, *, progress_stream=None):
    """Run the request rows of `table` (schema of `requests.SCHEMA`, at least id and
    prompt_token_ids) as a batch job in `out`; returns (output rows in the order of `table`,
    None for a row with no output, and the job report)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "requests.parquet"
    if path.exists():
        if not pq.read_table(path).equals(table):
            raise ValueError(
                f"{path} holds other requests (another suite, model or setting); "
                f"use a new output directory"
            )
    else:
        tmp = out / ".requests.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(path)
    spec = dataclasses.replace(
        job,
        input=InputSpec(path=str(path), batch_rows=job.input.batch_rows),
        output=OutputSpec(path=str(out / "records"), prompt_logprobs=True),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=1),
    )
    report = run_job(spec, progress_stream=progress_stream)
    records = out / "records"
    got = {}
    if any(records.glob("part-*.parquet")):
        for r in pq.read_table(records).to_pylist():
            got[r["id"]] = r
    return [got.get(i) for i in table.column("id").to_pylist()], report


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
