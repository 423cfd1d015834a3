"""Checkpoint layer: write (init_checkpoint) -> load_model round trips, name and shape checks,
MXFP4 packing, the k3 manifest count, pipeline-stage loading, and a checkpoint in the public
Kimi Linear layout written by hand.

The writer stores bf16 (fp32 for A_log, dt_bias, conv weights and the correction bias), so a
checkpoint loaded in fp32 must equal the written fp32 model with its bf16 params rounded
through bf16: `torch.equal`, no tolerance (casts and MXFP4 dequantization are exact).
"""

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import k3batch
from k3batch.model import K3Model, get_flavor
from k3batch.model import weights as weights_mod
from k3batch.model.init import init_random_
from k3kernels.moe.mxfp4 import (
    dequantize_mxfp4,
    fp4_to_float,
    pack_fp4,
    quantize_mxfp4,
    unpack_fp4,
)
from k3batch.model.weights import (
    INDEX_FILE,
    checkpoint_manifest,
    init_checkpoint,
    write_checkpoint,
)

FLAVORS = ["k3-debug", "kimi-linear-debug"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{flavor: (fp32 model written, checkpoint dir)}, written once for the module."""
    out = {}
    for flavor in FLAVORS:
        path = tmp_path_factory.mktemp(flavor)
        out[flavor] = (init_checkpoint(flavor, path, seed=0), path)
    return out


@pytest.fixture(scope="module")
def loaded(written):
    """{flavor: the checkpoint loaded in fp32, routed experts dequantized (bf16 layout)}."""
    return {
        f: k3batch.load_model(path, dtype=torch.float32, expert_dtype="bf16")
        for f, (_, path) in written.items()
    }


def _as_checkpointed(model: K3Model) -> dict[str, torch.Tensor]:
    """The params of `model` as the checkpoint holds them: bf16-rounded unless fp32 there."""
    with torch.device("meta"):
        meta = K3Model(model.config, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in meta.named_parameters()}
    return {n: p.detach().to(dtypes[n]).float() for n, p in model.named_parameters()}


def _index(path) -> dict:
    return json.loads((path / INDEX_FILE).read_text())


def _rewrite(path, fn):
    """Apply fn(weight_map, {file: tensors}) to every shard, then save the shards and index."""
    index = _index(path)
    shards = {f: load_file(path / f) for f in sorted(set(index["weight_map"].values()))}
    fn(index["weight_map"], shards)
    for f, tensors in shards.items():
        save_file(tensors, path / f, metadata={"format": "pt"})
    (path / INDEX_FILE).write_text(json.dumps(index))


def _copy(written, flavor, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(written[flavor][1], dst)
    return dst


# ---- round trip ----------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_weights_roundtrip_params_equal(written, loaded, flavor):
    model, _ = written[flavor]
    want = _as_checkpointed(model)
    got = dict(loaded[flavor].named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], value), name
    assert loaded[flavor].config == model.config
    assert not loaded[flavor].training


@pytest.mark.parametrize("flavor", FLAVORS)
def test_weights_roundtrip_logits_equal(written, loaded, flavor):
    ref = copy.deepcopy(written[flavor][0]).eval()
    ref.load_state_dict(_as_checkpointed(written[flavor][0]))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (2, 7), generator=gen)
    with torch.no_grad():
        assert torch.equal(loaded[flavor](ids), ref(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_packed_experts_match_dequantized(written, loaded, mini_model_dir, dtype):
    """A K3 checkpoint's MXFP4 experts loaded packed (the default) and dequantized at load:
    the packed halves decode to the files' values (their scales noted small), ~0.27x the bytes
    of bf16 experts, and the logits and greedy tokens are identical (dequantized MXFP4 values
    are exact in fp32 and bf16). fp32 on the k3-debug checkpoint (issue 14's check: identical
    greedy tokens on CPU); bf16 on K3_MINI, k3-debug's widths in 9 layers (each MoE layer runs
    the same code, so depth adds nothing there)."""
    from k3batch.engine.config import EngineConfig
    from k3batch.engine.engine import Engine
    from k3batch.engine.request import SamplingParams

    if dtype == torch.float32:
        path, plain = written["k3-debug"][1], loaded["k3-debug"]
    else:
        path = mini_model_dir
        plain = k3batch.load_model(path, dtype=dtype, expert_dtype="bf16")
    packed = k3batch.load_model(path, dtype=dtype)
    ex_p = packed.model.layers["1"].block_sparse_moe.experts
    ex_b = plain.model.layers["1"].block_sparse_moe.experts
    assert ex_p.packed and not ex_b.packed
    assert ex_p.weights()[0].small_scales  # read once at load: the W4A16 kernel's fast path
    assert torch.equal(ex_p.weights()[0].dequantize(dtype), ex_b.w13)
    expert_bytes = {
        name: sum(p.nbytes for n, p in m.named_parameters() if ".experts." in n and "shared" not in n)
        for name, m in (("packed", packed), ("plain", plain))
    }
    bf16_bytes = expert_bytes["plain"] * 2 // dtype.itemsize
    assert expert_bytes["packed"] <= 0.3 * bf16_bytes, expert_bytes
    ids = torch.randint(0, packed.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(packed(ids), plain(ids))
    prompts = ids.tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    cfg = EngineConfig(max_num_seqs=2, max_seq_len=32, chunk_size=16)  # one prefill chunk
    tokens = [[r.output_token_ids for r in Engine(m, cfg).generate(prompts, sp)]
              for m in (packed, plain)]  # fmt: skip
    assert tokens[0] == tokens[1]


def test_weights_kimi_linear_mxfp4_checkpoint(tmp_path):
    """`k3batch init-checkpoint --flavor kimi-linear-debug --experts mxfp4`: config.json says so,
    each routed expert is stored as MXFP4 halves under the public names (`experts.{e}.w1.
    weight_packed` / `weight_scale`; shared experts and the rest bf16), the default load keeps
    them packed (uint8 in memory), and packed and dequantized give the same logits."""
    from click.testing import CliRunner

    from k3batch.cli import main
    from k3batch.model.config import K3Config

    args = ["init-checkpoint", "--flavor", "kimi-linear-debug", "--experts", "mxfp4", str(tmp_path)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert K3Config.from_hf(tmp_path).experts_mxfp4
    weight_map = _index(tmp_path)["weight_map"]
    pre = "model.layers.1.block_sparse_moe."
    halves = {pre + "experts.7.w1.weight_packed", pre + "experts.7.w2.weight_scale"}
    assert halves <= weight_map.keys()
    assert pre + "shared_experts.gate_proj.weight" in weight_map
    assert not any(".experts." in n and n.endswith(".weight") for n in weight_map)
    packed = k3batch.load_model(tmp_path, dtype=torch.float32)
    plain = k3batch.load_model(tmp_path, dtype=torch.float32, expert_dtype="bf16")
    routed = [p.dtype for n, p in packed.named_parameters() if ".block_sparse_moe.experts." in n]
    assert routed and set(routed) == {torch.uint8}
    assert packed.model.layers["1"].block_sparse_moe.experts.packed
    ids = torch.randint(0, packed.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(packed(ids), plain(ids))


def test_weights_expert_dtype_errors(written):
    with pytest.raises(ValueError, match="needs MXFP4 experts"):
        k3batch.load_model(written["kimi-linear-debug"][1], expert_dtype="mxfp4")
    with pytest.raises(ValueError, match="expert_dtype = 'fp8'"):
        k3batch.load_model(written["k3-debug"][1], expert_dtype="fp8")


def test_weights_load_bf16_default(written):
    model, path = written["kimi-linear-debug"]
    got = dict(k3batch.load_model(path).named_parameters())
    fp32 = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias")
    for name, value in _as_checkpointed(model).items():
        assert got[name].dtype == (torch.float32 if name.endswith(fp32) else torch.bfloat16), name
        assert torch.equal(got[name].float(), value), name


def test_weights_k3_bf16_experts_load_under_either_config(model_factory, tmp_path):
    """Experts stored as bf16 load whether or not config.json announces MXFP4."""
    model = model_factory("k3-debug")  # experts_mxfp4=False: written as is, not modified
    write_checkpoint(model, tmp_path, seed=0)
    assert (
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"
        in _index(tmp_path)["weight_map"]
    )
    want = _as_checkpointed(model)
    config_file = tmp_path / "config.json"
    for announce_mxfp4 in (False, True):
        if announce_mxfp4:
            mx = dataclasses.replace(model.config, experts_mxfp4=True).to_hf()
            config = json.loads(config_file.read_text())
            config["quantization_config"] = mx["quantization_config"]
            config_file.write_text(json.dumps(config))
        got = k3batch.load_model(tmp_path, dtype=torch.float32)
        assert got.config.experts_mxfp4 == announce_mxfp4
        for name, p in got.named_parameters():
            assert torch.equal(p, want[name]), name


# ---- layout ----------------------------------------------------------------------------------


def test_weights_layout_k3(written):
    model, path = written["k3-debug"]
    index = _index(path)
    files = set(index["weight_map"].values())
    assert len(files) >= 2 and all((path / f).is_file() for f in files)
    assert all(n.startswith("language_model.") for n in index["weight_map"])
    manifest = checkpoint_manifest(model.config)
    assert index["weight_map"].keys() == manifest.keys()
    sizes = 0
    for f in files:
        with safe_open(path / f, framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                sizes += t.numel() * t.element_size()
                shape, dtype = manifest[name]
                assert (tuple(t.shape), t.dtype) == (shape, dtype), name
    assert index["metadata"]["total_size"] == sizes
    a_log = "language_model.model.layers.0.self_attn.A_log"
    pre = "language_model.model.layers.1.block_sparse_moe.experts.3.w2."
    with safe_open(path / index["weight_map"][a_log], framework="pt") as sf:
        stored = sf.get_tensor(a_log)
    assert stored.shape == (16,) and stored.dtype == torch.float32
    assert torch.equal(stored[:2], model.model.layers["0"].self_attn.A_log.detach())
    assert 0 <= stored[2:].min() and stored[2:].max() <= torch.tensor(16.0).log()
    shard = load_file(path / index["weight_map"][pre + "weight_packed"])
    packed = shard[pre + "weight_packed"]  # w2 of k3-debug: [32, 24] -> [32, 12]
    assert packed.shape == (32, 12) and packed.dtype == torch.uint8
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and "quantization_config" in config
    assert json.loads((path / "generation_config.json").read_text()) == {
        "bos_token_id": 256,
        "eos_token_id": 258,
    }
    assert (path / "tiktoken.model").is_file() and (path / "tokenizer_config.json").is_file()


def test_weights_layout_kimi_linear(written):
    model, path = written["kimi-linear-debug"]
    index = _index(path)
    assert len(set(index["weight_map"].values())) >= 2
    assert not any(n.startswith("language_model.") for n in index["weight_map"])
    name = "model.layers.0.self_attn.A_log"
    with safe_open(path / index["weight_map"][name], framework="pt") as sf:
        assert sf.get_tensor(name).shape == (1, 1, 2, 1)
        expert = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
        if expert in sf.keys():
            assert sf.get_tensor(expert).dtype == torch.bfloat16
    assert "model.layers.5.block_sparse_moe.experts.7.w2.weight" in index["weight_map"]
    assert "quantization_config" not in json.loads((path / "config.json").read_text())


def test_weights_single_file_and_alt_attn_res_spelling(written, loaded, tmp_path):
    path = _copy(written, "k3-debug", tmp_path)

    def merge_and_respell(weight_map, shards):
        merged = {}
        for tensors in shards.values():
            merged.update(tensors)
        shards.clear()
        respell = {"_res_proj.weight": "_res.proj_weight", "_res_norm.weight": "_res.norm_weight"}
        for old, new in respell.items():
            merged = {n.replace(old, new): t for n, t in merged.items()}
        shards["model.safetensors"] = merged

    _rewrite(path, merge_and_respell)
    for f in path.glob("model-*.safetensors"):
        f.unlink()
    (path / INDEX_FILE).unlink()
    with safe_open(path / "model.safetensors", framework="pt") as sf:
        assert "language_model.model.output_attn_res.proj_weight" in sf.keys()
        assert "language_model.model.layers.5.mlp_res.norm_weight" in sf.keys()
    got = dict(k3batch.load_model(path, dtype=torch.float32, expert_dtype="bf16").named_parameters())
    for name, p in loaded["k3-debug"].named_parameters():
        assert torch.equal(got[name], p), name


# ---- errors ------------------------------------------------------------------------------------


def test_weights_missing_tensor_is_named(written, tmp_path):
    path = _copy(written, "k3-debug", tmp_path)
    gone = "language_model.model.layers.7.self_attn.kv_b_proj.weight"

    def drop(weight_map, shards):
        shards[weight_map.pop(gone)].pop(gone)

    _rewrite(path, drop)
    with pytest.raises(ValueError, match=r"1 tensors missing.*layers\.7\.self_attn\.kv_b_proj\."):
        k3batch.load_model(path)


def test_weights_wrong_shape_names_both_shapes(written, tmp_path):
    path = _copy(written, "kimi-linear-debug", tmp_path)
    name = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"  # [40, 64]

    def transpose(weight_map, shards):
        tensors = shards[weight_map[name]]
        tensors[name] = tensors[name].t().contiguous()

    _rewrite(path, transpose)
    want = r"kv_a_proj_with_mqa\.weight: expected shape \[40, 64\], found \[64, 40\]"
    with pytest.raises(ValueError, match=want):
        k3batch.load_model(path)


def test_weights_unexpected_tensor_is_named(written, tmp_path):
    path = _copy(written, "k3-debug", tmp_path)
    extra = "language_model.model.layers.2.self_attn.bogus.weight"

    def add(weight_map, shards):
        file = next(iter(shards))
        shards[file][extra] = torch.zeros(3)
        weight_map[extra] = file
        # Skipped, not unexpected: vision parts and MTP tensors.
        shards[file]["vision_tower.blocks.0.weight"] = torch.zeros(2)
        weight_map["vision_tower.blocks.0.weight"] = file
        shards[file]["language_model.model.mtp.0.weight"] = torch.zeros(2)
        weight_map["language_model.model.mtp.0.weight"] = file

    _rewrite(path, add)
    with pytest.raises(ValueError, match=r"1 unexpected tensors.*self_attn\.bogus\.weight"):
        k3batch.load_model(path)


def test_weights_missing_shard_file_is_named(written, tmp_path):
    path = _copy(written, "k3-debug", tmp_path)
    index = _index(path)
    index["weight_map"]["language_model.lm_head.weight"] = "model-00009-of-00009.safetensors"
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"shard file model-00009-of-00009\.safetensors"):
        k3batch.load_model(path)


# ---- MXFP4 ---------------------------------------------------------------------------------------


def test_mxfp4_hand_made_byte():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0xB2  # low nibble 0x2 = +1.0 (element 0), high nibble 0xB = -1.5 (element 1)
    w = dequantize_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))  # scale 2^1
    assert w.shape == (1, 32)
    assert w[0, :2].tolist() == [2.0, -3.0] and not w[0, 2:].any()
    assert fp4_to_float(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ]


def test_mxfp4_pack_unpack_roundtrip():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)
    # Exactly representable values survive quantize -> dequantize.
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals = mags[torch.randint(0, 8, (6, 64), generator=gen)] * torch.where(
        torch.rand(6, 64, generator=gen) < 0.5, -1.0, 1.0
    )
    vals[:, ::32] = 6.0  # every group reaches 6, so its exponent is 2^0
    vals = vals * 2.0 ** torch.randint(-20, 20, (6, 1), generator=gen)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(vals)), vals)


@pytest.mark.parametrize("in_size", [64, 24], ids=["in64", "in24-partial-group"])
def test_mxfp4_quantize_is_idempotent_on_packed_data(in_size):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 7, in_size, generator=gen) * 0.05
    w[0, 0] = 0.0  # an all-zero row: scale 0
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (3, 7, in_size // 2) and scale.shape == (3, 7, -(-in_size // 32))
    deq = dequantize_mxfp4(packed, scale)
    assert (deq - w).abs().max() <= w.abs().max() / 4  # a sanity bound, not a tolerance
    p2, s2 = quantize_mxfp4(deq)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    assert torch.equal(dequantize_mxfp4(p2, s2, dtype=torch.bfloat16).float(), deq)


# ---- manifest counts -------------------------------------------------------------------------


def test_weights_manifest_k3_count():
    config = get_flavor("k3")
    manifest = checkpoint_manifest(config)
    total = 0
    for shape, _ in manifest.values():
        total += torch.Size(shape).numel()
    assert total == 2_779_484_478_208
    assert manifest["language_model.model.layers.0.self_attn.A_log"] == ((128,), torch.float32)
    assert manifest["language_model.model.layers.1.block_sparse_moe.experts.895.w2.weight"] == (
        (3584, 3072),
        torch.bfloat16,
    )
    with torch.device("meta"):
        model = K3Model(config)
    assert sum(p.numel() for p in model.parameters()) == 2_779_484_476_000


def test_weights_manifest_mxfp4_shapes():
    """Spec 11's MXFP4 shapes, on k3-slice (the k3 widths with fewer experts and layers)."""
    mx = checkpoint_manifest(get_flavor("k3-slice"), mxfp4=True)
    pre = "language_model.model.layers.1.block_sparse_moe.experts.111."
    assert mx[pre + "w1.weight_packed"] == ((3072, 1792), torch.uint8)
    assert mx[pre + "w1.weight_scale"] == ((3072, 112), torch.uint8)
    assert mx[pre + "w2.weight_packed"] == ((3584, 1536), torch.uint8)
    assert mx[pre + "w2.weight_scale"] == ((3584, 96), torch.uint8)
    assert pre + "w2.weight" not in mx


# ---- pipeline stage ----------------------------------------------------------------------------


def test_weights_layer_range_reads_only_its_tensors(written, loaded, monkeypatch):
    _, path = written["k3-debug"]
    read = []
    real_safe_open = weights_mod.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(weights_mod, "safe_open", Recording)
    stage = k3batch.load_model(
            path, dtype=torch.float32, layer_range=(3, 10), expert_dtype="bf16"
        )
    assert not hasattr(stage.model, "embed_tokens") and not hasattr(stage, "lm_head")
    assert sorted(stage.model.layers.keys(), key=int) == [str(i) for i in range(3, 10)]
    full = dict(loaded["k3-debug"].named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name
    assert read and all(int(n.split(".")[3]) in range(3, 10) for n in read)


# ---- the public Kimi Linear layout -----------------------------------------------------------

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


def test_weights_write_packed_experts_as_held(tmp_path):
    """A model holding its experts packed (as `init_checkpoint` draws MXFP4 experts on a GPU:
    kimi-linear's do not fit an H100 in bf16) writes their bytes as they are: the checkpoint
    loads back packed to the same parameters, bit for bit, and the same logits (bf16). Into a
    bf16 checkpoint it refuses."""
    config = dataclasses.replace(get_flavor("kimi-linear-debug"), experts_mxfp4=True)
    model = K3Model(config, dtype=torch.bfloat16, expert_dtype="mxfp4")
    init_random_(model, seed=5).eval()
    write_checkpoint(model, tmp_path, seed=0)
    assert any(n.endswith("w2.weight_scale") for n in _index(tmp_path)["weight_map"])
    got = k3batch.load_model(tmp_path, dtype=torch.bfloat16)
    want = dict(model.named_parameters())
    assert dict(got.named_parameters()).keys() == want.keys()
    for name, p in got.named_parameters():
        assert torch.equal(p, want[name]), name
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(got(ids), model(ids))
    with pytest.raises(ValueError, match="experts_mxfp4 = True"):
        model.config = dataclasses.replace(config, experts_mxfp4=False)
        write_checkpoint(model, tmp_path / "bf16", seed=0)
