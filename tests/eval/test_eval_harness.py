"""The lm-eval backend through lm-eval's own API (`simple_evaluate` on local task YAMLs, tiny
data made here, offline): its log-likelihoods equal `k3batch eval`'s for the same prompts
(bit for bit: the same token ids, the same settings), rolling log-likelihoods too, and
`generate_until` honours `until` and `max_gen_toks`."""

import json
from concurrent.futures import ThreadPoolExecutor

import pyarrow.parquet as pq
import pytest

from k3batch.eval import load_suite, run_eval

pytest.importorskip("lm_eval", reason="the lm-eval backend needs k3batch[eval]")

TASKS = """
task: k3_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {items}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}]
---
task: k3_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {items}}}}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs: {{until: ["e"], max_gen_toks: 5}}
metric_list: [{{metric: exact_match}}]
---
task: k3_docs
dataset_path: json
dataset_kwargs: {{data_files: {{test: {docs}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: bits_per_byte}}]
"""


def test_backend_matches_k3batch_eval(cluster, shallow_ckpt, tmp_path, monkeypatch, make_job,
                                      make_mc_suite):  # fmt: skip
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_CACHE", str(tmp_path / "hf")),
                        ("HF_HOME", str(tmp_path / "hf"))):  # fmt: skip
        monkeypatch.setenv(name, value)
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from k3batch.eval.harness import K3LM

    make_mc_suite(tmp_path / "suite", 6, num_fewshot=0)
    docs = tmp_path / "suite" / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "red cat " * n}) + "\n" for n in (3, 40, 90)))
    (tmp_path / "suite" / "both.yaml").write_text(
        "name: both\ntasks: [suite.yaml, {name: docs, kind: loglikelihood_rolling, "
        "data: docs.jsonl, prompt: '{{ text }}'}]\n"
    )
    # k3batch eval's own run goes on beside lm-eval's (each job starts its own replica)
    with ThreadPoolExecutor(1) as pool:
        ours = pool.submit(run_eval, load_suite(tmp_path / "suite" / "both.yaml"),
                           make_job(shallow_ckpt, tmp_path / "ours", "ours"))  # fmt: skip
        tasks = tmp_path / "tasks"
        tasks.mkdir()
        for i, text in enumerate(TASKS.format(items=tmp_path / "suite" / "items.jsonl",
                                              docs=docs).split("---")):  # fmt: skip
            (tasks / f"task{i}.yaml").write_text(text)
        lm = K3LM(make_job(shallow_ckpt, tmp_path / "lm", "lm"))
        results = lm_eval.simple_evaluate(
            model=lm, tasks=["k3_mc", "k3_gen", "k3_docs"], task_manager=TaskManager(
                include_path=str(tasks), include_defaults=False),  # not lm-eval's ~10k task files
            log_samples=True, bootstrap_iters=0,
        )  # fmt: skip
        assert lm.calls == 3  # one batch job per request type
    ours = ours.result()
    samples = results["samples"]
    by_item = {(r["task"], r["item"]): r for r in ours.records}
    for s in samples["k3_mc"]:
        want = [c["loglik"] for c in by_item[("mc", s["doc_id"])]["choices"]]
        assert [r[0][0] for r in s["resps"]] == want  # bit for bit
    for s in samples["k3_docs"]:
        assert s["resps"][0][0] == by_item[("docs", s["doc_id"])]["loglik"]
    assert results["results"]["k3_mc"]["acc,none"] == ours.results["tasks"]["mc"]["metrics"][
        "acc"]["value"]  # fmt: skip
    for s in samples["k3_gen"]:
        assert "e" not in s["resps"][0][0]
    raw = _raw_generations(tmp_path / "lm")
    assert raw and all(len(ids) <= 5 for _, ids in raw)  # max_gen_toks
    # until: the engine stops at the token that completes the stop string, the text is cut
    prompt = json.loads((tmp_path / "suite" / "items.jsonl").read_text().splitlines()[0])
    ctx = f"Question: {prompt['question']}\nAnswer:"

    def generate(until):
        args = (ctx, {"until": until, "max_gen_toks": 16})
        (text,) = lm.generate_until([Instance("generate_until", {}, args, 0)])
        (row,) = pq.read_table(_job_dir(tmp_path / "lm", until) / "records").to_pylist()
        return text, row

    free, free_row = generate([])
    stop = next(c for c in free[1:] if c.isascii() and c.isprintable() and c != " ")
    got, row = generate([stop])
    assert got == free[: free.index(stop)]
    assert row["finish_reason"] == "stop" and stop in row["generated_text"]
    ids = row["output_token_ids"]  # what the engine generated before it stopped
    assert ids == free_row["output_token_ids"][: len(ids)] and len(ids) <= 16


def _job_dir(folder, until):
    """The folder of the one-request generate_until job with these stop strings."""
    for out in folder.glob("generate_until-*"):
        rows = pq.read_table(out / "requests.parquet").to_pylist()
        if len(rows) == 1 and (rows[0]["stop"] or []) == until:
            return out
    raise AssertionError(f"no generate_until job with until {until!r}")


def _raw_generations(folder):
    (out,) = folder.glob("generate_until-*")
    rows = pq.read_table(out / "records").to_pylist()
    return [(r["generated_text"], r["output_token_ids"]) for r in rows]
