"""The KDA layer against a transcription of spec section 4, and every math-changing config field
checked to reach the code that uses it.

The transcription below is written from the spec's table alone (projections, short conv, the
gate with the flavor's lower bound, beta, q/k L2 norm, the delta-rule recurrence, the gated
norm, o_proj), in fp64, token by token and head by head. It reads the layer's parameters, never
its code, so a layer that takes the wrong config key for the gate lower bound (and silently
falls back to Kimi Linear's softplus gate) fails here: change `config.gate_lower_bound` to
`getattr(config, "lower_bound", None)` in `KimiDeltaAttention.__init__` to see it.
"""

import dataclasses
import math

import pytest
import torch

from k3batch.model import K3Model
from k3batch.model.config import K3Config
from k3batch.model.forward_batch import ForwardBatch
from k3batch.model.init import init_random_

# The gate each flavor must use, from the spec (section 1.1: -5.0 for K3; 1.2: Kimi Linear has
# no lower bound and uses the softplus gate). Written out, not read from the config.
SPEC_LOWER_BOUND = {"k3-debug": -5.0, "kimi-linear-debug": None}


def _spec_kda(layer, x_TD, seq_lens, lower_bound, eps=1e-5):
    """Spec section 4 for packed sequences, each from a zero state. fp64 throughout."""
    H, K = layer.num_heads, layer.head_dim
    x = x_TD.double()
    W = lambda lin: lin.weight.double()  # noqa: E731
    out = []
    start = 0
    for n in seq_lens:
        xs = x[start : start + n]
        start += n
        # projections and the short conv: y_t[c] = SiLU(sum_j w_c[j] x_{t-3+j}[c]), zeros before 0
        qkv = []
        for proj, conv in (
            (layer.q_proj, layer.q_conv1d),
            (layer.k_proj, layer.k_conv1d),
            (layer.v_proj, layer.v_conv1d),
        ):
            pre = xs @ W(proj).t()  # [n, C]
            w = conv.weight.double()[:, 0]  # [C, Wk]; w[:, -1] multiplies the current token
            Wk = w.shape[1]
            y = torch.zeros_like(pre)
            for t in range(n):
                for j in range(Wk):
                    src = t - (Wk - 1) + j
                    if src >= 0:
                        y[t] += w[:, j] * pre[src]
            qkv.append(torch.nn.functional.silu(y).view(n, H, K))
        q, k, v = qkv
        f = (xs @ W(layer.f_a_proj).t() @ W(layer.f_b_proj).t()).view(n, H, K)
        a = layer.A_log.double()[:H].exp()[None, :, None]  # one value per head (spec 14.2)
        u = f + layer.dt_bias.double().view(H, K)[None]
        if lower_bound is None:
            g = -a * torch.nn.functional.softplus(u)
        else:
            g = lower_bound * torch.sigmoid(a * u)
        beta = torch.sigmoid(xs @ W(layer.b_proj).t())  # [n, H]
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        o = torch.zeros(n, H, K, dtype=torch.float64)
        for h in range(H):
            S = torch.zeros(K, K, dtype=torch.float64)  # [K, V]
            for t in range(n):
                S = torch.exp(g[t, h])[:, None] * S  # decay first
                delta = beta[t, h] * (v[t, h] - S.t() @ k[t, h])  # against the decayed state
                S = S + torch.outer(k[t, h], delta)
                o[t, h] = (S.t() @ q[t, h]) * K**-0.5  # read after the write
        if hasattr(layer, "g_proj"):
            z = xs @ W(layer.g_proj).t()
        else:
            z = xs @ W(layer.g_a_proj).t() @ W(layer.g_b_proj).t()
        z = z.view(n, H, K)
        rms = torch.sqrt((o * o).mean(-1, keepdim=True) + eps)
        y = o / rms * layer.o_norm.weight.double() * torch.sigmoid(z)
        out.append(y.reshape(n, H * K) @ W(layer.o_proj).t())
    return torch.cat(out)


@pytest.mark.parametrize("flavor", ["k3-debug", "kimi-linear-debug"])
def test_kda_layer_matches_spec_equations(model_factory, flavor):
    model = model_factory(flavor)
    layer = model.model.layers[str(model.config.kda_layer_ids[0])].self_attn
    g = torch.Generator().manual_seed(1)
    # Gate parameters away from their init so both gate formulas are far apart: at A_log = 0
    # and dt_bias = 0 the softplus and bounded gates still differ, but spread them anyway.
    saved = layer.A_log.detach().clone(), layer.dt_bias.detach().clone()
    with torch.no_grad():
        layer.A_log.copy_(torch.randn(layer.A_log.shape, generator=g))
        layer.dt_bias.copy_(torch.randn(layer.dt_bias.shape, generator=g))
    try:
        seq_lens = [5, 9]
        x = torch.randn(sum(seq_lens), model.config.hidden_size, generator=g)
        with torch.no_grad():
            out = layer(x, ForwardBatch.fresh(seq_lens))
        ref = _spec_kda(layer, x, seq_lens, SPEC_LOWER_BOUND[flavor])
    finally:
        with torch.no_grad():
            layer.A_log.copy_(saved[0])
            layer.dt_bias.copy_(saved[1])
    err = (out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert err < 1e-5, f"relative RMS error {err:.3e} against spec section 4"


# ---- every config field that changes the math reaches the code --------------------------------

# Fields whose value changes the numbers without changing any parameter's name or shape: a model
# built with the field perturbed, from the same weights, must give different logits.
NUMERIC = {
    "gate_lower_bound": -3.0,
    "rms_norm_eps": 0.5,
    "mla_norm_eps": 0.5,
    "situ_beta": 1.0,
    "situ_linear_beta": 2.0,
    "hidden_act": "silu",
    "routed_scaling_factor": 2.5,
    "moe_renormalize": False,
    "num_experts_per_token": 3,
    "attn_res_block_size": 5,
}
# Fields that decide which parameters exist or their shapes: a changed value must change the
# parameter set (so loading a checkpoint made for the other value fails by name or shape).
STRUCTURAL = {
    "vocab_size": 600,
    "hidden_size": 48,
    "num_hidden_layers": None,  # changed together with the layer lists below
    "num_attention_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "mla_use_output_gate": False,
    "kda_num_heads": 4,
    "kda_head_dim": 8,
    "short_conv_kernel_size": 3,
    "kda_full_rank_gate": False,
    "kda_layers": None,
    "full_attn_layers": None,
    "intermediate_size": 40,
    "first_k_dense_replace": 2,
    "num_experts": 6,
    "num_shared_experts": 0,
    "moe_intermediate_size": 16,
    "routed_expert_hidden_size": 16,
    "latent_moe_use_norm": False,
}
# Fields that are not model math: checkpoint format, token ids, an informational length.
NOT_MATH = {
    "experts_mxfp4",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
}


def _small_k3() -> K3Config:
    """k3-debug cut to 8 layers (two AttnRes blocks of 5 at block size 5, both layer kinds,
    dense and MoE FFNs): every field's effect shows, at a fraction of the time."""
    from k3batch.model import get_flavor

    return dataclasses.replace(
        get_flavor("k3-debug"),
        num_hidden_layers=8,
        kda_layers=(1, 2, 3, 5, 6, 7),
        full_attn_layers=(4, 8),
    ).validate()


def test_every_config_field_is_classified():
    fields = {f.name for f in dataclasses.fields(K3Config)}
    classified = set(NUMERIC) | set(STRUCTURAL) | NOT_MATH
    assert fields - classified == set(), "new K3Config fields: say how they reach the math"
    assert classified - fields == set()


@pytest.mark.parametrize("field", sorted(NUMERIC))
def test_numeric_config_field_reaches_the_math(field):
    base = _small_k3()
    changed = dataclasses.replace(base, **{field: NUMERIC[field]}).validate()
    assert getattr(changed, field) != getattr(base, field)
    ref_model = init_random_(K3Model(base, dtype=torch.float32), seed=0).eval()
    model = K3Model(changed, dtype=torch.float32).eval()
    model.load_state_dict(ref_model.state_dict())  # the same weights, by name and shape
    ids = torch.randint(0, base.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ref_model.forward_batch(ids, ForwardBatch.fresh([12]), all_logits=True)
        b = model.forward_batch(ids, ForwardBatch.fresh([12]), all_logits=True)
    rel = ((a - b).pow(2).mean() / a.pow(2).mean()).sqrt()
    assert math.isfinite(rel) and rel > 1e-4, f"{field} changed the logits by only {rel:.2e}"


@pytest.mark.parametrize("field", sorted(STRUCTURAL))
def test_structural_config_field_changes_the_parameters(field):
    base = _small_k3()
    if field in ("num_hidden_layers", "kda_layers", "full_attn_layers"):
        kw = dict(num_hidden_layers=7, kda_layers=(1, 2, 3, 5, 6), full_attn_layers=(4, 7))
        if field != "num_hidden_layers":  # same depth, the layer kinds swapped
            kw = dict(kda_layers=(1, 2, 4, 5, 6, 7), full_attn_layers=(3, 8))
    else:
        kw = {field: STRUCTURAL[field]}
    changed = dataclasses.replace(base, **kw).validate()
    assert getattr(changed, field) != getattr(base, field)
    shapes = lambda cfg: {  # noqa: E731
        k: tuple(v.shape) for k, v in K3Model(cfg, device="meta").state_dict().items()
    }
    assert shapes(changed) != shapes(base), f"{field} changes no parameter name or shape"
