"""The offsets of a packed prefill batch with their device tensors, built once per forward.

Every KDA prefill kernel reads the sequences' offsets (`cu_seqlens`) on the device, and fla's
chunked kernels also read a table of chunks. Built from the host list in each call, that is
five host-to-device copies per KDA layer, and fla's `prepare_chunk_indices` copies its table
with a blocking `.to()`, which drains the stream: one wait for the GPU per KDA layer. A
`Varlen` is the host list itself (a `list` of N+1 offsets, so every function that takes the
list takes it, the torch reference included) carrying those tensors, made by one
non-blocking copy: the model builds it once per forward (`ForwardBatch.varlen`) and every
layer passes it down. The kernels' functions also take a plain list (`as_varlen` builds one).

Shape legend: N sequences, NT chunks of the batch (sum over sequences of cdiv(len, BT)).
"""

import torch

CHUNK_SIZE = 64  # chunk_kda's chunk (BT): the table below is for it


class Varlen(list):
    """N+1 offsets (a list) with, on one device: `cu` [N+1] int64; `chunk_offsets` [N+1]
    int64, each sequence's first chunk of CHUNK_SIZE tokens; `chunk_indices` [NT, 2] int64,
    (sequence, chunk within it) per chunk (fla's layout); and on the host `cu_cpu` [N+1]
    int64 and `max_len`, the longest sequence."""

    cu: torch.Tensor
    cu_cpu: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_indices: torch.Tensor
    max_len: int


def make_varlen(offsets: list[int], device, chunk_size: int = CHUNK_SIZE) -> Varlen:
    """A `Varlen` of host offsets on device, its tensors from one non-blocking copy (no wait
    for the device: a blocking copy from the host drains the stream)."""
    lens = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    chunk_offsets, chunk_indices = [0], []
    for n, size in enumerate(lens):
        num_chunks = -(-size // chunk_size)
        chunk_offsets.append(chunk_offsets[-1] + num_chunks)
        for i in range(num_chunks):
            chunk_indices += (n, i)
    host = torch.tensor(list(offsets) + chunk_offsets + chunk_indices, dtype=torch.long)
    packed = host.to(device, non_blocking=True)
    out = Varlen(offsets)
    N1 = len(offsets)
    out.cu, out.chunk_offsets = packed[:N1], packed[N1 : 2 * N1]
    out.chunk_indices = packed[2 * N1 :].view(-1, 2)
    out.cu_cpu = host[:N1]
    out.max_len = max(lens, default=0)
    return out


def as_varlen(cu_seqlens, device) -> Varlen:
    """cu_seqlens as a `Varlen` on device: itself when it is one there, else built now."""
    if isinstance(cu_seqlens, Varlen) and _same_device(cu_seqlens.cu.device, device):
        return cu_seqlens
    return make_varlen(list(cu_seqlens), device)


def _same_device(a: torch.device, b) -> bool:
    b = torch.device(b)
    return a.type == b.type and (b.index is None or a.index is None or a.index == b.index)
