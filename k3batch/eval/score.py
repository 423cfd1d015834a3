"""Scoring pass: the batch job's output rows (one per request, see `requests.py`) -> one record
per item and, per task, each metric's value, standard error, item count and error count.

A pure function of the committed rows, taken in id order and summed in a fixed order, so the
same rows give the same bytes in `results.json` and `items.jsonl`, whatever ran them and in how
many pieces. An item with any failed row (or no row: an incomplete job) is an error item: it
is recorded with its error and left out of the metrics.

- multiple choice: log-likelihood of each choice = sum of its tokens' log-probs; `acc` takes
  the largest, `acc_norm` the largest per UTF-8 byte of the continuation (as lm-eval does);
  `is_greedy` says every continuation token was the argmax of its row.
- generate: each sample's text is cut before the first stop string, its answer extracted
  (`answer_regex`), then matched exactly or through math-verify; `exact_match` is the mean
  share of correct samples (pass@1), `pass@k` the unbiased estimator 1 - C(n-c, k) / C(n, k).
- rolling: `perplexity` = exp(-sum log p / tokens) and `bits_per_byte` over the whole task
  (token- and byte-weighted, so no standard error), `loglik` per item.

A task with `group_by` also gets, under `groups`, each group's metrics over its items, and its
own metrics become lm-eval's group score over those groups (`pool_groups`); each of its records
names its group. Without group_by, results and records have no group fields.
"""

import math
import re
from collections import defaultdict

from k3batch.eval.suite import SuiteSpec, TaskSpec


def score(suite: SuiteSpec, rows: list[dict], num_items: dict[str, int],
          groups: dict[str, dict[int, str]] | None = None) -> tuple[dict, list]:  # fmt: skip
    """rows: the job's output rows; num_items: items per task; groups: for each task with
    group_by (and only needed then), item -> its group (the requests' `group` column: it knows
    the group of an item with no output row too). Returns (results, records)."""
    by_item = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["id"]):
        by_item[(r["task"], r["item"])].append(r)
    results, records = {}, []
    for task in suite.tasks:
        recs = []
        for i in range(num_items[task.name]):
            recs.append(_record(task, i, by_item.get((task.name, i), [])))
        records += recs
        if task.group_by is None:
            results[task.name] = _aggregate(task, recs)
        else:
            for rec in recs:
                rec["group"] = groups[task.name][rec["item"]]
            results[task.name] = _aggregate_groups(task, recs)
    return {"suite": suite.name, "seed": suite.seed, "tasks": results}, records


def _record(task: TaskSpec, item: int, rows: list[dict]) -> dict:
    rec = {"task": task.name, "item": item, "error": None}
    errors = [r.get("prep_error") or r.get("error") for r in rows]
    if not rows or any(errors):
        rec["error"] = next((e for e in errors if e), "no output row (the job is incomplete)")
        return rec
    if task.kind == "multiple_choice":
        choices = [scored(r) for r in rows]
        lls = [c["loglik"] for c in choices]
        norm = [c["loglik"] / max(r["choice_bytes"], 1) for c, r in zip(choices, rows)]
        gold = rows[0]["gold"]
        pred, pred_norm = _argmax(lls), _argmax(norm)
        rec |= {"gold": gold, "pred": pred, "pred_norm": pred_norm, "choices": choices,
                "acc": float(pred == gold), "acc_norm": float(pred_norm == gold)}  # fmt: skip
    elif task.kind == "generate":
        gold = extract(task, rows[0]["target"])
        samples = []
        for r in rows:
            text = cut(r["generated_text"], task.until)
            answer = extract(task, text)
            samples.append({"text": text, "answer": answer, "correct": is_match(task, answer, gold),
                            "output_token_ids": r["output_token_ids"]})  # fmt: skip
        n, c = len(samples), sum(s["correct"] for s in samples)
        rec |= {"gold": gold, "samples": samples, "exact_match": c / n}
        rec |= {f"pass@{k}": pass_at_k(n, c, k) for k in task.pass_k}
    else:
        windows = [scored(r) for r in rows]
        ll = 0.0
        for w in windows:  # in window order, as the lm-eval backend sums them
            ll += w["loglik"]
        rec |= {"loglik": ll,
                "num_tokens": sum(w["num_tokens"] for w in windows),
                "num_bytes": rows[0]["num_bytes"], "windows": windows}  # fmt: skip
    return rec


def scored(row: dict) -> dict:
    """One request's scored tokens: ids, log-likelihood (summed in position order), greedy."""
    start = row["prompt_logprobs_start"]
    lps, greedy = row["prompt_logprobs"], row["prompt_greedy"]
    ll = 0.0
    for lp in lps:
        ll += lp
    return {"token_ids": row["prompt_token_ids"][start:], "loglik": ll,
            "num_tokens": len(lps), "is_greedy": all(greedy)}  # fmt: skip


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # ties: the first


def cut(text: str, until) -> str:
    """`text` before the first occurrence of any stop string."""
    for stop in until:
        text = text.split(stop, 1)[0]
    return text


def extract(task: TaskSpec, text: str) -> str | None:
    """The answer in `text`: the first match of answer_regex (its first group, if any), else the
    whole text; None when the regex does not match."""
    if task.answer_regex is None:
        return text.strip()
    m = re.search(task.answer_regex, text)
    if m is None:
        return None
    return (m.group(1) if m.groups() else m.group(0)).strip()


def is_match(task: TaskSpec, answer: str | None, gold: str | None) -> bool:
    if answer is None or gold is None:
        return False
    if task.match == "math":
        from math_verify import parse, verify

        return bool(verify(parse(gold), parse(answer)))
    for s in task.ignore:
        answer, gold = answer.replace(s, ""), gold.replace(s, "")
    return answer == gold


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of n samples of which c are correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _aggregate(task: TaskSpec, recs: list[dict]) -> dict:
    ok = [r for r in recs if r["error"] is None]
    out = {"kind": task.kind, "num_items": len(recs), "num_errors": len(recs) - len(ok)}
    metrics = {}
    if task.kind == "multiple_choice":
        names = ["acc", "acc_norm"]
    elif task.kind == "generate":
        names = ["exact_match"] + [f"pass@{k}" for k in task.pass_k]
    else:
        names = []
        tokens, nbytes = sum(r["num_tokens"] for r in ok), sum(r["num_bytes"] for r in ok)
        ll = sum(r["loglik"] for r in ok)
        metrics["perplexity"] = {"value": math.exp(-ll / tokens) if tokens else None,
                                 "stderr": None}  # fmt: skip
        metrics["bits_per_byte"] = {"value": -ll / nbytes / math.log(2) if nbytes else None,
                                    "stderr": None}  # fmt: skip
    for name in names:
        metrics[name] = mean_stderr([r[name] for r in ok])
    out["metrics"] = metrics
    return out


def _aggregate_groups(task: TaskSpec, recs: list[dict]) -> dict:
    """Each group's metrics over its own items, and the task's metrics pooled from them."""
    by_group = defaultdict(list)
    for r in recs:
        by_group[r["group"]].append(r)
    groups = {g: _aggregate(task, by_group[g]) for g in sorted(by_group)}
    sizes = [t["num_items"] - t["num_errors"] for t in groups.values()]
    names = next(iter(groups.values()))["metrics"]
    metrics = {name: pool_groups([t["metrics"][name] for t in groups.values()], sizes)
               for name in names}  # fmt: skip
    return {"kind": task.kind, "num_items": len(recs),
            "num_errors": sum(t["num_errors"] for t in groups.values()), "metrics": metrics,
            "group_by": task.group_by, "groups": groups}  # fmt: skip


def pool_groups(metrics: list[dict], sizes: list[int]) -> dict:
    """lm-eval's score of a group from its subtasks' metrics ({value, stderr}, a mean each) and
    scored item counts, as lm-eval 0.4.9 pools its mmlu: the mean weighted by size
    (`aggregate_subtask_metrics`, weight_by_size) and the pooled standard error
    (`pooled_sample_stderr`), in their order of operations. A subtask with no scored item is
    left out; None where nothing is left (value) or no degree of freedom is (stderr)."""
    parts = [(m, n) for m, n in zip(metrics, sizes) if n]
    total = sum(n for _, n in parts)
    if not total:
        return {"value": None, "stderr": None}
    value = sum(m["value"] * n for m, n in parts) / total
    if total == len(parts):  # one item per subtask: no variance within any of them
        return {"value": value, "stderr": None}
    # stderr is None only for a subtask of one item, whose term (n - 1 = 0) vanishes anyway
    var = sum((n - 1) * (m["stderr"] or 0.0) ** 2 * n for m, n in parts) / (total - len(parts))
    return {"value": value, "stderr": math.sqrt(var / total)}


def mean_stderr(values: list[float]) -> dict:
    """Mean and its standard error (sample standard deviation / sqrt(n))."""
    n = len(values)
    if n == 0:
        return {"value": None, "stderr": None}
    mean = sum(values) / n
    if n == 1:
        return {"value": mean, "stderr": None}
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return {"value": mean, "stderr": math.sqrt(var / n)}


def format_table(results: dict) -> str:
    """One line per (task, metric), then per (group, metric) of a grouped task: value, standard
    error, items, errors."""
    lines = [f"{'task':<24} {'metric':<14} {'value':>10} {'stderr':>10} {'items':>7} {'errors':>7}"]
    for name, t in results["tasks"].items():
        rows = [(name, t)] + [(f" - {g}", sub) for g, sub in t.get("groups", {}).items()]
        for label, r in rows:
            for metric, m in r["metrics"].items():
                value = "-" if m["value"] is None else f"{m['value']:.4f}"
                err = "-" if m["stderr"] is None else f"{m['stderr']:.4f}"
                lines.append(f"{label:<24} {metric:<14} {value:>10} {err:>10} "
                             f"{r['num_items']:>7} {r['num_errors']:>7}")  # fmt: skip
    return "\n".join(lines)
