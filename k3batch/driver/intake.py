"""Intake: input units -> open units in driver memory -> rows of work, tokenized in Ray tasks.

`Intake.open_next()` reads the next unit (skipping committed ones), gives its rows their ids
(the id column, or "<file uri>:<row>" when the input has none), fails rows that could not be
parsed (a malformed line, with its number) and rows with a null or a duplicate id at once
(duplicates decided by `IdIndex`: the first occurrence in input order runs) and starts a
tokenize task for the unit. `on_tokenized` turns the task's answer into the rows to
dispatch; a row the tokenizer rejects, or every row of a unit whose task failed, gets an error.
Driver memory holds only open units: the caller bounds how many are open.
"""

import logging
import time
from dataclasses import dataclass

import pyarrow as pa
import ray

from k3batch.driver.ids import IdIndex, id_strings, position
from k3batch.driver.jobspec import JobSpec
from k3batch.driver.prompts import RowWork, prepare_rows
from k3batch.actors.result import error_row

log = logging.getLogger(__name__)

GET_TIMEOUT_S = 60.0  # ray.get of a ref that ray.wait reported ready


@ray.remote(num_cpus=1)
def _tokenize(table: pa.Table, **kw) -> tuple[list[RowWork], float]:
    t0 = time.perf_counter()
    return prepare_rows(table, **kw), time.perf_counter() - t0


@dataclass
class OpenUnit:
    key: tuple[int, int]  # (file index, batch index): the shard it commits to
    table: pa.Table  # the input rows, passed through to the output
    ids: list[str | None]
    results: list[dict | None]  # one output dict per row once it is finished
    remaining: int  # rows not finished yet

    def finish(self, i: int, row: dict) -> None:
        assert self.results[i] is None, f"row {i} of unit {self.key} finished twice"
        self.results[i] = row
        self.remaining -= 1


class Intake:
    """See the module docstring. `exhausted` once every unit has been handed out."""

    def __init__(self, spec: JobSpec, vocab_size: int, units, ids: IdIndex | None, report):
        self.spec, self.units, self.ids, self.report = spec, units, ids, report
        self.add_id = ids is None  # no id column in the input: ids are generated
        self.exhausted = False
        self.tok_refs: dict = {}  # tokenize ref -> unit key
        self.errors: dict[int, list[str]] = {}  # file index -> read errors of this run
        self.tok_kw = dict(
            spec=spec.input,
            model_dir=spec.model,
            defaults=spec.row_defaults,
            max_seq_len=spec.engine.max_seq_len,
            vocab_size=vocab_size,
        )

    def open_next(self) -> OpenUnit | None:
        """The next unit, its tokenize task started; None if the input gave an error unit
        (recorded in the report) or is exhausted."""
        t0 = time.perf_counter()
        unit = next(self.units, None)
        self.report.stage_s["read"] += time.perf_counter() - t0
        if unit is None:
            self.exhausted = True
            return None
        if unit.table is None:
            self.report.unreadable_inputs.append(unit.error)
            self.errors.setdefault(unit.file.index, []).append(unit.error)
            log.error("unreadable input: %s", unit.error)
            return None
        table, n, col = unit.table, unit.table.num_rows, self.spec.input.id_column
        if self.add_id:
            ids = [f"{unit.file.uri}:{unit.row_offset + i}" for i in range(n)]
        else:
            ids = id_strings(table.column(col))
        state = OpenUnit((unit.file.index, unit.batch_idx), table, ids, [None] * n, n)
        for i, why in (unit.row_errors or {}).items():
            state.finish(i, error_row(f"{unit.file.uri}: {why}"))
        if not self.add_id:
            first = self.ids.first_positions([i for i in ids if i is not None])
            for i, rid in enumerate(ids):
                if state.results[i] is not None:
                    continue  # unreadable row: its error says why
                if rid is None:
                    state.finish(i, error_row(f"{col} is null"))
                    continue
                pos = position(unit.file.index, unit.row_offset + i)
                if first.get(rid, pos) != pos:
                    where = _where(first[rid])
                    state.finish(i, error_row(f"duplicate id {rid!r} (first at {where})"))
        cols = [c for c in table.schema.names if c != col or not self.add_id]
        self.tok_refs[_tokenize.remote(table.select(cols), **self.tok_kw)] = state.key
        return state

    def on_tokenized(self, ref, state: OpenUnit) -> list[RowWork]:
        """The rows of `state` to dispatch; rows rejected by the tokenizer are finished with
        their error, and a failed task fails every row not finished yet."""
        del self.tok_refs[ref]
        try:
            works, dt = ray.get(ref, timeout=GET_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.error("tokenizing unit %s failed: %s", state.key, e)
            for i, r in enumerate(state.results):
                if r is None:
                    state.finish(i, error_row(f"tokenization failed: {type(e).__name__}: {e}"))
            return []
        self.report.stage_s["tokenize"] += dt
        todo = []
        for w in works:
            if state.results[w.row_idx] is not None:
                continue  # already failed (null or duplicate id)
            if w.error:
                state.finish(w.row_idx, error_row(w.error))
            else:
                todo.append(w)
        return todo


def _where(pos: int) -> str:
    return f"file {pos >> 40} row {pos & ((1 << 40) - 1)}"
