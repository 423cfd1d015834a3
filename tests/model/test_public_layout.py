"""A checkpoint in the public Kimi Linear layout (moonshotai/Kimi-Linear-48B-A3B-Instruct),
written by hand at tiny widths, loads through `load_model` unchanged and equals a K3Model given
the same tensors; k3batch's writer uses the same names, shapes and config values."""

import json

import torch
from safetensors.torch import save_file

import k3batch
from k3batch.model import K3Model
from k3batch.model.weights import INDEX_FILE, checkpoint_manifest

# config.json as moonshotai/Kimi-Linear-48B-A3B-Instruct publishes it (its keys, including those
# k3batch ignores), at tiny widths: 6 layers with MLA at 4 and 6 (1-based), 2 heads each kind.
_PUBLIC_KIMI_LINEAR_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_kimi.KimiLinearConfig",
        "AutoModel": "modeling_kimi.KimiLinearModel",
        "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
    },
    "bos_token_id": 256,
    "dtype": "bfloat16",
    "eos_token_id": 258,
    "first_k_dense_replace": 1,
    "head_dim": 72,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "kv_lora_rank": 32,
    "linear_attn_config": {
        "full_attn_layers": [4, 6],
        "head_dim": 16,
        "kda_layers": [1, 2, 3, 5],
        "num_heads": 2,
        "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True,
    "model_max_length": 1048576,
    "model_type": "kimi_linear",
    "moe_intermediate_size": 32,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 2,
    "num_expert_group": 1,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_hidden_layers": 6,
    "num_key_value_heads": 2,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 1,
    "pad_token_id": 511,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_grouped_topk": True,
    "v_head_dim": 16,
    "vocab_size": 512,
}


def _public_kimi_linear_tensors() -> dict[str, torch.Tensor]:
    """{public name: bf16 tensor} for `_PUBLIC_KIMI_LINEAR_CONFIG`, spelled out as the public
    modeling_kimi.py names its modules (not derived from k3batch's manifest)."""
    gen = torch.Generator().manual_seed(7)
    D, V, C, H, K, I, E = 64, 512, 32, 2, 16, 32, 8  # C = KDA heads x head_dim

    def w(*shape, std=None, mean=0.0):
        std = 1 / shape[-1] ** 0.5 if std is None else std
        return (torch.randn(shape, generator=gen) * std + mean).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(V, D, std=1.0)}
    for i in range(6):
        p = f"model.layers.{i}."
        if i + 1 in (4, 6):  # MLA: a single q_proj, no output gate
            t |= {
                p + "self_attn.q_proj.weight": w(2 * (16 + 8), D),
                p + "self_attn.kv_a_proj_with_mqa.weight": w(32 + 8, D),
                p + "self_attn.kv_a_layernorm.weight": w(32, std=0.1, mean=1.0),
                p + "self_attn.kv_b_proj.weight": w(2 * (16 + 16), 32),
                p + "self_attn.o_proj.weight": w(D, 2 * 16, std=0.1),
            }
        else:  # KDA
            t |= {p + f"self_attn.{x}_proj.weight": w(C, D) for x in "qkv"}
            t |= {p + f"self_attn.{x}_conv1d.weight": w(C, 1, 4, std=0.5) for x in "qkv"}
            t |= {
                p + "self_attn.A_log": torch.rand(1, 1, H, 1, generator=gen).mul(15).add(1).log(),
                p + "self_attn.dt_bias": w(C, std=0.5, mean=-1.0),
                p + "self_attn.f_a_proj.weight": w(K, D),
                p + "self_attn.f_b_proj.weight": w(C, K),
                p + "self_attn.b_proj.weight": w(H, D),
                p + "self_attn.g_a_proj.weight": w(K, D),
                p + "self_attn.g_b_proj.weight": w(C, K),
                p + "self_attn.o_norm.weight": w(K, std=0.1, mean=1.0),
                p + "self_attn.o_proj.weight": w(D, C, std=0.1),
            }
        if i == 0:  # first_k_dense_replace = 1
            t |= {p + f"mlp.{x}_proj.weight": w(96, D) for x in ("gate", "up")}
            t[p + "mlp.down_proj.weight"] = w(D, 96, std=0.05)
        else:
            m = p + "block_sparse_moe."
            t[m + "gate.weight"] = w(E, D)
            t[m + "gate.e_score_correction_bias"] = w(E, std=0.1)
            for e in range(E):
                t[m + f"experts.{e}.w1.weight"] = w(I, D)
                t[m + f"experts.{e}.w2.weight"] = w(D, I, std=0.1)
                t[m + f"experts.{e}.w3.weight"] = w(I, D)
            t |= {m + f"shared_experts.{x}_proj.weight": w(I, D) for x in ("gate", "up")}
            t[m + "shared_experts.down_proj.weight"] = w(D, I, std=0.1)
        t[p + "input_layernorm.weight"] = w(D, std=0.1, mean=1.0)
        t[p + "post_attention_layernorm.weight"] = w(D, std=0.1, mean=1.0)
    t["model.norm.weight"] = w(D, std=0.1, mean=1.0)
    t["lm_head.weight"] = w(V, D)
    return t


def test_weights_public_kimi_linear_layout_loads_unchanged(tmp_path, caplog):
    """A checkpoint in the public Kimi Linear layout (its config.json keys, per-expert bf16
    w1/w2/w3, shared_experts, A_log [1, 1, H, 1], q_proj, no AttnRes; two shards and an index)
    loads through `load_model` with no warning, to the config written out here, and its logits
    equal a K3Model given the same tensors by hand (experts stacked, w1 rows before w3):
    `torch.equal` in fp32. k3batch's own writer uses exactly these names and config values."""
    from k3batch.model.config import K3Config

    public = _public_kimi_linear_tensors()
    names = sorted(public)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    for file, part in shards.items():
        save_file({n: public[n] for n in part}, tmp_path / file, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in public.values())},
        "weight_map": {n: f for f, part in shards.items() for n in part},
    }
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(_PUBLIC_KIMI_LINEAR_CONFIG))

    with caplog.at_level("WARNING"):
        loaded = k3batch.load_model(tmp_path, dtype=torch.float32)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    want = K3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=2,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, mla_use_output_gate=False, kda_num_heads=2, kda_head_dim=16,
        gate_lower_bound=None, kda_full_rank_gate=False, kda_layers=(1, 2, 3, 5),
        full_attn_layers=(4, 6), hidden_act="silu", intermediate_size=96, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        routed_expert_hidden_size=None, latent_moe_use_norm=False, routed_scaling_factor=2.446,
        attn_res_block_size=None, bos_token_id=256, eos_token_id=258, pad_token_id=511,
    )  # fmt: skip
    assert loaded.config == want

    state = {}
    for name, t in public.items():
        if ".block_sparse_moe.experts." in name:
            continue
        state[name] = t.float().reshape(-1) if name.endswith(".A_log") else t.float()
    for i in range(1, 6):
        m = f"model.layers.{i}.block_sparse_moe.experts."
        state[m + "w13"] = torch.stack([
            torch.cat([public[m + f"{e}.w1.weight"], public[m + f"{e}.w3.weight"]]).float()
            for e in range(8)
        ])  # fmt: skip
        state[m + "w2"] = torch.stack([public[m + f"{e}.w2.weight"].float() for e in range(8)])
    ref = K3Model(want, dtype=torch.float32)
    ref.load_state_dict(state)  # strict: every parameter named above, none left over
    ref.eval()
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids), ref(ids))

    # The writer's side: the same names and shapes, and the same values for the public keys.
    manifest = checkpoint_manifest(want)
    shapes = {n: shape for n, (shape, _) in manifest.items()}
    assert shapes == {n: tuple(t.shape) for n, t in public.items()}
    written = want.to_hf()
    shared_keys = written.keys() & _PUBLIC_KIMI_LINEAR_CONFIG.keys()
    assert {k: written[k] for k in shared_keys} == {
        k: _PUBLIC_KIMI_LINEAR_CONFIG[k] for k in shared_keys
    }
    assert len(shared_keys) >= 30
