"""`load_model`: a checkpoint directory -> a K3Model (or one pipeline stage of it), in eval mode.

The config comes from the directory's config.json; the index is checked against the model
(built on the meta device) before any weight memory is allocated; then the parameters are
allocated on the target device and filled shard by shard (`k3batch.model.weights`).
"""

from pathlib import Path

import torch
from torch import nn

from k3batch.model.config import K3Config
from k3batch.model.k3 import K3Model
from k3batch.model.moe import EXPERT_DTYPES
from k3batch.model.weights import load_weights_, plan_load, read_weight_map

_BACKENDS = ("auto", "torch", "fla")


def resolve_expert_dtype(path, expert_dtype: str = "auto") -> str:
    """The routed experts in memory for the checkpoint at `path`: "auto" keeps them as the
    checkpoint stores them ("mxfp4", packed, when its index holds MXFP4 halves; else "bf16");
    "bf16" dequantizes MXFP4 experts at load; "mxfp4" needs MXFP4 experts in the checkpoint."""
    if expert_dtype not in ("auto", *EXPERT_DTYPES):
        raise ValueError(f"expert_dtype = {expert_dtype!r}; expected auto or one of {EXPERT_DTYPES}")
    stored = "mxfp4" if any(n.endswith(".weight_packed") for n in read_weight_map(path)) else "bf16"
    if expert_dtype == "mxfp4" and stored != "mxfp4":
        raise ValueError(f"expert_dtype = 'mxfp4' needs MXFP4 experts; {path} stores bf16 ones")
    return stored if expert_dtype == "auto" else expert_dtype


def allocate_(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Give every parameter of `model`, built on the meta device, uninitialized memory on
    `device`; returns the model. What `Module.to_empty` does, without its `empty_like` of meta
    tensors, which imports sympy: seconds at the start of every replica, stage and rank process
    on a small CPU machine. (K3Model holds no buffers and no tied parameters.)"""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fresh = torch.empty(p.shape, dtype=p.dtype, device=device)
            setattr(module, name, nn.Parameter(fresh, requires_grad=p.requires_grad))
    return model


def load_model(
    path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    layer_range: tuple[int, int] | None = None,
    backend: str = "auto",
    expert_dtype: str = "auto",
) -> K3Model:
    """Load the checkpoint at `path`.

    Args:
        dtype: dtype of the weights (conv weights, A_log, dt_bias and the router's correction
            bias stay fp32 whatever it is).
        device: where the parameters live.
        layer_range: (first, last) to load only layers [first, last) as a pipeline stage: the
            embedding comes along on the first stage, the final AttnRes, norm and lm_head on the
            last; other tensors are not read.
        backend: KDA backend, "torch" or "fla"; "auto" picks "fla" on CUDA, else "torch".
        expert_dtype: the routed experts in memory (`resolve_expert_dtype`): by default packed
            MXFP4 when the checkpoint stores them so, multiplied by the W4A16 kernel.
    Raises:
        ValueError: bad arguments, a bad config.json, or a checkpoint whose tensors do not match
            the config (the message names the tensor).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend = {backend!r}; expected one of {_BACKENDS}")
    config = K3Config.from_hf(Path(path))
    if layer_range is not None:
        first, last = layer_range
        if not 0 <= first < last <= config.num_hidden_layers:
            raise ValueError(
                f"layer_range = {tuple(layer_range)}: need 0 <= first < last <= "
                f"num_hidden_layers = {config.num_hidden_layers}"
            )
        layer_range = (first, last)
    expert_dtype = resolve_expert_dtype(path, expert_dtype)
    with torch.device("meta"):
        model = K3Model(config, layer_range=layer_range, dtype=dtype, expert_dtype=expert_dtype)
    plan = plan_load(path, model)  # raises before anything is allocated
    allocate_(model, device)
    load_weights_(model, plan)
    if backend == "auto":
        backend = "fla" if torch.device(device).type == "cuda" else "torch"
    return model.set_backend(backend).eval()
