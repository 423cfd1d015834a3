"""Prefill -> decode handoff: one request's single-device caches cut into a decode rank's pieces,
packed into one byte buffer per (prefill stage, decode rank) pair for the replica's process group.

A request's cache tensors (`PagedCache.request_tensors`) are
    {"kda_state": {layer: [H, K, V]}, "kda_conv": {layer: [3, C, W-1]},
     "mla_latent": {layer: [L, kv_lora + rope]}}   (L cached tokens)
for any subset of layers (one pipeline stage's). Rank r of a TP group with DCP size M gets the
same structure holding its KDA heads [r H/N, (r+1) H/N) and their conv channels, and the MLA
latent rows i with i % M == r % M, in order (local index i // M). Pieces are views of the input;
no float arithmetic happens anywhere here, so `unshard_request(reshard...)` and
`unpack(*pack(...))` give their input back exactly.

On the wire (`pack`): a rank's pieces from one stage travel as one uint8 buffer, the tensors in
`KINDS` order then layer order, each starting at a multiple of `ALIGN_BYTES` (so that every
slice can be viewed as its dtype). The `Manifest` (kinds, layers, shapes, dtypes, offsets) is a
few hundred bytes and goes by Ray; the receiver allocates the buffer from it and receives into
it. Between any two members of the group the messages arrive in the order sent, so both sides
need no other agreement.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3batch.parallel.layout import ParallelLayout

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
            i: t.narrow(0, tp_rank * heads, heads)
            for i, t in cache_tensors.get("kda_state", {}).items()
        },
        "kda_conv": {
            i: t.narrow(1, tp_rank * channels, channels)
            for i, t in cache_tensors.get("kda_conv", {}).items()
        },
        "mla_latent": {i: t[d::M] for i, t in cache_tensors.get("mla_latent", {}).items()},
    }


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


ALIGN_BYTES = 16  # every tensor of a packed buffer starts at a multiple of this


@dataclass(frozen=True, slots=True)
class Manifest:
    """How one packed buffer unpacks: (kind, layer, shape, dtype, byte offset) per tensor, and
    the buffer's size in bytes."""

    entries: tuple[tuple[str, int, tuple[int, ...], torch.dtype, int], ...]
    num_bytes: int


def pack(pieces: dict, device) -> tuple[torch.Tensor, Manifest]:
    """One rank's pieces (the format of `reshard_request`) copied into one uint8 buffer [num_bytes]
    on `device`, and its manifest."""
    entries, offset = [], 0
    for kind in KINDS:
        for i in sorted(pieces.get(kind, {})):
            t = pieces[kind][i]
            entries.append((kind, i, tuple(t.shape), t.dtype, offset))
            offset += -(-t.numel() * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    for kind, i, shape, dtype, start in entries:
        _slice(buf, shape, dtype, start).copy_(pieces[kind][i])
    return buf, Manifest(tuple(entries), offset)


def unpack(buf: torch.Tensor, manifest: Manifest) -> dict:
    """The pieces of a packed buffer (views of `buf`), in the format of `reshard_request`."""
    if buf.numel() != manifest.num_bytes:
        raise ValueError(f"buffer of {buf.numel()} B, manifest of {manifest.num_bytes} B")
    out = {kind: {} for kind in KINDS}
    for kind, i, shape, dtype, start in manifest.entries:
        out[kind][i] = _slice(buf, shape, dtype, start)
    return out


def _slice(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, start: int):
    n = math.prod(shape) * dtype.itemsize
    return buf[start : start + n].view(dtype).view(shape)


def connect(stage_ranks: list[int], decode_ranks: list[int], rank: int, device) -> None:
    """One small message from every prefill stage to every decode rank of the default group, in
    (stage, decode rank) order, from each member's side (`rank`: this process). NCCL creates a
    pair's communicator at the pair's first message and blocks both sides until both are
    there; doing it here, at start, lets a stage later post its sends and return before the
    rank is ready to receive. The order makes the lowest unconnected pair always ready."""
    x = torch.zeros(1, device=device)
    for s in stage_ranks:
        for r in decode_ranks:
            if rank == s:
                dist.send(x, dst=r)
            elif rank == r:
                dist.recv(x, src=s)
