"""Turning input rows into engine work: one `RowWork` (token ids + sampling) or an error per row.

Runs on CPU workers (a Ray task per unit of rows). A row's prompt comes from the first of its
prompt columns that is not null: `prompt_token_ids`, else `messages` (through the checkpoint's
chat template), else `prompt` (text, encoded with a BOS). Per-row sampling columns override the
job's defaults. A bad row never raises: it gets an error string naming what is wrong. OpenAI
input (`input.format = "openai"`) also carries a per-row `logprobs` flag and the request's
`model`, which must be the job's (`InputSpec.served_model`; else a warning, or the row's error
with `strict_model`).

Per-row sampling values are coerced where the meaning is certain and rejected otherwise: null
keeps the job's value; an integral float becomes an int (3.0 -> 3: what pandas writes for an
int column holding nulls); NaN, inf, fractions where an integer is due, strings, booleans, lists
and structs make the row's error.
"""

import dataclasses
import decimal
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from k3batch.engine.request import SamplingParams, is_int
from k3batch.driver.jobspec import ROW_SAMPLING_COLUMNS, InputSpec
from k3batch.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RowWork:
    row_idx: int  # index within the unit
    prompt_token_ids: list[int] | None
    sampling: SamplingParams | None
    error: str | None = None


def prompt_source(schema: pa.Schema, spec: InputSpec) -> str:
    """The column the prompts come from; ValueError naming the accepted columns if none."""
    for name in (spec.token_ids_column, spec.messages_column, spec.prompt_column):
        if name in schema.names:
            return name
    raise ValueError(
        f"input has no prompt column: expected one of {spec.prompt_column!r}, "
        f"{spec.messages_column!r} or {spec.token_ids_column!r}; found {schema.names}"
    )


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)  # cached per worker process: loading a BPE takes seconds


def prepare_rows(
    table: pa.Table,
    *,
    spec: InputSpec,
    model_dir: str,
    defaults: SamplingParams,
    max_seq_len: int,
    vocab_size: int,
) -> list[RowWork]:
    tok = _tokenizer(model_dir)
    first = prompt_source(table.schema, spec)
    sources = [
        c
        for c in (spec.token_ids_column, spec.messages_column, spec.prompt_column)
        if c in table.schema.names
    ]
    prompts = {c: table.column(c).to_pylist() for c in sources}
    names = list(ROW_SAMPLING_COLUMNS) + (["logprobs"] if spec.format == "openai" else [])
    overrides = {c: table.column(c).to_pylist() for c in names if c in table.schema.names}
    wrong_model = _model_check(table, spec, model_dir)
    out = []
    for i in range(table.num_rows):
        try:
            source = next((c for c in sources if prompts[c][i] is not None), first)
            if wrong_model[i]:
                raise ValueError(wrong_model[i])
            ids = _encode(prompts[source][i], source, spec, tok)
            if not ids:
                raise ValueError("empty prompt")
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab_size})")
            if len(ids) >= max_seq_len:
                raise ValueError(
                    f"prompt of {len(ids)} tokens exceeds the context limit "
                    f"(max_seq_len = {max_seq_len})"
                )
            sampling = row_sampling(defaults, {c: v[i] for c, v in overrides.items()})
            out.append(RowWork(i, ids, sampling))
        except Exception as e:  # whatever a row holds, it fails alone
            msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            out.append(RowWork(i, None, None, msg))
    return out


_INT_FIELDS = ("top_k", "seed", "max_new_tokens", "prompt_logprobs_start")


def _model_check(table: pa.Table, spec: InputSpec, model_dir: str) -> list[str | None]:
    """Per row: the error for a request naming another model (OpenAI input, strict_model), else
    None; without strict_model a mismatch is logged once per unit."""
    if spec.format != "openai" or "model" not in table.schema.names:
        return [None] * table.num_rows
    served = spec.served_model or Path(model_dir).name
    asked = table.column("model").to_pylist()
    wrong = [m is not None and m != served for m in asked]
    if not any(wrong):
        return [None] * table.num_rows
    if not spec.strict_model:
        other = next(m for m, w in zip(asked, wrong) if w)
        log.warning("%d requests name model %r, this job serves %r", sum(wrong), other, served)
        return [None] * table.num_rows
    return [f"model = {m!r} is not this job's model {served!r}" if w else None
            for m, w in zip(asked, wrong)]  # fmt: skip


def row_sampling(defaults: SamplingParams, values: dict[str, object]) -> SamplingParams:
    """The job's sampling with one row's non-null overrides, coerced and validated (ValueError
    naming the column and the value)."""
    row = {name: _coerce(name, v) for name, v in values.items() if v is not None}
    if not row.get("logprobs", True):  # openai: a row that does not ask keeps the job's setting
        del row["logprobs"]
    return dataclasses.replace(defaults, **row).validate() if row else defaults


def _coerce(name: str, value):
    if name == "logprobs":
        if not isinstance(value, bool):
            raise ValueError(f"logprobs = {value!r} must be true or false")
        return value
    if name == "stop":
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise ValueError(f"stop = {value!r} must be a list of non-empty strings")
        return tuple(value)
    if isinstance(value, decimal.Decimal) and value.is_finite():
        value = float(value)
    if isinstance(value, float) and name in _INT_FIELDS and value.is_integer():
        return int(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} = {value} must be a finite number")
    if name in _INT_FIELDS and not is_int(value):
        raise ValueError(f"{name} = {value!r} ({type(value).__name__}) must be an integer")
    if not (is_int(value) or isinstance(value, float)):
        raise ValueError(f"{name} = {value!r} ({type(value).__name__}) must be a number")
    return value


def _encode(value, source: str, spec: InputSpec, tok: Tokenizer) -> list[int]:
    if value is None:
        raise ValueError(f"{source} is null")
    if source == spec.token_ids_column:
        if not isinstance(value, list) or not all(is_int(t) for t in value):
            raise ValueError(f"{source} must be a list of integers")
        return value
    if source == spec.messages_column:
        return tok.apply_chat_template(value)
    if not isinstance(value, str):
        raise ValueError(f"{source} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError("empty prompt")
    return tok.encode(value, add_bos=True)
