"""The shipped templates against lm-evaluation-harness's task definitions, on made-up rows:
HellaSwag's cleaned context and endings (lm-eval's hellaswag `process_docs`), MMLU's prompt
(the subject in the description, the first examples of the item's own subject) and its scores
(per subject, and the group score weighted by subject size as lm-eval's mmlu group)."""

import json
import math
from pathlib import Path

import pytest
import yaml

from k3batch.eval.requests import build_requests, fewshot_texts, item_context
from k3batch.eval.score import pool_groups, score
from k3batch.eval.suite import evaluate, load_suite

EVALS = Path(__file__).parents[2] / "evals"


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _shipped(tmp_path, name: str, data: list[dict], fewshot: list[dict] | None = None):
    """The suite of evals/{name}.yaml with its data files replaced by `data` and `fewshot`."""
    raw = yaml.safe_load((EVALS / f"{name}.yaml").read_text())
    raw["data"] = _jsonl(tmp_path / "data.jsonl", data)
    if fewshot is not None:
        raw["fewshot_data"] = _jsonl(tmp_path / "dev.jsonl", fewshot)
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    return load_suite(tmp_path / f"{name}.yaml")


# A WikiHow-style row: " [title]" joins two sentences, "[header]", "[step]" and "[substeps]" are
# markers to drop, and what they leave behind doubles some spaces.
HELLASWAG_ROW = {
    "activity_label": "Home and Garden",
    "ctx_a": "[header] How to repot a fern [title] Water the fern a day ahead.",
    "ctx_b": "then [step] lift it out of its pot",
    "endings": ["[substeps] Loosen the roots  gently.", " Throw the pot [title] away. ",
                "Paint the fern.", "[step] Sing to it."],
    "label": "0",
}  # fmt: skip


def _hellaswag(tmp_path) -> tuple[str, list[str]]:
    (task,) = _shipped(tmp_path, "hellaswag", [HELLASWAG_ROW]).tasks
    context = item_context(task, HELLASWAG_ROW, fewshot_texts(task))
    return context, evaluate(task.choices, HELLASWAG_ROW)


def test_hellaswag_template_cleans_the_text(tmp_path):
    """Worked by hand from lm-eval's `preprocess`: strip, " [title]" -> ". ", markers dropped,
    double spaces halved once (so an ending that began with a marker keeps a leading space)."""
    context, choices = _hellaswag(tmp_path)
    assert context == ("Home and Garden: How to repot a fern. Water the fern a day ahead. "
                       "Then lift it out of its pot")  # fmt: skip
    assert choices == [" Loosen the roots gently.", "Throw the pot. away.", "Paint the fern.",
                       " Sing to it."]  # fmt: skip


def test_hellaswag_template_matches_lm_eval(tmp_path):
    utils = pytest.importorskip("lm_eval.tasks.hellaswag.utils")
    import datasets

    (doc,) = utils.process_docs(datasets.Dataset.from_list([HELLASWAG_ROW]))
    assert _hellaswag(tmp_path) == (doc["query"], doc["choices"])


# MMLU-style rows of three subjects. The dev file interleaves the subjects and holds 6 rows of
# high_school_physics, so "the first 5 of the item's subject" is a choice.
SUBJECTS = ("abstract_algebra", "astronomy", "high_school_physics")
DEV = [{"question": f"{s} dev {k}", "subject": s, "choices": ["w", "x", "y", "z"],
        "answer": k % 4} for k in range(5) for s in SUBJECTS]  # fmt: skip
DEV.append({"question": "physics dev 5", "subject": "high_school_physics",
            "choices": ["w", "x", "y", "z"], "answer": 0})  # fmt: skip
ITEMS = {"abstract_algebra": 2, "astronomy": 4, "high_school_physics": 4}  # items per subject
TEST = [{"question": f"  What is {s} question {k}?\n", "subject": s,
         "choices": ["one", "two", "three", "four"], "answer": 1}
        for s, n in ITEMS.items() for k in range(n)]  # fmt: skip


def test_mmlu_prompt_names_the_subject_and_takes_its_first_examples(tmp_path):
    (task,) = _shipped(tmp_path, "mmlu", TEST, DEV).tasks
    row = TEST[-1]  # high_school_physics question 3
    example = "high_school_physics dev {k}\nA. w\nB. x\nC. y\nD. z\nAnswer: {letter}\n\n"
    expected = (
        "The following are multiple choice questions (with answers) about high school physics."
        "\n\n"
        + "".join(example.format(k=k, letter="ABCDA"[k]) for k in range(5))
        + "What is high_school_physics question 3?\nA. one\nB. two\nC. three\nD. four\nAnswer:"
    )
    assert item_context(task, row, fewshot_texts(task)) == expected


def test_mmlu_scores_each_subject_and_the_group_by_size(tmp_path, tok):
    """Predictions per subject: algebra 1 of 2 right, astronomy 3 of 3 (a fourth item failed),
    physics 1 of 4. By hand: acc 1/2, 1, 1/4; the group's acc (1/2 * 2 + 1 * 3 + 1/4 * 4) / 9
    = 5/9 (the plain mean of the three would be 7/12). Standard errors 1/2, 0, 1/4 (sample
    standard deviation / sqrt(n)); pooled: sqrt((1 * 2 * 1/4 + 2 * 3 * 0 + 3 * 4 * 1/16)
    / (9 - 3) / 9)."""
    suite = _shipped(tmp_path, "mmlu", TEST, DEV)
    table = build_requests(suite, tok, 1024)
    assert table.column("prep_error").null_count == table.num_rows
    right = [True, False] + [True, True, True, None] + [True, False, False, False]  # None: error
    rows = []
    for r in table.to_pylist():
        pred = r["gold"] if right[r["item"]] else (r["gold"] + 1) % 4
        error = "boom" if right[r["item"]] is None and r["sub"] == 2 else None
        rows.append(r | {"prompt_logprobs": [-1.0 if r["sub"] == pred else -2.0],
                         "prompt_greedy": [True], "error": error})  # fmt: skip
    groups = {"mmlu": {r["item"]: r["group"] for r in rows}}
    results, records = score(suite, rows, {"mmlu": len(TEST)}, groups)

    t = results["tasks"]["mmlu"]
    assert t["group_by"] == "subject" and list(t["groups"]) == list(SUBJECTS)
    assert (t["num_items"], t["num_errors"]) == (10, 1)
    per_subject = {g: (s["num_items"], s["num_errors"], s["metrics"]["acc"])
                   for g, s in t["groups"].items()}  # fmt: skip
    assert per_subject == {
        "abstract_algebra": (2, 0, {"value": 0.5, "stderr": 0.5}),
        "astronomy": (4, 1, {"value": 1.0, "stderr": 0.0}),
        "high_school_physics": (4, 0, {"value": 0.25, "stderr": 0.25}),
    }
    acc = t["metrics"]["acc"]
    assert acc["value"] == pytest.approx(5 / 9, abs=1e-15)
    assert acc["stderr"] == pytest.approx(math.sqrt((0.5 + 0.75) / 6 / 9), abs=1e-15)
    assert [r["group"] for r in records] == [r["subject"] for r in TEST]


def test_group_score_matches_lm_eval_functions():
    metrics_mod = pytest.importorskip("lm_eval.api.metrics")
    values, stderrs, sizes = [0.5, 1.0, 0.25, 0.7], [0.5, 0.0, 0.25, 0.1], [2, 3, 4, 11]
    pooled = pool_groups([{"value": v, "stderr": s} for v, s in zip(values, stderrs)], sizes)
    assert pooled["value"] == metrics_mod.aggregate_subtask_metrics(values, sizes, True)
    assert pooled["stderr"] == metrics_mod.pooled_sample_stderr(stderrs, sizes)


@pytest.mark.parametrize(
    "extra,rows,match",
    [
        ("group_by: q\nfewshot_data: d.jsonl\nnum_fewshot: 2\n",
         [{"q": "a"}, {"q": "a"}, {"q": "b"}], r"fewer rows in fewshot_data: 'b' \(1\)"),
        ("group_by: q\n", [{"q": "a"}, {"p": "b"}], "group_by on row 1 of .*d.jsonl"),
        ("group_by: subject\n", [{"q": "a"}], r"group_by uses \['subject'\]"),
    ],
    ids=["group-short-of-examples", "row-without-group", "group-column-missing"],
)  # fmt: skip
def test_bad_groups_are_named(tmp_path, extra, rows, match):
    _jsonl(tmp_path / "d.jsonl", [r | {"choices": ["x", "y"], "answer": 0} for r in rows])
    (tmp_path / "s.yaml").write_text("name: t\nkind: multiple_choice\ndata: d.jsonl\n"
                                     "prompt: '{{ q }}'\nchoices: choices\ngold: answer\n" + extra)
    with pytest.raises(ValueError, match=match):
        load_suite(tmp_path / "s.yaml")


def test_rolling_task_cannot_be_grouped(tmp_path):
    _jsonl(tmp_path / "d.jsonl", [{"text": "a b c", "source": "x"}])
    (tmp_path / "s.yaml").write_text("name: t\nkind: loglikelihood_rolling\ndata: d.jsonl\n"
                                     "prompt: '{{ text }}'\ngroup_by: source\n")  # fmt: skip
    with pytest.raises(ValueError, match="group_by: a rolling task"):
        load_suite(tmp_path / "s.yaml")
