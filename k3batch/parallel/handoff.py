"""Prefill -> decode handoff: one request's single-device caches cut into a decode rank's pieces.

A request's cache tensors (`PagedCache.request_tensors`) are
    {"kda_state": {layer: [H, K, V]}, "kda_conv": {layer: [3, C, W-1]},
     "mla_latent": {layer: [L, kv_lora + rope]}}   (L cached tokens)
for any subset of layers (one pipeline stage's). Rank r of a TP group with DCP size M gets the
same structure holding its KDA heads [r H/N, (r+1) H/N) and their conv channels, and the MLA
latent rows i with i % M == r % M, in order (local index i // M). Pieces are contiguous copies:
no float arithmetic happens, so `unshard_request(reshard...)` gives the input back exactly.
"""

import torch

from k3batch.parallel.group import ParallelLayout

KINDS = ("kda_state", "kda_conv", "mla_latent")


def reshard_request(cache_tensors: dict, config, layout: ParallelLayout, tp_rank: int) -> dict:
    """This rank's pieces of one request (same keys and layers as `cache_tensors`)."""
    N, M = layout.tp_size, layout.dcp_size
    if not 0 <= tp_rank < N:
        raise ValueError(f"tp_rank = {tp_rank} not in [0, tp_size = {N})")
    if config.kda_num_heads % N:
        raise ValueError(f"tp_size = {N} does not divide kda_num_heads = {config.kda_num_heads}")
    heads = config.kda_num_heads // N
    channels = heads * config.kda_head_dim
    d = layout.dcp_rank(tp_rank)
    return {
        "kda_state": {
            i: _copy(t.narrow(0, tp_rank * heads, heads))
            for i, t in cache_tensors.get("kda_state", {}).items()
        },
        "kda_conv": {
            i: _copy(t.narrow(1, tp_rank * channels, channels))
            for i, t in cache_tensors.get("kda_conv", {}).items()
        },
        "mla_latent": {i: _copy(t[d::M]) for i, t in cache_tensors.get("mla_latent", {}).items()},
    }


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def unshard_request(pieces_by_rank: list[dict], layout: ParallelLayout) -> dict:
    """Inverse of `reshard_request`: every rank's pieces (index = tp_rank) -> the full tensors.
    KDA heads are concatenated in rank order; MLA token i comes from the rank i % M of the
    first DCP group."""
    N, M = layout.tp_size, layout.dcp_size
    if len(pieces_by_rank) != N:
        raise ValueError(f"need the pieces of all {N} ranks, got {len(pieces_by_rank)}")
    first = pieces_by_rank[0]
    out = {
        "kda_state": {
            i: torch.cat([p["kda_state"][i] for p in pieces_by_rank], dim=0)
            for i in first["kda_state"]
        },
        "kda_conv": {
            i: torch.cat([p["kda_conv"][i] for p in pieces_by_rank], dim=1)
            for i in first["kda_conv"]
        },
        "mla_latent": {},
    }
    for i in first["mla_latent"]:
        stripes = [pieces_by_rank[d]["mla_latent"][i] for d in range(M)]
        full = stripes[0].new_empty(sum(s.shape[0] for s in stripes), *stripes[0].shape[1:])
        for d, s in enumerate(stripes):
            full[d::M] = s
        out["mla_latent"][i] = full
    return out


def handoff_bytes(pieces: dict) -> int:
    """Bytes of the tensors in one rank's pieces."""
    return sum(
        t.numel() * t.element_size() for kind in KINDS for t in pieces.get(kind, {}).values()
    )
