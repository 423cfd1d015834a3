"""Eval suites: YAML files of tasks. A task names a local data file (Parquet or JSONL, one item
per row), the prompt template, its few-shot examples, the kind and how it is scored.
`load_suite(path)` checks every field, template and data file before anything runs and raises
ValueError naming the file, the task and the field. Data is the user's: nothing is downloaded.

A suite file is one task (the fields below at the top level) or `name`, `seed` and `tasks`, a
list whose entries are tasks or paths of task files. Relative paths (data, few-shot data, task
files) start at the folder of the file that names them. Templates are Jinja over one data row
(a missing variable is an error; the description sees the item's row); `choices`, `gold` and
`group_by` are Jinja expressions. Besides Jinja's own filters there is `regex_replace(pattern,
replacement="")`, Python's `re.sub` over the whole text (evals/hellaswag.yaml cleans its text
with it as lm-eval's hellaswag `preprocess` does).

    name: mmlu_tiny
    kind: multiple_choice          # multiple_choice | generate | loglikelihood_rolling
    data: data/mmlu_test.jsonl
    description: "The following are multiple choice questions.\\n\\n"   # once, first
    prompt: "{{ question }}\\nAnswer:"                # the context of one item
    choices: "choices"                               # expression -> list of strings
    gold: "answer"                                   # expression -> index, or the gold choice
    continuation: " {{ choice }}"                    # each choice's text after the context
    fewshot_data: data/mmlu_dev.jsonl                # examples: prompt + gold continuation
    num_fewshot: 5                                   # the same examples for every item

`fewshot_sampler` picks the examples: "shuffle" (the rows shuffled with `fewshot_seed`, then the
first `num_fewshot`) or "first_n" (the first rows in file order: lm-eval's `first_n`). With
`group_by` (an expression naming a row's group, e.g. `subject`), an item's examples are drawn
from the few-shot rows of its own group, and scoring reports each group's metrics under
`groups` and, as the task's metrics, lm-eval's group score: each metric's mean over the groups
weighted by their item counts (`aggregate_subtask_metrics` with `weight_by_size`, as its mmlu
group does) with the pooled standard error (`pooled_sample_stderr`). evals/mmlu.yaml uses both.

Generation (GSM8K style) adds `target` (the gold answer text, a template; also the few-shot
answer), `until` (stop strings), `max_gen_toks`, `temperature`, `num_samples` and `pass_k`,
`answer_regex` (its first group, or the match, of the first match is the answer) and `match`
("exact", after removing the `ignore` strings; or "math": equivalence through math-verify).
Rolling log-likelihood scores the `prompt` text of each row as a document, in windows of
`max_len` tokens (default: the engine's max_seq_len - 1).
"""

import dataclasses
import functools
import importlib.util
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jinja2
import jinja2.meta
import jinja2.sandbox
import yaml

from k3batch.driver.jobspec import check_types

Kind = Literal["multiple_choice", "generate", "loglikelihood_rolling"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskSpec:
    name: str
    kind: Kind
    data: str  # .parquet or .jsonl; relative to the suite file
    prompt: str  # template: the context (rolling: the document)
    description: str = ""  # template, before the few-shot examples
    fewshot_data: str | None = None
    num_fewshot: int = 0
    fewshot_sampler: Literal["shuffle", "first_n"] = "shuffle"
    fewshot_seed: int = 1234  # shuffle: the rows shuffled with this seed, the first num_fewshot
    fewshot_separator: str = "\n\n"
    target: str = ""  # generate: template of the gold answer text (and the few-shot answers)
    choices: str = ""  # multiple_choice: expression, a list of strings
    gold: str = ""  # multiple_choice: expression, an index or one of the choices
    continuation: str = " {{ choice }}"  # multiple_choice: template, sees `choice` too
    until: tuple[str, ...] = ()  # generate: stop strings (the text is cut before the first)
    max_gen_toks: int = 256
    temperature: float = 0.0
    num_samples: int = 1  # generations per item (seeds from the suite seed, task, item, sample)
    pass_k: tuple[int, ...] = ()  # pass@k reported for each k (k <= num_samples)
    answer_regex: str | None = None
    match: Literal["exact", "math"] = "exact"
    ignore: tuple[str, ...] = ()  # removed from both answers before an exact match
    max_len: int | None = None  # rolling: tokens per window
    group_by: str | None = None  # expression: the row's group (few-shot examples, metrics)
    limit: int | None = None  # the first `limit` items only


@dataclass(frozen=True, kw_only=True, slots=True)
class SuiteSpec:
    name: str
    seed: int = 0
    tasks: tuple[TaskSpec, ...] = ()


def _regex_replace(text, pattern: str, replacement: str = "") -> str:
    """The template filter `regex_replace`: re.sub over the whole text."""
    return re.sub(pattern, replacement, str(text))


_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    undefined=jinja2.StrictUndefined, keep_trailing_newline=True
)
_ENV.filters["regex_replace"] = _regex_replace


def render(template: str, row: dict, **extra) -> str:
    return _template(template).render(**row, **extra)


def evaluate(expression: str, row: dict):
    return _expression(expression)(**row)


def group_of(task: TaskSpec, row: dict) -> str | None:
    """The group of `row` (group_by's value as a string); None when the task has no group_by."""
    return None if task.group_by is None else str(evaluate(task.group_by, row))


@functools.lru_cache(maxsize=64)
def _template(source: str):
    return _ENV.from_string(source)


@functools.lru_cache(maxsize=64)
def _expression(source: str):
    return _ENV.compile_expression(source, undefined_to_none=False)


def read_rows(path: str) -> list[dict]:
    """The rows of a .parquet or .jsonl file; ValueError naming the file when it cannot be read."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {path!r} does not exist")
    if p.suffix == ".parquet":
        try:
            return pq.read_table(p).to_pylist()
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            raise ValueError(f"data file {path!r} cannot be read: {why}") from None
    rows = []  # JSONL: read line by line, so that rows may differ in their types
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"data file {path!r} line {n}: not JSON: {e}") from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"data file {path!r} line {n}: not a JSON object")
    return rows


def load_suite(path: str | Path, *, limit: int | None = None, seed: int | None = None) -> SuiteSpec:
    """The suite in `path`; `limit` (items per task) and `seed` override the file's."""
    suite = _load(Path(path))
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit = {limit} must be >= 1")
        tasks = tuple(dataclasses.replace(t, limit=limit) for t in suite.tasks)
        suite = dataclasses.replace(suite, tasks=tasks)
    if seed is not None:
        suite = dataclasses.replace(suite, seed=seed)
    return suite


def _load(path: Path) -> SuiteSpec:
    raw = _read_yaml(path)
    if "tasks" not in raw:
        task = _task(raw, path)
        return SuiteSpec(name=task.name, tasks=(task,))
    extra = set(raw) - {"name", "seed", "tasks"}
    if extra:
        known = "name, seed, tasks"
        raise ValueError(f"{path}: unknown suite field(s) {sorted(extra)}; known: {known}")
    entries = raw["tasks"]
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: tasks must be a non-empty list of tasks or task files")
    tasks = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            sub = path.parent / entry
            tasks.append(_task(_read_yaml(sub), sub))
        elif isinstance(entry, dict):
            tasks.append(_task(entry, path, where=f"tasks[{i}]"))
        else:
            raise ValueError(f"{path}: tasks[{i}] must be a task or a task file's path")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: task names repeat: {names}")
    seed = raw.get("seed", 0)
    name = raw.get("name", path.stem)
    if not isinstance(seed, int) or isinstance(seed, bool) or not isinstance(name, str):
        raise ValueError(f"{path}: name must be a string and seed an integer")
    return SuiteSpec(name=name, seed=seed, tasks=tuple(tasks))


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"suite file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping of fields")
    return raw


def _task(raw: dict, path: Path, where: str = "") -> TaskSpec:
    source = f"{path}{' ' + where if where else ''}"
    known = {f.name for f in dataclasses.fields(TaskSpec)}
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"{source}: unknown field(s) {unknown}; known: {', '.join(sorted(known))}")
    checked = check_types(raw, source=source, cls=TaskSpec).model_dump(exclude_unset=True)
    task = TaskSpec(**checked)
    for name in ("data", "fewshot_data"):
        value = getattr(task, name)
        if value is not None and not Path(value).is_absolute():
            task = dataclasses.replace(task, **{name: str(path.parent / value)})
    try:
        _validate(task)
    except ValueError as e:
        raise ValueError(f"{source}: task {task.name!r}: {e}") from None
    return task


def _validate(t: TaskSpec) -> None:
    for name in ("data", "fewshot_data"):
        value = getattr(t, name)
        if value is not None and Path(value).suffix not in (".parquet", ".jsonl"):
            raise ValueError(f"{name} = {value!r}: expected a .parquet or .jsonl file")
    rows = read_rows(t.data)
    if not rows:
        raise ValueError(f"data file {t.data!r} holds no rows")
    if t.num_fewshot < 0 or (t.num_fewshot and t.fewshot_data is None):
        raise ValueError(f"num_fewshot = {t.num_fewshot} needs fewshot_data and must be >= 0")
    shots = read_rows(t.fewshot_data) if t.fewshot_data else []
    if t.num_fewshot > len(shots):
        raise ValueError(f"num_fewshot = {t.num_fewshot} > {len(shots)} rows in fewshot_data")
    templates = {"prompt": t.prompt, "description": t.description}
    expressions = {}
    if t.kind == "multiple_choice":
        if not t.choices or not t.gold:
            raise ValueError("a multiple_choice task needs `choices` and `gold` expressions")
        templates["continuation"] = t.continuation
        expressions = {"choices": t.choices, "gold": t.gold}
    if t.kind == "generate":
        if not t.target:
            raise ValueError("a generate task needs `target` (the gold answer template)")
        templates["target"] = t.target
        if not all(t.until):
            raise ValueError("until: stop strings must not be empty")
        if t.max_gen_toks < 1 or t.num_samples < 1 or t.temperature < 0:
            raise ValueError("max_gen_toks and num_samples must be >= 1, temperature >= 0")
        if bad := [k for k in t.pass_k if not 1 <= k <= t.num_samples]:
            raise ValueError(f"pass_k {bad} must be in [1, num_samples = {t.num_samples}]")
        if t.answer_regex is not None:
            try:
                re.compile(t.answer_regex)
            except re.error as e:
                raise ValueError(f"answer_regex {t.answer_regex!r}: {e}") from None
        if t.match == "math" and importlib.util.find_spec("math_verify") is None:
            raise ValueError("match: math needs math-verify (pip install k3batch[eval])")
    if t.max_len is not None and t.max_len < 2:
        raise ValueError(f"max_len = {t.max_len} must be >= 2")
    if t.limit is not None and t.limit < 1:
        raise ValueError(f"limit = {t.limit} must be >= 1")
    if t.group_by is not None:
        if t.kind == "loglikelihood_rolling":
            raise ValueError("group_by: a rolling task's metrics are not means over items")
        expressions["group_by"] = t.group_by
    columns = set(rows[0]) | {"choice"}
    for name, source in templates.items():
        _check_variables(name, _parse(name, source), columns, t.data)
    for name, source in expressions.items():
        _check_variables(name, _parse(name, "{{ " + source + " }}"), columns, t.data)
    if t.group_by is not None:
        _check_groups(t, rows, shots)


def _check_groups(t: TaskSpec, rows: list[dict], shots: list[dict]) -> None:
    """Every row has a group, and each item's group has num_fewshot few-shot rows."""

    def groups(rows: list[dict], path: str) -> list[str]:
        out = []
        for n, row in enumerate(rows):
            try:
                out.append(group_of(t, row))
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                raise ValueError(f"group_by on row {n} of {path!r}: {why}") from None
        return out

    num_shots = Counter(groups(shots, t.fewshot_data))
    short = sorted({g for g in groups(rows, t.data) if num_shots[g] < t.num_fewshot})
    if short:
        listed = ", ".join(f"{g!r} ({num_shots[g]})" for g in short[:5])
        more = f" and {len(short) - 5} more" if len(short) > 5 else ""
        raise ValueError(f"num_fewshot = {t.num_fewshot}, but these groups have fewer rows in "
                         f"fewshot_data: {listed}{more}")  # fmt: skip


def _parse(name: str, source: str):
    try:
        return _ENV.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{name}: template error: {e}") from None


def _check_variables(name: str, ast, columns: set, data: str) -> None:
    missing = sorted(jinja2.meta.find_undeclared_variables(ast) - columns)
    if missing:
        have = sorted(columns - {"choice"})
        raise ValueError(
            f"{name} uses {missing}, which the data file {data!r} does not have (columns: {have})"
        )
