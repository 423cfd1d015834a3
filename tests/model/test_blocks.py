"""Model blocks against direct transcriptions of the spec: MLA absorbed vs expanded, Block
AttnRes dataflow (spec sections 2 and 3), router selection vs weights (6.3), SiTU (6.1)."""

import math

import pytest
import torch

from k3batch.model.attn_res import attn_res_mix
from k3batch.model.forward_batch import ForwardBatch
from k3batch.model.layers import gated_act


def test_mla_absorbed_decode_matches_expanded(model_factory):
    model = model_factory("k3-debug")
    attn = model.model.layers["3"].self_attn
    S, D = 9, model.config.hidden_size
    x = torch.randn(S, D)
    q, latent, _ = attn.project(x)
    expanded = attn.attend_expanded(q, latent, 0)  # causal over all S
    mask = torch.zeros(1, S, dtype=torch.bool)
    absorbed = attn.attend_absorbed(q[-1:], latent[None], mask)
    torch.testing.assert_close(absorbed[0], expanded[-1], rtol=0, atol=1e-5)


def test_mla_uses_no_position_encoding(model_factory):
    """NoPE: permuting the cached keys/values of earlier tokens leaves the last output unchanged."""
    attn = model_factory("k3-debug").model.layers["3"].self_attn
    x = torch.randn(6, 64)
    q, latent, _ = attn.project(x)
    mask = torch.zeros(1, 6, dtype=torch.bool)
    out = attn.attend_absorbed(q[-1:], latent[None], mask)
    perm = torch.tensor([3, 0, 4, 1, 2, 5])
    out_p = attn.attend_absorbed(q[-1:], latent[perm][None], mask)
    torch.testing.assert_close(out, out_p, rtol=0, atol=1e-6)


def _spec_attn_res(V_list, w, gamma, eps=1e-5):
    """Spec section 3, token by token and candidate by candidate."""
    T = V_list[0].shape[0]
    out = torch.empty_like(V_list[0])
    for t in range(T):
        scores = []
        for Vj in V_list:
            v = Vj[t].double()
            r = (v.pow(2).mean() + eps) ** -0.5
            scores.append(float((gamma.double() * w.double() * v * r).sum()))
        m = max(scores)
        e = [math.exp(s - m) for s in scores]
        alpha = [x / sum(e) for x in e]
        out[t] = sum(a * Vj[t].double() for a, Vj in zip(alpha, V_list)).float()
    return out


def test_attn_res_mix_matches_spec_equations():
    g = torch.Generator().manual_seed(0)
    V = [torch.randn(3, 16, generator=g) * (j + 1) for j in range(4)]
    w, gamma = torch.randn(16, generator=g), torch.randn(16, generator=g)
    torch.testing.assert_close(attn_res_mix(V, w[None], gamma, 1e-5), _spec_attn_res(V, w, gamma))


@torch.no_grad()
def test_model_dataflow_matches_spec_section_2(model_factory):
    """A transcription of spec section 2 (bank, partial sum, block boundaries every 12 layers,
    9 candidates at the output) built from the model's own sublayers, against forward().
    MoE routes are pinned to forward()'s: the transcription mixes in fp64, and one flipped
    top-k choice on a near-tie would swamp everything downstream."""
    model = model_factory("k3-debug")
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(0))
    run = ForwardBatch.fresh([7])
    run.routes_out = {}
    out = model.forward_batch(ids, run, all_logits=True)
    batch = ForwardBatch.fresh([7])
    batch.pinned_routes = run.routes_out

    def agg(bank, p, proj, norm):
        cands = bank + [p]
        return _spec_attn_res(cands, proj.weight[0], norm.weight) if bank else p

    e = model.model.embed_tokens(ids)
    bank, p = [], e
    for i in range(cfg.num_hidden_layers):
        L = model.model.layers[str(i)]
        h = agg(bank, p, L.self_attention_res_proj, L.self_attention_res_norm)
        if i % 12 == 0:
            bank, p = bank + [p], None
        a = L.self_attn(L.input_layernorm(h), batch)
        p = a if p is None else p + a
        h2 = agg(bank, p, L.mlp_res_proj, L.mlp_res_norm)
        p = p + L.ffn(L.post_attention_layernorm(h2), batch)
    assert len(bank) == 8  # b_0 .. b_7; p is b_8
    h = agg(bank, p, model.model.output_attn_res_proj, model.model.output_attn_res_norm)
    ref = model.lm_head(model.model.norm(h))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-3)


def test_router_selects_with_bias_weights_without(model_factory):
    moe = model_factory("k3-debug").model.layers["1"].block_sparse_moe
    router = moe.gate
    x = torch.randn(50, 64)
    with torch.no_grad():
        ids, w = router(x)
        scores = torch.sigmoid(x @ router.weight.t())
        biased = torch.topk(scores + router.e_score_correction_bias, 2).indices
        unbiased = torch.topk(scores, 2).indices
    assert torch.equal(ids.sort(-1).values, biased.sort(-1).values)
    assert not torch.equal(biased.sort(-1).values, unbiased.sort(-1).values)  # bias matters
    expect = scores.gather(-1, ids)
    torch.testing.assert_close(w, expect / expect.sum(-1, keepdim=True))  # unbiased weights
    pinned = torch.zeros(50, 2, dtype=torch.long)
    pinned[:, 1] = 5
    ids_p, w_p = router(x, pinned)
    assert torch.equal(ids_p, pinned)


def test_routes_can_be_pinned_and_reported(model_factory):
    model = model_factory("k3-debug")
    ids = torch.randint(0, 256, (1, 6))
    free = ForwardBatch.fresh([6])
    free.routes_out = {}
    with torch.no_grad():
        ref = model.forward_batch(ids[0], free, all_logits=True)
    assert sorted(free.routes_out) == list(range(1, 93))
    pinned = ForwardBatch.fresh([6])
    pinned.pinned_routes = free.routes_out
    with torch.no_grad():
        out = model.forward_batch(ids[0], pinned, all_logits=True)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_gated_activation(act):
    g, u = torch.randn(100) * 10, torch.randn(100) * 40
    out = gated_act(torch.cat([g, u]), act)  # gate | up, as the fused GEMM writes them
    if act == "silu":
        torch.testing.assert_close(out, torch.nn.functional.silu(g) * u)
    else:
        ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
        torch.testing.assert_close(out, ref)
        assert out.abs().max() <= 4 * 25  # bounded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_bf16_scores_match_fp32_gemm():
    """The bf16 router on CUDA (one GEMM with fp32 output, no fp32 weight copy) against the
    fp32 GEMM of the same bf16 values, at K3 width: same scores to fp32 rounding, same routes."""
    from k3batch.model import get_flavor
    from k3batch.model.moe import Router

    config = get_flavor("k3-slice")
    router = Router(config, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    torch.nn.init.normal_(router.weight, std=config.hidden_size**-0.5, generator=g)
    x = torch.randn(4096, config.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    ids, w = router(x)
    ref_scores = torch.sigmoid(x.double() @ router.weight.double().t())
    ref_ids = torch.topk(ref_scores, config.num_experts_per_token, dim=-1).indices
    agree = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).float().mean().item()
    assert agree > 0.999, f"routes agree on {agree:.4%} of tokens"
    ref_w = ref_scores.gather(-1, ids)
    if router.renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    ref_w = ref_w * config.routed_scaling_factor
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-6)
