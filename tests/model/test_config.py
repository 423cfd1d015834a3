"""Architecture counts against spec sections 8, 9 and 15; config.json parsing and validation."""

import dataclasses
import json

import pytest
import torch

from k3batch.cache.layout import CacheLayout, kda_state_bytes, mla_bytes_per_token
from k3batch.model import FLAVORS, K3Config, K3Model, get_flavor


def _meta(flavor):
    with torch.device("meta"):
        return K3Model(get_flavor(flavor))


def _count(module):
    return sum(p.numel() for p in module.parameters())


def _active(model):
    """All parameters except the embedding lookup and the unrouted experts."""
    cfg = model.config
    total = _count(model) - model.model.embed_tokens.weight.numel()
    for layer in model.model.layers.values():
        if hasattr(layer, "block_sparse_moe"):
            ex = layer.block_sparse_moe.experts
            per_expert = (ex.w1.numel() + ex.w2.numel() + ex.w3.numel()) // cfg.num_experts
            total -= (cfg.num_experts - cfg.num_experts_per_token) * per_expert
    return total


def test_k3_parameter_counts_match_spec():
    m = _meta("k3")
    layers = m.model.layers
    assert _count(layers["0"].self_attn) == 443_740_384  # A_log [96]; 443,740,416 with [128]
    assert _count(layers["0"].self_attn) + 32 == 443_740_416
    assert _count(layers["3"].self_attn) == 232_196_096
    assert _count(layers["1"].block_sparse_moe) == 29_784_936_832
    assert _count(m) == 2_779_484_476_000
    assert _count(m) + 69 * 32 == 2_779_484_478_208  # checkpoint shapes
    assert _active(m) == 104_189_612_640


@pytest.mark.parametrize(
    "flavor,total,active",
    [
        ("k3-debug", 4_288_410, 2_983_834),
        ("k3-slice", 33_388_457_552, 6_780_841_552),
        ("kimi-linear-debug", 1_490_264, 738_648),
    ],
)
def test_flavor_counts_match_spec(flavor, total, active):
    m = _meta(flavor)
    assert _count(m) == total
    assert _active(m) == active


def test_k3_debug_per_layer_counts():
    layers = _meta("k3-debug").model.layers
    assert _count(layers["1"].self_attn) == 12_338
    assert _count(layers["3"].self_attn) == 14_160
    assert _count(layers["1"].block_sparse_moe) == 32_296
    assert _count(layers["0"].mlp) == 24_576


def test_k3_schedule():
    cfg = get_flavor("k3")
    assert len(cfg.kda_layer_ids) == 69 and len(cfg.mla_layer_ids) == 24
    assert cfg.mla_layer_ids == tuple(range(3, 92, 4)) + (92,)
    assert cfg.num_attn_res_blocks == 8


def test_k3_cache_bytes_match_spec():
    cfg = get_flavor("k3")
    assert mla_bytes_per_token(cfg) == 27_648
    assert kda_state_bytes(cfg, tp_size=8) == 54_263_808
    assert kda_state_bytes(cfg) == 434_110_464
    conv_w3 = 69 * 3 * 12288 * 3 * 2  # three conv states of W-1 = 3 bf16 columns
    layout = CacheLayout.build(cfg, range(93), page_size=10, dtype_bytes=2)
    assert layout.block_bytes == 434_110_464 + conv_w3  # every segment already 256-aligned
    assert layout.token_bytes == 27_648 and layout.page_bytes == 10 * 27_648
    tp8 = CacheLayout.build(cfg, range(93), page_size=64, dtype_bytes=2, tp_size=8)
    assert tp8.block_bytes == 54_263_808 + 1_907_712


def test_hf_round_trip_all_flavors():
    for name, cfg in FLAVORS.items():
        assert K3Config.from_hf(cfg.to_hf()) == cfg, name


def test_from_hf_reads_wrapped_and_plain_forms(tmp_path):
    k3 = get_flavor("k3").to_hf()
    assert k3["model_type"] == "kimi_k3" and "text_config" in k3
    (tmp_path / "config.json").write_text(json.dumps(k3))
    assert K3Config.from_hf(tmp_path) == get_flavor("k3")
    plain = get_flavor("kimi-linear").to_hf()
    assert plain["model_type"] == "kimi_linear"
    assert K3Config.from_hf(plain) == get_flavor("kimi-linear")


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: c.update(model_type="llama"), "model_type 'llama'"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c["text_config"].update(moe_router_activation_func="softmax"), "softmax"),
        (lambda c: c["text_config"].update(num_expert_group=8), "num_expert_group"),
        (lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[1, 2]), "partition"),
        (lambda c: c["text_config"]["linear_attn_config"].update(gate_lower_bound=-7.0), "-7.0"),
        (lambda c: c["text_config"].update(num_experts_per_token=999), "num_experts_per_token"),
        (lambda c: c["text_config"].update(eos_token_id=10**6), "eos_token_id"),
        (lambda c: c["text_config"].pop("linear_attn_config"), "linear_attn_config"),
        (lambda c: c.pop("text_config"), "text_config"),
    ],
)
def test_from_hf_rejects_bad_values(edit, match):
    raw = get_flavor("k3-debug").to_hf()
    edit(raw)
    with pytest.raises(ValueError, match=match):
        K3Config.from_hf(raw)


def test_last_layer_must_be_mla():
    cfg = dataclasses.replace(
        get_flavor("k3-slice"), kda_layers=(1, 2, 3, 5, 6, 7, 8), full_attn_layers=(4,)
    )
    with pytest.raises(ValueError, match="last layer"):
        cfg.validate()


def test_unknown_flavor():
    with pytest.raises(ValueError, match="unknown flavor"):
        get_flavor("k4")
