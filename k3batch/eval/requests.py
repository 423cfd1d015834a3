"""A suite's items as the rows of a batch job: one row per engine request, all scored from the
engine's own prompt log-probabilities or completions.

- multiple choice: one row per choice, prompt = context + continuation token ids, scored from
  `prompt_logprobs_start` = len(context) on. The context of every choice is the same token
  sequence, so the prefix cache shares it (and the few-shot examples shared by all items, or
  by the items of one group).
- generate: one row per sample, prompt = context, `max_new_tokens` = max_gen_toks, a seed per
  (suite seed, task, item, sample), `stop` = the task's `until` (the engine stops a completion
  at the first token whose text completes one; scoring cuts the text before it), nothing
  scored in the prompt.
- rolling log-likelihood: one row per window of a document, each scoring the tokens not scored
  before with the window's earlier tokens as context (`rolling_windows`).

Tokenization follows lm-evaluation-harness: trailing spaces of the context move to the
continuation, the continuation's ids are what encoding context + continuation adds after the
context's ids. A row whose item cannot be built (a template that fails on it, a gold that is no
choice, a prompt longer than the model's window) carries the reason in `prep_error` and no
prompt: the job gives it an error row, and the item is reported with its error. Every row
carries its item's `group` (null without group_by) for the per-group metrics.
"""

import hashlib
import random
from collections import defaultdict

import pyarrow as pa

from k3batch.eval.suite import SuiteSpec, TaskSpec, evaluate, group_of, read_rows, render

SCHEMA = pa.schema(
    [
        ("id", pa.string()),  # task/item/sub
        ("task", pa.string()),
        ("item", pa.int32()),
        ("sub", pa.int32()),  # choice, sample or window index
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("prompt_logprobs_start", pa.int32()),
        ("max_new_tokens", pa.int32()),
        ("temperature", pa.float64()),
        ("seed", pa.int64()),
        ("stop", pa.list_(pa.string())),  # generate: the stop strings (the engine stops there)
        ("gold", pa.int32()),  # multiple choice: the gold choice's index
        ("choice_bytes", pa.int32()),  # multiple choice: UTF-8 bytes of the continuation
        ("target", pa.string()),  # generate: the gold answer text
        ("num_bytes", pa.int32()),  # rolling: UTF-8 bytes of the document (on window 0)
        ("group", pa.string()),  # group_by: the item's group
        ("prep_error", pa.string()),
    ]
)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids with BOS, continuation ids), as lm-evaluation-harness splits them."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tok.encode(context, add_bos=True)
    whole = tok.encode(context + continuation, add_bos=True)
    return ctx, whole[len(ctx) :]


def rolling_windows(ids: list[int], max_len: int) -> list[tuple[list[int], int]]:
    """(prompt ids, first scored position) per window: every token after the first is scored
    exactly once, each window holding at most max_len tokens, the first of which is the last
    token of the window before (lm-evaluation-harness's rolling windows, context 1)."""
    out, start = [], 1
    while start < len(ids):
        stop = min(len(ids), start - 1 + max_len)
        out.append((ids[start - 1 : stop], 1))
        start = stop
    return out


def sample_seed(seed: int, task: str, item: int, sample: int) -> int:
    digest = hashlib.sha256(f"{seed}/{task}/{item}/{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63: an int64 column


def build_requests(suite: SuiteSpec, tok, max_seq_len: int) -> pa.Table:
    rows = []
    for task in suite.tasks:
        items = read_rows(task.data)[: task.limit]
        shots = fewshot_texts(task)
        for i, item in enumerate(items):
            group = group_of(task, item)  # load_suite evaluated it on every row
            try:
                item_rows = _item_rows(task, suite.seed, i, item, shots, tok, max_seq_len)
            except Exception as e:  # a bad item fails alone
                msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                item_rows = [_row(task, i, 0, None, prep_error=msg)]
            rows += [r | {"group": group} for r in item_rows]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def fewshot_texts(task: TaskSpec) -> dict[str | None, str]:
    """group (None without group_by) -> the text of its few-shot examples, each the example's
    prompt and answer, then the separator: what follows the description in each item's prompt
    ("" for every group when num_fewshot is 0)."""
    by_group = defaultdict(list)
    for row in read_rows(task.fewshot_data) if task.num_fewshot else []:
        by_group[group_of(task, row)].append(row)
    texts = defaultdict(str)
    for group, shots in by_group.items():
        if task.fewshot_sampler == "shuffle":
            random.Random(task.fewshot_seed).shuffle(shots)
        texts[group] = "".join(render(task.prompt, s) + _answer(task, s) + task.fewshot_separator
                               for s in shots[: task.num_fewshot])  # fmt: skip
    return texts


def item_context(task: TaskSpec, item: dict, shots: dict[str | None, str]) -> str:
    """The text before an item's continuation or completion: the description (rendered over the
    item's row), the few-shot examples of its group (`shots`: `fewshot_texts(task)`) and its
    prompt."""
    return render(task.description, item) + shots[group_of(task, item)] + render(task.prompt, item)


def _answer(task: TaskSpec, row: dict) -> str:
    if task.kind == "generate":
        return render(task.target, row)
    if task.kind == "multiple_choice":
        choices = _choices(task, row)
        return render(task.continuation, row, choice=choices[_gold(task, row, choices)])
    return ""


def _choices(task: TaskSpec, row: dict) -> list[str]:
    choices = evaluate(task.choices, row)
    if not isinstance(choices, list | tuple) or not choices:
        raise ValueError(f"choices gave {choices!r}, not a non-empty list")
    return [str(c) for c in choices]


def _gold(task: TaskSpec, row: dict, choices: list[str]) -> int:
    gold = evaluate(task.gold, row)
    if isinstance(gold, str) and gold in choices:
        return choices.index(gold)
    if isinstance(gold, str) and gold.strip().isdigit():
        gold = int(gold)
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise ValueError(f"gold gave {gold!r}: not an index of the {len(choices)} choices")
    return gold


def _item_rows(task, seed, i, item, shots, tok, max_seq_len) -> list[dict]:
    context = item_context(task, item, shots)
    if task.kind == "multiple_choice":
        choices = _choices(task, item)
        gold = _gold(task, item, choices)
        out = []
        for c, choice in enumerate(choices):
            text = render(task.continuation, item, choice=choice)
            ctx, cont = encode_pair(tok, context, text)
            if not cont:
                raise ValueError(f"choice {c} encodes to no tokens")
            _check_len(len(ctx) + len(cont), max_seq_len)
            out.append(_row(task, i, c, ctx + cont, start=len(ctx), gold=gold,
                            choice_bytes=len(text.encode())))  # fmt: skip
        return out
    if task.kind == "generate":
        ids = tok.encode(context, add_bos=True)
        _check_len(len(ids) + 1, max_seq_len)
        target = render(task.target, item)
        return [
            _row(task, i, s, ids, start=len(ids), max_new_tokens=task.max_gen_toks,
                 temperature=task.temperature, seed=sample_seed(seed, task.name, i, s),
                 stop=list(task.until) or None, target=target)  # fmt: skip
            for s in range(task.num_samples)
        ]
    text = render(task.prompt, item)
    ids = tok.encode(text, add_bos=True)
    if len(ids) < 2:
        raise ValueError("the document encodes to no tokens")
    max_len = min(task.max_len or max_seq_len - 1, max_seq_len - 1)
    windows = rolling_windows(ids, max_len)
    return [
        _row(task, i, w, prompt, start=start, num_bytes=len(text.encode()) if w == 0 else None)
        for w, (prompt, start) in enumerate(windows)
    ]


def _check_len(n: int, max_seq_len: int) -> None:
    if n >= max_seq_len:
        raise ValueError(f"prompt of {n} tokens does not fit in max_seq_len = {max_seq_len}")


def _row(task, item, sub, ids, *, start=None, max_new_tokens=1, temperature=0.0, seed=None,
         stop=None, gold=None, choice_bytes=None, target=None, num_bytes=None,
         prep_error=None) -> dict:  # fmt: skip
    return {
        "id": f"{task.name}/{item:06d}/{sub:03d}",
        "task": task.name,
        "item": item,
        "sub": sub,
        "prompt_token_ids": ids,
        "prompt_logprobs_start": start,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "stop": stop,
        "gold": gold,
        "choice_bytes": choice_bytes,
        "target": target,
        "num_bytes": num_bytes,
        "prep_error": prep_error,
    }
