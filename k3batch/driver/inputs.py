"""The input survey: every file's footer (Parquet; other formats: a streamed pass) read once at
the start of a run, each file checked
against the job's input contract (schema drift), and the row counts the end-of-run check uses.

The contract is what the first valid file looks like (at the job's first start; the manifest
keeps it for resumes): the prompt column and its type, and the id column's type or its absence.
A file that deviates (no prompt column, a prompt of another type, no id column or an id of
another type, a column named like an output column) is skipped and reported like an unreadable
one; the job goes on with the rest. Only when no file is valid does the job stop, before any
replica starts, with the first file's reason.
"""

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from k3batch.io import InputFile
from k3batch.io.source import scan_file
from k3batch.driver.jobspec import InputSpec
from k3batch.driver.prompts import prompt_source
from k3batch.actors.result import RESULT_TYPES


@dataclass(frozen=True, slots=True)
class InputSurvey:
    contract: dict  # {"prompt_column", "prompt_type", "id_type" (None: ids are generated)}
    num_rows: list[int | None]  # per file, from its footer now; None if unreadable
    bad: dict[int, str]  # file index -> why the file is skipped (unreadable or off-contract)

    @property
    def has_ids(self) -> bool:
        return self.contract["id_type"] is not None


def survey_inputs(
    fs: pafs.FileSystem, files: list[InputFile], spec: InputSpec, contract: dict | None = None
) -> InputSurvey:
    """Read every footer, derive the contract (unless given: the manifest's) and check each file
    against it. Raises ValueError if no file is valid."""
    schemas: list[pa.Schema | None] = []
    num_rows: list[int | None] = []
    bad: dict[int, str] = {}
    for f in files:
        try:
            schema, n = scan_file(fs, f)
            schemas.append(schema)
            num_rows.append(n)
        except Exception as e:  # corrupt footer, vanished file, permission, ...
            schemas.append(None)
            num_rows.append(None)
            what = "cannot read Parquet footer" if f.format == "parquet" else "cannot read"
            bad[f.index] = f"{f.uri}: {what}: {type(e).__name__}: {e}"
    first_error = None
    for f, schema in zip(files, schemas):
        if schema is None:
            continue
        try:
            found = file_contract(schema, spec)
        except ValueError as e:
            bad[f.index] = f"{f.uri}: {e}"
            first_error = first_error or bad[f.index]
            continue
        contract = contract or found
        if found != contract:
            bad[f.index] = f"{f.uri}: schema differs from the job's: {_diff(contract, found)}"
    if contract is None:
        raise ValueError(first_error or f"input {spec.path!r}: no readable file")
    return InputSurvey(contract=contract, num_rows=num_rows, bad=bad)


def file_contract(schema: pa.Schema, spec: InputSpec) -> dict:
    """What a file offers the job; ValueError naming the problem if it cannot be used at all."""
    source = prompt_source(schema, spec)
    clash = [c for c in RESULT_TYPES if c in schema.names]
    if clash:
        raise ValueError(f"input column(s) {clash} clash with output columns; rename them")
    has_id = spec.id_column in schema.names
    return {
        "prompt_column": source,
        "prompt_type": _type_class(schema.field(source).type),
        "id_type": _type_class(schema.field(spec.id_column).type) if has_id else None,
    }


def _type_class(t: pa.DataType) -> str:
    """Types that give the same values to the job are one class (int32 ids == int64 ids)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return f"list<{_type_class(t.value_type)}>"
    return str(t)


def _diff(want: dict, got: dict) -> str:
    names = {"prompt_column": "prompt column", "prompt_type": "prompt type", "id_type": "id type"}
    parts = []
    for key, name in names.items():
        if want[key] != got[key]:
            w = "none" if want[key] is None else repr(want[key])
            g = "none" if got[key] is None else repr(got[key])
            parts.append(f"{name} {g} (the job's: {w})")
    return "; ".join(parts)
