"""The single-device engine against the cache-free full forward: chunked prefill, decode steps,
mixed-length batches, sampling options and per-request errors. k3-debug and kimi-linear-debug in
fp32 on CPU. Tolerance: the random 93-layer model amplifies fp32 rounding about 1000-fold
(a 1e-6 change of the embedding moves logits by ~1e-3), so logits are compared at 2e-3 and
cache tensors at 1e-3; greedy tokens must match exactly."""

import pytest
import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import SamplingParams
from k3batch.testing import slot_batch, slot_cache, slot_tensors

ATOL = 2e-3


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(model, ids, chunk):
    cache = slot_cache(
        model.config,
        range(model.config.num_hidden_layers),
        num_slots=2,
        max_seq_len=128,
        device="cpu",
        dtype=torch.float32,
    )
    slot = 0
    rows = []
    with torch.no_grad():
        for s in range(0, len(ids), chunk):
            part = ids[s : s + chunk]
            b = slot_batch(cache, [len(part)], [s], [slot])
            rows.append(model.forward_batch(torch.tensor(part), b, cache, all_logits=True))
    return torch.cat(rows), cache, slot


_UNCHUNKED = {}  # flavor -> (full forward logits, one-chunk prefill's cache tensors)


def _unchunked(model, flavor: str, ids: list[int]):
    """The references of `test_chunked_prefill_equals_unchunked`, computed once per flavor."""
    if flavor not in _UNCHUNKED:
        with torch.no_grad():
            full = model(torch.tensor([ids]))[0]
        _, cache, slot = _prefill(model, ids, 64)
        _UNCHUNKED[flavor] = full, slot_tensors(cache, slot, len(ids))
    return _UNCHUNKED[flavor]


@pytest.mark.parametrize("flavor", ["k3-debug", "kimi-linear-debug"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(model_factory, flavor, chunk):
    model = model_factory(flavor)
    ids = _prompt(23, 1)
    full, ref = _unchunked(model, flavor, ids)
    logits, cache, slot = _prefill(model, ids, chunk)
    torch.testing.assert_close(logits, full, rtol=0, atol=ATOL)
    got = slot_tensors(cache, slot, len(ids))
    for name, layers in ref.items():
        for layer, t in layers.items():
            torch.testing.assert_close(
                got[name][layer], t, rtol=1e-3, atol=1e-3, msg=f"{name}[{layer}]"
            )


@pytest.mark.parametrize("flavor", ["k3-debug", "kimi-linear-debug"])
def test_prefill_then_decode_equals_full_forward(model_factory, flavor):
    model = model_factory(flavor)
    ids = _prompt(30, 2)
    with torch.no_grad():
        full = model(torch.tensor([ids]))[0]
    _, cache, slot = _prefill(model, ids[:12], 5)
    with torch.no_grad():
        for pos in range(12, 30):
            b = slot_batch(cache, [1], [pos], [slot])
            assert b.is_decode
            out = model.forward_batch(torch.tensor([ids[pos]]), b, cache)
            torch.testing.assert_close(out[0], full[pos], rtol=0, atol=ATOL)


GREEDY = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, logprobs=True)


def test_mixed_batch_equals_each_alone(model_factory):
    model = model_factory("k3-mini")  # batching: what depth does not change
    prompts = [_prompt(n, n) for n in (3, 17, 40, 1)]
    cfg = EngineConfig(max_num_seqs=3, max_seq_len=64, chunk_size=7, max_batch_tokens=16)
    together = Engine(model, cfg).generate(prompts, GREEDY)
    for p, res in zip(prompts, together):
        alone = Engine(model, cfg).generate([p], GREEDY)[0]
        assert alone.output_token_ids == res.output_token_ids
        torch.testing.assert_close(alone.output_logprobs, res.output_logprobs, rtol=0, atol=ATOL)


def test_last_step_says_what_it_submitted(model_factory):
    """`last_step_prefill` / `last_step_tokens`, which the step account keeps for its slowest
    steps: prompt chunks up to max_batch_tokens, then one token per decoding request."""
    eng = Engine(model_factory("k3-mini"), EngineConfig(max_seq_len=64, chunk_size=7,
                                                         max_batch_tokens=16))  # fmt: skip
    for i, n in enumerate((3, 17)):
        eng.add_request(str(i), _prompt(n, n), SamplingParams(max_new_tokens=2))
    seen = []
    while eng.has_unfinished():
        eng.step()
        seen.append((eng.last_step_prefill, eng.last_step_tokens))
    prefill = [n for p, n in seen if p]
    assert prefill[0] == 3 + 7 and sum(prefill) == 3 + 17 and max(prefill) <= 16
    # decode rows, and 0 for the overlapped decode's last step (it only takes the tokens)
    assert {n for p, n in seen if not p} == {0, 2}


def test_greedy_tokens_and_logprobs_match_full_forward(model_factory):
    model = model_factory("k3-debug")
    prompts = [_prompt(n, 10 + n) for n in (9, 20)]
    sp = SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True, prompt_logprobs=True
    )
    results = Engine(model, EngineConfig(max_seq_len=64, chunk_size=8)).generate(prompts, sp)
    for p, r in zip(prompts, results):
        seq = torch.tensor([p + r.output_token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(seq)[0], -1)
        L = len(p)
        assert r.output_token_ids == lp[L - 1 : -1].argmax(-1).tolist()
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == L
        ref_prompt = lp[: L - 1].gather(-1, seq[0, 1:L, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(r.prompt_logprobs[1:]), ref_prompt, rtol=0, atol=ATOL
        )
        ref_out = lp[L - 1 : -1].gather(-1, seq[0, L:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref_out, rtol=0, atol=ATOL)


def test_sampling_options(model_factory):
    model = model_factory("kimi-linear-debug")
    eng = lambda: Engine(model, EngineConfig(max_seq_len=64))  # noqa: E731
    p = [_prompt(6, 3)]
    greedy = eng().generate(p, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))[0]
    top1 = eng().generate(p, SamplingParams(top_k=1, max_new_tokens=8, ignore_eos=True))[0]
    tiny_p = eng().generate(p, SamplingParams(top_p=1e-6, max_new_tokens=8, ignore_eos=True))[0]
    assert greedy.output_token_ids == top1.output_token_ids == tiny_p.output_token_ids
    seeded = SamplingParams(temperature=1.5, seed=7, max_new_tokens=8, ignore_eos=True)
    a = eng().generate(p, seeded)[0].output_token_ids
    b = eng().generate([p[0], _prompt(9, 4)], [seeded, seeded])[0].output_token_ids
    assert a == b  # the seed decides, not the batch
    stop = greedy.output_token_ids[2]
    r = eng().generate(p, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop,)))[
        0
    ]
    assert r.finish_reason == "stop" and r.output_token_ids[-1] == stop
    assert greedy.finish_reason == "length" and len(greedy.output_token_ids) == 8


def test_eos_stops_unless_ignored(model_factory):
    model = model_factory("kimi-linear-debug")
    p = [_prompt(6, 3)]
    greedy = Engine(model, EngineConfig(max_seq_len=64)).generate(
        p, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    )[0]
    eos = greedy.output_token_ids[1]
    eng = Engine(model, EngineConfig(max_seq_len=64), eos_token_ids=(eos,))
    r = eng.generate(p, SamplingParams(temperature=0, max_new_tokens=8))[0]
    assert r.finish_reason == "stop" and r.output_token_ids == greedy.output_token_ids[:2]


def test_stop_strings_stop_at_the_token_that_completes_one(model_factory):
    """The engine asks its stop_check (here: each token id spells one letter) after every token
    of a request with stop strings; without a stop_check such a request is an error."""
    model = model_factory("kimi-linear-debug")
    p = [_prompt(6, 3)]
    free = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    greedy = Engine(model, EngineConfig(max_seq_len=64)).generate(p, free)[0].output_token_ids
    spell = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731
    stop = spell(greedy[2:4])  # completed by the fourth token at the latest
    n = next(i for i in range(1, 5) if stop in spell(greedy[:i]))
    eng = Engine(model, EngineConfig(max_seq_len=64),
                 stop_check=lambda strings, ids: any(s in spell(ids) for s in strings))  # fmt: skip
    (r,) = eng.generate(p, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                          stop=(stop, "never")))  # fmt: skip
    assert r.finish_reason == "stop" and r.output_token_ids == greedy[:n]
    (bad,) = Engine(model, EngineConfig(max_seq_len=64)).generate(
        p, SamplingParams(max_new_tokens=2, stop=("x",))
    )
    assert bad.finish_reason == "error" and "stop_check" in bad.error


def test_bad_requests_get_errors_and_others_go_on(model_factory):
    model = model_factory("kimi-linear-debug")
    eng = Engine(model, EngineConfig(max_seq_len=32))
    good = SamplingParams(temperature=0, max_new_tokens=2)
    cases = {
        "empty": ([], good),
        "negative": ([1, -3], good),
        "past_vocab": ([1, 512], good),
        "too_long": (list(range(40)), good),
        "temperature": ([1, 2], SamplingParams(temperature=-1)),
        "top_p": ([1, 2], SamplingParams(top_p=0)),
        "max_new": ([1, 2], SamplingParams(max_new_tokens=0)),
        "ok": ([1, 2, 3], good),
    }
    for rid, (ids, sp) in cases.items():
        eng.add_request(rid, ids, sp)
    out = {}
    while eng.has_unfinished():
        out |= {r.request_id: r for r in eng.step()}
    assert set(out) == set(cases)
    for rid in cases:
        if rid == "ok":
            assert out[rid].error is None and len(out[rid].output_token_ids) >= 1
        else:
            assert out[rid].finish_reason == "error" and out[rid].error, rid
    assert "vocabulary" in out["past_vocab"].error and "temperature" in out["temperature"].error
