"""Commit: a unit whose rows are all finished becomes one output shard (atomic), and at the end
of every run, the account of what has no output yet.

`Committer.maybe_commit` writes the unit's input columns, its id (when generated) and the result
columns (`output.format` parquet or jsonl), or one OpenAI batch output line per row (openai:
custom_id is the row's id, chat or text completion from the request's url, else from whether
the row had messages); the unit then leaves driver memory. With `output.merge`, the commit that
completes the job (every row of the recorded counts committed) also writes the merged file, and
so does the start of a run that finds the job complete and the merged file missing (a driver
killed between the two). `missing_rows` compares the committed shards (a
directory listing: no shard is read) with the row counts the manifest recorded, and says per
file how many rows have no output and why (the errors this run recorded for that file).
"""

import hashlib
import logging
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from k3batch.driver.intake import OpenUnit
from k3batch.io import ShardSink, openai_batch
from k3batch.driver.jobspec import JobSpec
from k3batch.driver.report import JobReport
from k3batch.actors.result import append_results, result_names

log = logging.getLogger(__name__)

# "_": hidden from dataset readers of the folder, which would count its rows twice
MERGED_NAME = {"parquet": "_merged.parquet", "jsonl": "_merged.jsonl", "openai": "_merged.jsonl"}


class Committer:
    def __init__(self, spec: JobSpec, sink: ShardSink, add_id: bool, report: JobReport, lease):
        self.spec, self.sink, self.add_id = spec, sink, add_id
        self.report, self.lease = report, lease
        out = spec.output
        # openai rows may ask for log-probabilities themselves
        logprobs = out.logprobs or spec.input.format == "openai"
        self.names = result_names(logprobs=logprobs, prompt_logprobs=out.prompt_logprobs)
        self._tokenizer = None
        self._job_hash = spec.fingerprint()[0]
        if self._is_complete() and not self._has_merged():
            self._merge()  # the last run committed everything and stopped before merging

    def _is_complete(self) -> bool:
        rep = self.report
        done = rep.rows_skipped_resumed + rep.rows_written
        return self.spec.output.merge and rep.rows_total is not None and done == rep.rows_total

    def _has_merged(self) -> bool:
        name = MERGED_NAME[self.spec.output.format]
        return self.sink.fs.get_file_info(f"{self.sink.path}/{name}").type != pafs.FileType.NotFound

    def _merge(self) -> None:
        self.lease.check()
        path = self.sink.merge(MERGED_NAME[self.spec.output.format])
        log.info("merged every shard into %s", path)

    def maybe_commit(self, state: OpenUnit) -> bool:
        """Write the unit's shard if every row is finished; True if it was written."""
        if state.remaining:
            return False
        self.lease.check()  # never write into a directory another driver took over
        t0 = time.perf_counter()
        table = self.output_table(state)
        fmt = self.spec.output.format
        if fmt == "parquet":
            self.sink.write(*state.key, table)
        elif fmt == "jsonl":
            self.sink.write_lines(*state.key, table.to_pylist())
        else:
            self.sink.write_lines(*state.key, self.openai_lines(state, table))
        rep = self.report
        rep.stage_s["write"] += time.perf_counter() - t0
        rep.rows_written += table.num_rows
        rep.rows_with_error += sum(r["error"] is not None for r in state.results)
        rep.prompt_tokens += sum(r.get("num_prompt_tokens") or 0 for r in state.results)
        rep.output_tokens += sum(r.get("num_output_tokens") or 0 for r in state.results)
        if self._is_complete():
            self._merge()
        return True

    def openai_lines(self, state: OpenUnit, table: pa.Table) -> list[dict]:
        """The OpenAI batch output line of each row of the unit, in row order."""
        names = table.schema.names
        urls = table.column("url").to_pylist() if "url" in names else [None] * table.num_rows
        models = table.column("model").to_pylist() if "model" in names else [None] * len(urls)
        col = self.spec.input.messages_column
        chats = table.column(col).is_valid().to_pylist() if col in names else [False] * len(urls)
        served = self.spec.input.served_model or Path(self.spec.model).name
        created = int(time.time())
        lines = []
        f, b = state.key
        for i, row in enumerate(state.results):
            digest = hashlib.sha256(f"{self._job_hash}:{f}:{b}:{i}".encode()).hexdigest()[:24]
            chat = openai_batch.is_chat(urls[i]) if urls[i] else chats[i]
            lines.append(openai_batch.response_line(
                line_id=f"batch_req_{digest}", custom_id=state.ids[i], chat=chat,
                model=models[i] or served, row=row, created=created, token_text=self._token_text,
            ))  # fmt: skip
        return lines

    def _token_text(self, token_id: int) -> str:
        if self._tokenizer is None:  # only rows with log-probabilities spell their tokens
            from k3batch.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_dir(self.spec.model)
        return self._tokenizer.decode([token_id])

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
