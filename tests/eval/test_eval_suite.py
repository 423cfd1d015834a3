"""Suite files, request building and scoring without a model: bad input is named, a bad item
fails alone, tokenization and rolling windows cover what they must, metrics are right."""

import json
from pathlib import Path

import pytest

from k3batch.eval.requests import build_requests, encode_pair, rolling_windows
from k3batch.eval.score import cut, pass_at_k, score
from k3batch.eval.suite import load_suite

EVALS = Path(__file__).parents[2] / "evals"


def _write(tmp_path, text: str, rows=None) -> Path:
    rows = rows or [{"q": "one", "choices": ["a", "b"], "answer": 1}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(text)
    return tmp_path / "s.yaml"


MC = ("name: t\nkind: multiple_choice\ndata: d.jsonl\nprompt: '{{ q }}'\nchoices: choices\n"
      "gold: answer\n")


@pytest.mark.parametrize(
    "text,match",
    [
        (MC + "promt: x\n", "unknown field.*promt"),
        (MC.replace("d.jsonl", "nothere.jsonl"), "data file .*nothere.jsonl.* does not exist"),
        (MC.replace("{{ q }}", "{{ question }}"),
         r"prompt uses \['question'\].*columns: \['answer'"),
        (MC.replace("gold: answer", "gold: label"), r"gold uses \['label'\]"),
        (MC.replace("multiple_choice", "ranking"), "kind"),
        (MC + "num_fewshot: 2\n", "num_fewshot = 2 needs fewshot_data"),
        (MC + "max_gen_toks: '9'\n", "max_gen_toks = '9' \\(str\\)"),
        (MC.replace("'{{ q }}'", "'{{ q '"), "prompt: template error"),
        ("name: t\nkind: generate\ndata: d.jsonl\nprompt: x\n", "needs `target`"),
        ("name: t\nkind: generate\ndata: d.jsonl\nprompt: x\ntarget: y\nanswer_regex: '(('\n",
         "answer_regex"),
        ("- just a list\n", "top level must be a mapping"),
        ("name: [unclosed\n", "s.yaml"),
    ],
    ids=["unknown-field", "missing-data", "template-variable", "expression-variable", "kind",
         "fewshot", "type", "syntax", "no-target", "regex", "not-a-mapping", "yaml-syntax"],
)  # fmt: skip
def test_bad_suites_are_named(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_suite(_write(tmp_path, text))


def test_shipped_templates_parse(tmp_path):
    """The templates in evals/ load once their data exists (rows shaped like the real sets)."""
    rows = {
        "gsm8k": {"question": "q", "answer": "a\n#### 1"},
        "mmlu": {"question": "q", "subject": "s", "choices": ["a", "b", "c", "d"], "answer": 0},
        "arc_challenge": {"question": "q", "answerKey": "B",
                          "choices": {"text": ["a", "b"], "label": ["A", "B"]}},
        "hellaswag": {"activity_label": "x", "ctx_a": "y", "ctx_b": "z", "endings": ["a", "b"],
                      "label": "1"},
    }  # fmt: skip
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    for name, row in rows.items():
        raw = yaml.safe_load((EVALS / f"{name}.yaml").read_text())
        for key in ("data", "fewshot_data"):
            if key in raw:
                raw[key] = str(tmp_path / f"{name}_{key}.parquet")
                pq.write_table(pa.Table.from_pylist([row] * 8), raw[key])
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        suite = load_suite(tmp_path / f"{name}.yaml")
        assert suite.tasks[0].name == name
    assert len(load_suite(EVALS / "tiny.yaml").tasks) == 3


def test_a_bad_item_fails_alone(tmp_path, tok):
    rows = [{"q": "one", "choices": ["a", "b"], "answer": 1},
            {"q": "two", "choices": ["a", "b"], "answer": 5},
            {"q": None, "choices": "not a list", "answer": 0}]  # fmt: skip
    table = build_requests(load_suite(_write(tmp_path, MC, rows)), tok, 128)
    errors = table.column("prep_error").to_pylist()
    assert table.num_rows == 4 and errors[:2] == [None, None]
    assert "not an index of the 2 choices" in errors[2] and "not a non-empty list" in errors[3]
    assert table.column("prompt_token_ids").to_pylist()[2] is None


def test_continuation_tokens_follow_the_context(tok):
    ctx, cont = encode_pair(tok, "Answer: ", "blue")  # the trailing space moves on
    assert ctx[0] == tok.bos_token_id and ctx[1:] == tok.encode("Answer:")
    assert ctx + cont == tok.encode("Answer: blue", add_bos=True)


@pytest.mark.parametrize("n,max_len", [(2, 2), (10, 4), (17, 5), (9, 100)])
def test_rolling_windows_score_every_token_once(n, max_len):
    ids = list(range(n))
    scored = []
    for prompt, start in rolling_windows(ids, max_len):
        assert len(prompt) <= max_len and start == 1
        pos = ids.index(prompt[0])
        scored += ids[pos + start : pos + len(prompt)]
    assert scored == ids[1:]


def test_metrics():
    assert cut("4 apples\n\nQuestion: x", ["Question:", "\n\n"]) == "4 apples"
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_scoring_multiple_choice_and_errors(tmp_path):
    suite = load_suite(_write(tmp_path, MC))

    def row(item, sub, lps, error=None):
        return {"id": f"t/{item:06d}/{sub:03d}", "task": "t", "item": item, "sub": sub,
                "prompt_token_ids": [1, 2, 3], "prompt_logprobs_start": 1,
                "prompt_logprobs": lps, "prompt_greedy": [True] * len(lps), "gold": 1,
                "choice_bytes": 4 * len(lps), "error": error, "prep_error": None}  # fmt: skip

    rows = [row(0, 1, [-1.0, -1.5]), row(0, 0, [-2.0]), row(1, 0, [-1.0]),
            row(1, 1, [-3.0], error="boom")]  # fmt: skip
    results, records = score(suite, rows, {"t": 3})
    t = results["tasks"]["t"]
    assert t["num_items"] == 3 and t["num_errors"] == 2
    assert records[0]["pred"] == 0 and records[0]["pred_norm"] == 1  # -2/4 < -2.5/8
    assert t["metrics"]["acc"]["value"] == 0.0 and t["metrics"]["acc_norm"]["value"] == 1.0
    assert records[1]["error"] == "boom" and "incomplete" in records[2]["error"]
    assert "groups" not in t and "group" not in records[0]  # only a task with group_by has them


def test_scoring_generations(tmp_path):
    gen = ("name: g\nkind: generate\ndata: d.jsonl\nprompt: '{{ q }}'\ntarget: ' #### 1,000'\n"
           "until: ['Q:']\nnum_samples: 3\npass_k: [1, 2]\nanswer_regex: '#### (\\S+)'\n"
           "ignore: [',']\n")  # fmt: skip
    suite = load_suite(_write(tmp_path, gen))
    texts = [" #### 1000 Q: #### 7", " #### 7", " no answer"]
    rows = [{"id": f"g/000000/{s:03d}", "task": "g", "item": 0, "sub": s, "target": " #### 1,000",
             "generated_text": t, "output_token_ids": [1], "error": None, "prep_error": None}
            for s, t in enumerate(texts)]  # fmt: skip
    results, (rec,) = score(suite, rows, {"g": 1})
    assert [s["answer"] for s in rec["samples"]] == ["1000", "7", None]
    assert rec["exact_match"] == pytest.approx(1 / 3) and rec["pass@2"] == pytest.approx(2 / 3)
    m = results["tasks"]["g"]["metrics"]
    assert set(m) == {"exact_match", "pass@1", "pass@2"}


def test_math_equivalence(tmp_path):
    pytest.importorskip("math_verify")
    from k3batch.eval.score import is_match

    text = "name: g\nkind: generate\ndata: d.jsonl\nprompt: x\ntarget: y\nmatch: math\n"
    (task,) = load_suite(_write(tmp_path, text)).tasks
    assert is_match(task, "0.5", "1/2") and not is_match(task, "0.4", "1/2")
