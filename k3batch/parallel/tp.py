"""A decode rank of a TP group (with DCP inside it): its model, its weights, its cache.

`build_rank_model` builds a plain K3Model from a local config (this rank's KDA heads, MLA heads
and dense FFN width) and swaps in the parallel leaves: row-parallel output projections, the
vocabulary-parallel LM head, the DCP MLA (`parallel/context.py`) and `ParallelSparseMoE`
(expert-parallel routed experts and row-parallel shared experts under one all-reduce).
Everything else is replicated. Parameter names are the single-device ones; `split_dim` says
how each is cut (contiguous, N equal parts, rank r takes part r), which `shard_full_state_dict`
and `load_rank_weights_` both follow.
"""

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from k3batch.cache.layout import CacheLayout
from k3batch.model.config import K3Config
from k3batch.model.k3 import K3Model
from k3batch.model.moe import note_packed_scales_
from k3batch.model.layers import GatedMLP
from k3batch.model.loader import allocate_
from k3batch.model.weights import check_halves_paired, load_expert_, plan_load
from k3batch.parallel.context import ContextParallelMLA
from k3batch.parallel.group import ParallelGroup
from k3batch.parallel.layout import ParallelLayout
from k3batch.parallel.linear import ParallelSparseMoE, RowParallelLinear, VocabParallelLMHead

# Leaf module (or parameter) names cut along their rows (dim 0): per-head projections, their
# conv channels and gate parameters, FFN gate/up rows, vocabulary rows, and stacked experts
# (dim 0 is the expert; packed MXFP4 experts too). Output projections are cut along their
# input columns (dim 1).
_ROWS = {
    "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias",
    "f_b_proj", "b_proj", "g_proj", "g_b_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj",
    "lm_head", "w13", "w2", "w13_packed", "w13_scale", "w2_packed", "w2_scale",
}  # fmt: skip
_COLUMNS = {"o_proj", "down_proj"}


def split_dim(fqn: str) -> int | None:
    """The dimension along which parameter `fqn` is split over TP ranks; None: replicated."""
    parts = fqn.split(".")
    leaf = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
    if leaf in _ROWS:
        return 0
    if leaf in _COLUMNS:
        return 1
    return None


def local_config(config: K3Config, layout: ParallelLayout) -> K3Config:
    """The config whose single-device shapes are one rank's: KDA heads, MLA heads and the
    dense FFN width divided by tp_size. Experts, vocabulary and shared experts keep their
    global sizes here (their leaves are built separately), so the router stays full-size."""
    N = layout.validate(config).tp_size
    return dataclasses.replace(
        config,
        kda_num_heads=config.kda_num_heads // N,
        num_attention_heads=config.num_attention_heads // N,
        intermediate_size=config.intermediate_size // N,
    )


class RankModel(K3Model):
    """A K3Model holding one rank's shards. `config` is the local config (`local_config`),
    `global_config` the model's; `layout` and `tp_rank` its coordinates. With dcp_size > 1 it
    runs decode batches only, and says so before touching any cache."""

    def __init__(self, config: K3Config, layout: ParallelLayout, tp_rank: int, *, dtype=None):
        super().__init__(local_config(config, layout), dtype=dtype)
        self.global_config, self.layout, self.tp_rank = config, layout, tp_rank

    def forward_batch(self, input_ids_T, batch, cache=None, *, all_logits: bool = False):
        if self.layout.dcp_size > 1 and not batch.is_decode:
            raise ValueError(
                f"rank {self.tp_rank} with dcp_size = {self.layout.dcp_size} runs decode only "
                f"(one token per sequence, every cached_len > 0); got seq_lens "
                f"{batch.seq_lens}, cached_lens {batch.cached_lens}"
            )
        return super().forward_batch(input_ids_T, batch, cache, all_logits=all_logits)


def build_rank_model(config: K3Config, layout: ParallelLayout, tp: ParallelGroup,
                     dcp: ParallelGroup, *, dtype, device,
                     expert_dtype: str = "bf16") -> RankModel:  # fmt: skip
    """The whole model as held by TP rank `tp.rank`; its parameters are uninitialized (fill
    them with `load_rank_weights_` or `load_state_dict(shard_full_state_dict(...))`). Its
    routed experts are this rank's, in `expert_dtype` ("mxfp4": packed, see `moe.Experts`).

    `forward_batch` takes GLOBAL cached_lens (DCP maps positions to local indices) and returns
    full-vocabulary logits on every rank; with dcp_size > 1 only decode batches are accepted.
    """
    layout.validate(config)
    if (tp.size, dcp.size) != (layout.tp_size, layout.dcp_size):
        raise ValueError(
            f"group sizes tp {tp.size}, dcp {dcp.size} != layout {layout.tp_size}, "
            f"{layout.dcp_size}"
        )
    if dcp.rank != layout.dcp_rank(tp.rank):
        raise ValueError(f"dcp rank {dcp.rank} != tp rank {tp.rank} % dcp_size {dcp.size}")
    D = config.hidden_size
    with torch.device("meta"):  # built at local size, allocated once below
        model = RankModel(config, layout, tp.rank, dtype=dtype)
        local = model.config
        for i, layer in model.model.layers.items():
            i = int(i)
            if config.layer_types[i] == "mla":
                layer.self_attn = ContextParallelMLA(local, i, dcp, dtype)
                width = local.num_attention_heads * config.v_head_dim
            else:
                width = local.kda_num_heads * config.kda_head_dim
            layer.self_attn.o_proj = RowParallelLinear(width, D, tp, dtype)
            if hasattr(layer, "mlp"):
                layer.mlp = _parallel_mlp(local, local.intermediate_size, tp, dtype)
            else:
                layer.block_sparse_moe = ParallelSparseMoE(local, i, tp, dtype,
                                                           expert_dtype=expert_dtype)  # fmt: skip
        model.lm_head = VocabParallelLMHead(D, config.vocab_size // tp.size, tp, dtype)
    return allocate_(model, device)


def _parallel_mlp(config, local_inter_size: int, tp: ParallelGroup, dtype) -> GatedMLP:
    mlp = GatedMLP(config, config.hidden_size, local_inter_size, dtype)
    mlp.down_proj = RowParallelLinear(local_inter_size, config.hidden_size, tp, dtype)
    return mlp


def shard_full_state_dict(full_model: K3Model, layout: ParallelLayout, tp_rank: int) -> dict:
    """{name: this rank's slice (a view)} of a single-device model's parameters, for
    `rank_model.load_state_dict(..., strict=True)`."""
    layout.validate(full_model.config)
    N, out = layout.tp_size, {}
    for name, t in full_model.state_dict().items():
        dim = split_dim(name)
        if dim is None:
            out[name] = t
        else:
            n = t.shape[dim] // N
            out[name] = t.narrow(dim, tp_rank * n, n)
    return out


@torch.no_grad()
def load_rank_weights_(rank_model: K3Model, checkpoint_dir, layout: ParallelLayout,
                       tp_rank: int) -> K3Model:  # fmt: skip
    """Fill `rank_model` with this rank's slices read from the checkpoint.

    Names, shapes and shard files are checked first against the full config (`plan_load`
    on a meta model, which resolves official names through `canonical_name` and
    `read_weight_map`); then each split tensor is read through `safe_open(...).get_slice`, so
    only this rank's rows or columns are read, and only this rank's experts (MXFP4 pairs
    dequantized on the parameter's device). Values are cast to the parameters' dtypes.
    """
    path = Path(checkpoint_dir)
    config = K3Config.from_hf(path)
    N = layout.validate(config).tp_size
    with torch.device("meta"):
        full = K3Model(config, layer_range=rank_model.layer_range, dtype=torch.bfloat16)
    plan = plan_load(path, full)  # raises ValueError naming the tensor, before any read
    params = dict(rank_model.named_parameters())
    num_local_experts = config.num_experts // N
    first_expert = tp_rank * num_local_experts
    halves: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    filled = set()
    for file, items in plan.shards.items():
        with safe_open(plan.path / file, framework="pt", device="cpu") as f:
            for raw, entry in items:
                if entry.expert is not None:
                    e = entry.expert - first_expert
                    if not 0 <= e < num_local_experts:
                        continue  # another rank's expert: not read
                    t = f.get_tensor(raw)
                    filled.add(load_expert_(params, entry, e, t, halves, raw, _copy_))
                    continue
                param = params[entry.param]
                if entry.role == "A_log":  # tiny; stored padded or [1, 1, H, 1] (spec 14.2)
                    a = f.get_tensor(raw).reshape(-1)[: config.kda_num_heads]
                    n = param.shape[0]
                    _copy_(param, a[tp_rank * n : (tp_rank + 1) * n], raw)
                else:
                    t = _read_slice(f.get_slice(raw), split_dim(entry.param), param, tp_rank)
                    _copy_(param, t, raw)
                filled.add(entry.param)
    check_halves_paired(halves)
    missing = set(params) - filled
    if missing:
        raise ValueError(f"rank {tp_rank}: parameters not loaded: {sorted(missing)[:10]}")
    return note_packed_scales_(rank_model)


def _copy_(dst: torch.Tensor, src: torch.Tensor, raw: str) -> None:
    if dst.shape != src.shape:  # copy_ would broadcast silently
        raise ValueError(f"tensor {raw}: slice {list(src.shape)} != parameter {list(dst.shape)}")
    dst.copy_(src)


def _read_slice(slice_, dim: int | None, param: torch.Tensor, tp_rank: int) -> torch.Tensor:
    if dim is None:
        return slice_[:]
    n = param.shape[dim]
    part = slice(tp_rank * n, (tp_rank + 1) * n)
    return slice_[part] if dim == 0 else slice_[:, part]


def rank_cache_layout(config: K3Config, layout: ParallelLayout, *, page_size: int,
                      dtype_bytes: int, layer_ids=None) -> CacheLayout:  # fmt: skip
    """The cache layout of one rank: KDA states and conv states of its heads only; MLA pages
    of `page_size` local tokens (its DCP stripe). `layer_ids` default: all layers."""
    layers = range(config.num_hidden_layers) if layer_ids is None else layer_ids
    return CacheLayout.build(
        config, layers, page_size=page_size, dtype_bytes=dtype_bytes, tp_size=layout.tp_size
    )
