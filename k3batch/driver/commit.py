"""Commit: a unit whose rows are all finished becomes one output shard (atomic), and at the end
of every run, the account of what has no output yet.

`Committer.maybe_commit` writes the unit's input columns, its id (when generated) and the result
columns; the unit then leaves driver memory. `missing_rows` compares the committed shards (a
directory listing: no shard is read) with the row counts the manifest recorded, and says per
file how many rows have no output and why (the errors this run recorded for that file).
"""

import time

import pyarrow as pa

from k3batch.driver.intake import OpenUnit
from k3batch.io import ShardSink
from k3batch.jobspec import JobSpec
from k3batch.report import JobReport
from k3batch.result import append_results, result_names


class Committer:
    def __init__(self, spec: JobSpec, sink: ShardSink, add_id: bool, report: JobReport, lease):
        self.spec, self.sink, self.add_id = spec, sink, add_id
        self.report, self.lease = report, lease
        out = spec.output
        self.names = result_names(logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs)

    def maybe_commit(self, state: OpenUnit) -> bool:
        """Write the unit's shard if every row is finished; True if it was written."""
        if state.remaining:
            return False
        self.lease.check()  # never write into a directory another driver took over
        t0 = time.perf_counter()
        table = self.output_table(state)
        self.sink.write(*state.key, table)
        rep = self.report
        rep.stage_s["write"] += time.perf_counter() - t0
        rep.rows_written += table.num_rows
        rep.rows_with_error += sum(r["error"] is not None for r in state.results)
        rep.prompt_tokens += sum(r.get("num_prompt_tokens") or 0 for r in state.results)
        rep.output_tokens += sum(r.get("num_output_tokens") or 0 for r in state.results)
        return True

    def output_table(self, state: OpenUnit) -> pa.Table:
        table = state.table
        if self.add_id:
            table = table.append_column(self.spec.input.id_column, pa.array(state.ids, pa.string()))
        return append_results(table, state.results, self.names)


def missing_rows(
    files, num_rows: list[int | None], committed: set, batch_rows: int, reasons: dict[int, list]
) -> list[dict]:
    """Per input file with rows that have no output: {"file", "rows" (None: unknown, the file
    was never readable), "batches" (first few missing batch indices), "why"}."""
    out = []
    for f, n in zip(files, num_rows):
        done = sorted(b for fi, b in committed if fi == f.index)
        if n is None:  # unreadable now and at the first start: how much is missing is unknown
            out.append(_entry(f, None, [], reasons))
            continue
        num_batches = -(-n // batch_rows)
        missing = sorted(set(range(num_batches)) - set(done))
        if missing:
            rows = sum(min(batch_rows, n - b * batch_rows) for b in missing)
            out.append(_entry(f, rows, missing, reasons))
    return out


def _entry(f, rows, missing: list[int], reasons: dict[int, list]) -> dict:
    why = reasons.get(f.index) or ["not processed (the run stopped before these batches)"]
    return {"file": f.uri, "rows": rows, "batches": missing[:20], "why": why[:5]}
