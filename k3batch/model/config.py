"""K3Config: the architecture of a Kimi K3 (or Kimi Linear) model, as frozen data.

`K3Config.from_hf(dir)` converts an official `config.json` once (the wrapped `kimi_k3` form or the
plain `kimi_linear` form); `FLAVORS` holds the named configs of spec section 15. Every field
traces back to `spec/K3_MODEL.md` section 1; `validate()` rejects inconsistent values with a
`ValueError` that names the numbers.
"""

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class K3Config:
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    # MLA (gated, NoPE)
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536  # None: a single q_proj (Kimi Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # never rotated (NoPE); kept for the shapes
    v_head_dim: int = 128
    mla_use_output_gate: bool = True
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (spec 14.3)
    # KDA (linear_attn_config); kda_layers / full_attn_layers are 1-based like the HF config
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # None: the softplus gate of Kimi Linear
    kda_full_rank_gate: bool = True  # False: low-rank output gate (g_a_proj / g_b_proj)
    kda_layers: tuple[int, ...] = tuple(i for i in range(1, 92) if i % 4)
    full_attn_layers: tuple[int, ...] = tuple(range(4, 93, 4)) + (93,)
    # FFN
    hidden_act: str = "situ"  # "situ" (K3) or "silu" (SwiGLU, Kimi Linear)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    intermediate_size: int = 33792  # dense FFN of the first k layers
    first_k_dense_replace: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # latent width; None: experts at full width
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    experts_mxfp4: bool = False  # routed experts stored as MXFP4 in the checkpoint
    # Block Attention Residuals; None: plain pre-norm residual stream (Kimi Linear)
    attn_res_block_size: int | None = 12
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576  # informational: there is no position encoding
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839

    # ---- derived -------------------------------------------------------------------------
    @property
    def layer_types(self) -> tuple[str, ...]:
        """'kda' or 'mla' per 0-based layer index."""
        kda = set(self.kda_layers)
        return tuple("kda" if i + 1 in kda else "mla" for i in range(self.num_hidden_layers))

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_latent_size(self) -> int:
        """Width of one cached MLA token: normalized c_kv plus the shared k^R."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def has_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def num_attn_res_blocks(self) -> int:
        return -(-self.num_hidden_layers // self.attn_res_block_size) if self.has_attn_res else 0

    # ---- checks --------------------------------------------------------------------------
    def validate(self) -> "K3Config":
        L = self.num_hidden_layers
        kda, mla = set(self.kda_layers), set(self.full_attn_layers)
        if len(kda) != len(self.kda_layers) or len(mla) != len(self.full_attn_layers):
            raise ValueError("kda_layers / full_attn_layers contain duplicates")
        if kda & mla:
            raise ValueError(f"layers {sorted(kda & mla)} are both KDA and full attention")
        if kda | mla != set(range(1, L + 1)):
            missing = sorted(set(range(1, L + 1)) - (kda | mla))
            extra = sorted((kda | mla) - set(range(1, L + 1)))
            raise ValueError(
                f"kda_layers and full_attn_layers must partition 1..{L}: "
                f"missing {missing}, out of range {extra}"
            )
        if L not in mla:
            raise ValueError(f"the last layer ({L}) must be full attention (MLA)")
        if self.kda_head_dim > 256:
            raise ValueError(f"KDA head_dim = {self.kda_head_dim} > 256 (fla's limit)")
        if self.gate_lower_bound is not None and not -5.0 <= self.gate_lower_bound < 0.0:
            raise ValueError(f"gate_lower_bound = {self.gate_lower_bound} not in [-5, 0)")
        if self.routed_expert_hidden_size is not None and not (
            0 < self.routed_expert_hidden_size < self.hidden_size
        ):
            raise ValueError(
                f"routed_expert_hidden_size = {self.routed_expert_hidden_size} must be in "
                f"(0, hidden_size = {self.hidden_size})"
            )
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError(
                f"num_experts_per_token = {self.num_experts_per_token} must be in "
                f"[1, num_experts = {self.num_experts}]"
            )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tid = getattr(self, name)
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"{name} = {tid} not in [0, vocab_size = {self.vocab_size})")
        if self.hidden_act not in ("situ", "silu"):
            raise ValueError(f"hidden_act = {self.hidden_act!r}; expected 'situ' or 'silu'")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(f"attn_res_block_size = {self.attn_res_block_size} < 1")
        if not 0 <= self.first_k_dense_replace <= L:
            raise ValueError(
                f"first_k_dense_replace = {self.first_k_dense_replace} not in [0, {L}]"
            )
        positive = (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "kda_num_heads",
            "kda_head_dim",
            "short_conv_kernel_size",
            "moe_intermediate_size",
            "num_experts",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive")
        if self.qk_rope_head_dim < 0 or self.num_shared_experts < 0:
            raise ValueError("qk_rope_head_dim and num_shared_experts must be >= 0")
        return self

    # ---- Hugging Face config.json -------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | Path | dict) -> "K3Config":
        """Read an official config.json (a checkpoint dir, the file itself, or its dict)."""
        if isinstance(path, dict):
            raw = path
        else:
            path = Path(path)
            file = path / "config.json" if path.is_dir() else path
            if not file.is_file():
                raise ValueError(f"no config.json at {path}")
            raw = json.loads(file.read_text())
        return _from_hf_dict(raw).validate()

    def to_hf(self) -> dict:
        """The official config.json form: `kimi_k3` wrapper for K3, plain `kimi_linear` else."""
        text = {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "kda_layers": list(self.kda_layers),
                "full_attn_layers": list(self.full_attn_layers),
            },
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "bfloat16",
        }
        if not self.is_k3:
            if self.experts_mxfp4:
                text["quantization_config"] = self._quantization_config()
            return text
        text["linear_attn_config"] |= {
            "gate_lower_bound": self.gate_lower_bound,
            "use_full_rank_gate": self.kda_full_rank_gate,
        }
        text |= {
            "mla_use_output_gate": self.mla_use_output_gate,
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": self.latent_moe_use_norm,
            "topk_method": "noaux_tc",
            "attn_res_block_size": self.attn_res_block_size,
        }
        out = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text,
        }
        if self.experts_mxfp4:
            out["quantization_config"] = self._quantization_config()
        return out

    def _quantization_config(self) -> dict:
        """compressed-tensors' MXFP4 entry: routed experts packed, everything else bf16."""
        return {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {
                "group_0": {"weights": {"num_bits": 4, "group_size": 32}, "targets": ["Linear"]}
            },
            "ignore": [
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp.*",
                "re:.*gate$",
                "re:.*routed_expert_(up|down)_proj",
                "lm_head",
            ],
        }

    @property
    def is_k3(self) -> bool:
        """K3 variants (AttnRes, latent MoE, bounded gate) as opposed to Kimi Linear."""
        return self.has_attn_res


# Keys that carry no architecture for k3batch (or are checked below) and are accepted silently.
_IGNORED_KEYS = {
    "architectures",
    "auto_map",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "head_dim",
    "num_key_value_heads",
    "rope_theta",
    "rope_scaling",
    "mla_use_nope",
    "moe_layer_freq",
    "moe_router_activation_func",
    "use_grouped_topk",
    "num_expert_group",
    "topk_group",
    "topk_method",
    "num_nextn_predict_layers",
    "tie_word_embeddings",
    "model_max_length",
    "quantization_config",
    "linear_attn_config",
    "attention_dropout",
    "attention_bias",
    "vision_config",
    "media_placeholder_token_id",
    "text_config",
    "pretraining_tp",
}

_FIELD_KEYS = {
    "activation_situ_beta": "situ_beta",
    "activation_situ_linear_beta": "situ_linear_beta",
    "mla_use_output_gate": "mla_use_output_gate",
}


def _from_hf_dict(raw: dict) -> K3Config:
    model_type = raw.get("model_type")
    top = raw
    if model_type == "kimi_k3":
        if not isinstance(raw.get("text_config"), dict):
            raise ValueError("config.json: model_type 'kimi_k3' needs a 'text_config' object")
        raw = raw["text_config"]
        model_type = raw.get("model_type", "kimi_linear")
    if model_type != "kimi_linear":
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported "
            "(expected 'kimi_k3' or 'kimi_linear')"
        )

    def expect(key, allowed):
        if key in raw and raw[key] not in allowed:
            raise ValueError(
                f"config.json: {key} = {raw[key]!r} is not supported; expected {allowed}"
            )

    expect("moe_router_activation_func", ("sigmoid",))
    expect("num_expert_group", (1, None))
    expect("topk_group", (1, None))
    expect("moe_layer_freq", (1,))
    expect("tie_word_embeddings", (False,))
    expect("mla_use_nope", (True,))
    expect("num_nextn_predict_layers", (0, None))
    expect("topk_method", ("noaux_tc", "greedy", None))

    fields = {f.name for f in dataclasses.fields(K3Config)}
    kw = {}
    for key, value in raw.items():
        name = _FIELD_KEYS.get(key, key)
        if name in fields:
            kw[name] = value
        elif key not in _IGNORED_KEYS:
            log.warning("config.json: ignoring unknown key %r", key)
    lac = raw.get("linear_attn_config")
    if not isinstance(lac, dict):
        raise ValueError("config.json: 'linear_attn_config' is missing or not an object")
    for key in ("num_heads", "head_dim", "kda_layers", "full_attn_layers"):
        if key not in lac:
            raise ValueError(f"config.json: linear_attn_config.{key} is missing")
    kw["kda_num_heads"] = lac["num_heads"]
    kw["kda_head_dim"] = lac["head_dim"]
    kw["short_conv_kernel_size"] = lac.get("short_conv_kernel_size", 4)
    kw["kda_layers"] = tuple(lac["kda_layers"])
    kw["full_attn_layers"] = tuple(lac["full_attn_layers"])
    kw["gate_lower_bound"] = lac.get("gate_lower_bound")
    kw["kda_full_rank_gate"] = bool(lac.get("use_full_rank_gate", False))
    # Absent K3-only keys mean the Kimi Linear variants.
    kw.setdefault("mla_use_output_gate", False)
    kw.setdefault("routed_expert_hidden_size", None)
    kw.setdefault("latent_moe_use_norm", False)
    kw.setdefault("attn_res_block_size", None)
    kw.setdefault("routed_scaling_factor", 1.0)
    if "hidden_act" in kw:
        kw["hidden_act"] = {"swish": "silu"}.get(kw["hidden_act"], kw["hidden_act"])
    quant = top.get("quantization_config") or raw.get("quantization_config")
    if quant:
        fmt = quant.get("format") or quant.get("quant_method")
        if fmt != "mxfp4-pack-quantized" and "mxfp4" not in json.dumps(quant):
            raise ValueError(f"config.json: quantization_config format {fmt!r} is not supported")
        kw["experts_mxfp4"] = True
    for name, value in kw.items():
        if value is not None and isinstance(value, list):
            kw[name] = tuple(value)
    try:
        return K3Config(**kw)
    except TypeError as e:
        raise ValueError(f"config.json: {e}") from None


def _tiny(**kw) -> K3Config:
    """Tiny widths shared by the CPU flavors (spec section 15)."""
    base = dict(
        vocab_size=512,
        hidden_size=64,
        num_attention_heads=2,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kda_num_heads=2,
        kda_head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=24,
        routed_expert_hidden_size=32,
        bos_token_id=256,
        eos_token_id=258,
        pad_token_id=511,
    )
    return K3Config(**(base | kw))


def _kimi_linear_layers(num_layers: int, mla: tuple[int, ...]) -> dict:
    return dict(
        num_hidden_layers=num_layers,
        kda_layers=tuple(i for i in range(1, num_layers + 1) if i not in mla),
        full_attn_layers=mla,
    )


_KIMI_LINEAR = dict(
    q_lora_rank=None,
    mla_use_output_gate=False,
    gate_lower_bound=None,
    kda_full_rank_gate=False,
    hidden_act="silu",
    routed_expert_hidden_size=None,
    latent_moe_use_norm=False,
    routed_scaling_factor=2.446,
    attn_res_block_size=None,
)

FLAVORS: dict[str, K3Config] = {
    "k3": K3Config(),
    "k3-debug": _tiny(),
    "k3-slice": K3Config(
        num_hidden_layers=8,
        kda_layers=(1, 2, 3, 5, 6, 7),
        full_attn_layers=(4, 8),
        num_experts=112,
        num_experts_per_token=2,
    ),
    "kimi-linear-debug": _tiny(
        **_KIMI_LINEAR,
        num_shared_experts=1,
        **_kimi_linear_layers(27, (4, 8, 12, 16, 20, 24, 27)),
    ),
    "kimi-linear": K3Config(
        **_KIMI_LINEAR,
        **_kimi_linear_layers(27, (4, 8, 12, 16, 20, 24, 27)),
        hidden_size=2304,
        intermediate_size=9216,
        num_attention_heads=32,
        kda_num_heads=32,
        num_experts=256,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=1024,
    ),
}


def get_flavor(name: str) -> K3Config:
    if name not in FLAVORS:
        raise ValueError(f"unknown flavor {name!r}; known: {', '.join(FLAVORS)}")
    return FLAVORS[name].validate()
