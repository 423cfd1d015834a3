"""Line-based inputs (JSON Lines, CSV, OpenAI batch requests): rows with their line numbers.

pyarrow's JSON reader fails a whole block at one malformed line and infers types per block; its
CSV reader can only drop a malformed row and cannot say where it was once quoted values span
lines. So rows are parsed here one at a time (json.loads, the csv module): a row is one
non-blank line (JSONL) or one CSV record after the header; a row that cannot be parsed is that
row's error, naming its line, and the rows after it keep their numbers. Files are streamed (one
line or record in memory; `.gz` decompressed by pyarrow from the name).

Types: the columns a job reads (`KNOWN_TYPES`: id, prompts, per-row sampling) have fixed types;
a value that does not fit is its row's error. Other fields keep pyarrow's type for the batch, or
become JSON text when a batch mixes kinds. CSV values are text: the list columns (messages,
prompt_token_ids, stop) are JSON there, numbers are parsed, an empty field is null.
"""

import csv
import io
import json
import math
import sys
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from k3batch.io import openai_batch

Record = tuple[int, dict | None, str | None]  # (line number, fields, error)

_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
KNOWN_TYPES = {
    "id": pa.string(),  # JSON integers become their decimal text
    "prompt": pa.string(),
    "messages": _MESSAGES,
    "prompt_token_ids": pa.list_(pa.int64()),
    "temperature": pa.float64(),
    "top_p": pa.float64(),
    "top_k": pa.int64(),
    "seed": pa.uint64(),
    "max_new_tokens": pa.int64(),
    "prompt_logprobs_start": pa.int64(),
    "stop": pa.list_(pa.string()),
}


def iter_records(
    fs: pafs.FileSystem, path: str, fmt: str, want: Callable[[int], bool] = lambda row: True
) -> Iterator[Record]:
    """Every row of the file in order. want(row index) False: the row is counted, not parsed
    (JSONL; yielded as (line, None, None)). Raises on I/O or decompression errors."""
    if fmt == "csv":
        yield from _csv_records(fs, path)
        return
    with fs.open_input_stream(path) as stream:  # compression detected from the name
        row = 0
        for line_no, raw in enumerate(io.BufferedReader(stream), 1):
            if not raw.strip():
                continue
            if not want(row):
                yield line_no, None, None
            else:
                yield (line_no, *_parse_json_line(raw, fmt))
            row += 1


def _parse_json_line(raw: bytes, fmt: str) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        return None, f"malformed JSON: {e}"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    if fmt == "openai":
        return openai_batch.request_row(obj)
    return obj, None


def _csv_records(fs: pafs.FileSystem, path: str) -> Iterator[Record]:
    # The csv module's default field limit (128 KiB) is below long prompts. Process-wide, and
    # only ever raised.
    csv.field_size_limit(max(csv.field_size_limit(), sys.maxsize >> 1))
    with fs.open_input_stream(path) as stream:
        text = io.TextIOWrapper(io.BufferedReader(stream), encoding="utf-8", newline="")
        reader = csv.reader(text)
        header = next(reader, None)
        if header is None:
            return
        end = reader.line_num
        while True:
            start = end + 1
            try:
                rec = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                end = reader.line_num
                yield start, None, f"malformed CSV: {e}"
                continue
            end = reader.line_num
            if not rec:
                continue  # a blank line is no row
            if len(rec) != len(header):
                yield start, None, f"expected {len(header)} fields, got {len(rec)}"
                continue
            yield start, {k: (v if v != "" else None) for k, v in zip(header, rec)}, None


def scan(fs: pafs.FileSystem, path: str, fmt: str) -> tuple[int, list[str]]:
    """(row count, column names in first-seen order) of a file, in one streamed pass."""
    if fmt == "openai":
        return sum(1 for _ in iter_records(fs, path, fmt, want=lambda r: False)), list(
            openai_batch.COLUMNS
        )
    columns: dict[str, None] = {}
    num_rows = 0
    for _, fields, _ in iter_records(fs, path, fmt):
        num_rows += 1
        if fields:
            columns.update(dict.fromkeys(fields))
    return num_rows, list(columns)


def schema_of(columns: list[str], fmt: str) -> pa.Schema:
    """The schema the file's units will have, as far as the job's contract looks at it (other
    fields: string, their type is decided per batch)."""
    types = openai_batch.COLUMNS if fmt == "openai" else KNOWN_TYPES
    return pa.schema([(c, types.get(c, pa.string())) for c in columns])


def records_table(records: list[Record], columns: list[str], fmt: str) -> tuple[pa.Table, dict]:
    """The rows as a table with `columns`, and {row index: error} for rows that failed to parse
    or hold a value of the wrong type for a known column (the value is null then)."""
    errors = {i: f"line {line}: {err}" for i, (line, _, err) in enumerate(records) if err}
    types = openai_batch.COLUMNS if fmt == "openai" else KNOWN_TYPES
    arrays = []
    for name in columns:
        values = [None if fields is None else fields.get(name) for _, fields, _ in records]
        if name not in types:
            arrays.append(_free_column(values))
            continue
        fitted = []
        for i, value in enumerate(values):
            try:
                fitted.append(_fit(name, value, types[name], text=fmt == "csv"))
            except (ValueError, TypeError) as e:
                errors.setdefault(i, f"line {records[i][0]}: {e}")
                fitted.append(None)
        arrays.append(pa.array(fitted, types[name]))
    return pa.Table.from_arrays(arrays, names=columns), errors


def _free_column(values: list) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values])


def _fit(name: str, value, typ: pa.DataType, *, text: bool):
    """`value` as a Python value of arrow type `typ`; ValueError naming the column if it is not
    one. text: the value is CSV text (lists are JSON, numbers are parsed)."""
    if value is None:
        return None
    if text and (pa.types.is_list(typ) or pa.types.is_struct(typ)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not JSON: {e}") from None
    if pa.types.is_string(typ):
        if name == "id" and isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        return value
    if pa.types.is_boolean(typ):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if pa.types.is_floating(typ) or pa.types.is_integer(typ):
        return _number(name, value, typ, text=text)
    if typ == _MESSAGES:
        if not isinstance(value, list) or not value:
            raise ValueError(f"{name} must be a non-empty list of messages")
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not all(
                isinstance(m.get(k), str) for k in ("role", "content")
            ):
                raise ValueError(f"{name}[{i}] must have a string role and content")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    if name == "stop" and isinstance(value, str):
        value = [value]
    item = typ.value_type
    kind = "integers" if pa.types.is_integer(item) else "strings"
    if not isinstance(value, list) or None in value:
        raise ValueError(f"{name} must be a list of {kind}")
    return [_fit(name, v, item, text=False) for v in value]


def _number(name: str, value, typ: pa.DataType, *, text: bool):
    if text and isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eEn") else int(value)
        except ValueError:
            raise ValueError(f"{name} = {value!r} must be a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} = {value!r} must be a number")
    if pa.types.is_floating(typ):
        return float(value)
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{name} = {value!r} must be an integer")
        value = int(value)
    lo, hi = (0, 2**64 - 1) if typ == pa.uint64() else (-(2**63), 2**63 - 1)
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value} is out of range")
    return value
