"""Multiple-choice `acc_norm` divides each choice's log-likelihood by the UTF-8 bytes of its
continuation (the leading space included), the definition `k3batch/eval/score.py` documents.

The item's choices are picked so that bytes, tokens, characters and no division at all each
pick a different answer: the test fails when `_record` divides by the choice's tokens
(`c["num_tokens"]`), when request building counts characters (`len(text)`) or tokens
(`len(cont)`) as `choice_bytes`, or when acc_norm is acc. The k3-debug tokenizer has no merges
(one token per byte), so a tokenizer with merges is written here.
"""

import json

import pytest

from k3batch.eval.requests import build_requests
from k3batch.eval.score import score
from k3batch.eval.suite import load_suite
from k3batch.tokenizer import Tokenizer, write_tiny_tokenizer

# continuation, its tokens under the merging tokenizer, its log-likelihood
CHOICES = [(" the", 1, -3.0), (" ééé", 7, -5.0), (" über", 5, -4.0)]
# per byte:  -3/4 = -0.75, -5/7 = -0.714, -4/6 = -0.667 -> " über" (2)
# per token: -3/1,         -5/7 = -0.714, -4/5 = -0.8   -> " ééé" (1)
# per char:  -3/4 = -0.75, -5/4 = -1.25,  -4/5 = -0.8   -> " the" (0), as without dividing


@pytest.fixture(scope="module")
def merging_tok(tmp_path_factory):
    """The tiny Kimi-style tokenizer with learned merges (" the" is one token)."""
    path = tmp_path_factory.mktemp("tok-merges")
    write_tiny_tokenizer(path, vocab_size=704, bos_token_id=656, eos_token_id=658,
                         pad_token_id=703)  # fmt: skip
    return Tokenizer.from_dir(path)


def test_acc_norm_divides_by_utf8_bytes_of_the_continuation(tmp_path, merging_tok):
    item = {"q": "Pick one:", "choices": [c[1:] for c, _, _ in CHOICES], "answer": 2}
    (tmp_path / "d.jsonl").write_text(json.dumps(item) + "\n")
    (tmp_path / "s.yaml").write_text(
        "name: t\nkind: multiple_choice\ndata: d.jsonl\nprompt: '{{ q }}'\nchoices: choices\n"
        "gold: answer\n"
    )
    suite = load_suite(tmp_path / "s.yaml")
    rows = build_requests(suite, merging_tok, 128).to_pylist()
    assert [r["choice_bytes"] for r in rows] == [4, 7, 6]
    for row, (_, num_tokens, loglik) in zip(rows, CHOICES):
        scored = len(row["prompt_token_ids"]) - row["prompt_logprobs_start"]
        assert scored == num_tokens  # the case needs these token counts
        # the whole log-likelihood on the first token, exact in binary
        lps = [loglik] + [0.0] * (num_tokens - 1)
        row |= {"prompt_logprobs": lps, "prompt_greedy": [False] * num_tokens, "error": None}
    results, records = score(suite, rows, {"t": 1})
    rec = records[0]
    assert (rec["pred"], rec["pred_norm"], rec["gold"]) == (0, 2, 2)
    assert [c["loglik"] for c in rec["choices"]] == [ll for _, _, ll in CHOICES]
    metrics = results["tasks"]["t"]["metrics"]
    assert metrics["acc"]["value"] == 0.0 and metrics["acc_norm"]["value"] == 1.0
