"""Pipeline parallelism: what crosses a prefill stage boundary (which layers each stage holds
is `layout.split_layers`). Between stages only the AttnRes stream crosses: the completed block
summaries (the embedding b_0 first) and the current partial sum, packed as one tensor
[num_bank + 1, T, D]. The bank size at a boundary is fixed by the layer index, so the receiver
knows the shape from the batch alone.
"""

import torch

from k3batch.model.attn_res import Stream


def bank_size(first_layer: int, block_size: int | None) -> int:
    """Completed block summaries in the stream entering layer `first_layer`."""
    return -(-first_layer // block_size) if block_size else 0


def pack_stream(stream: Stream) -> torch.Tensor:
    """[num_bank + 1, T, D]: the bank rows, then the partial sum."""
    return torch.stack([*stream.bank, stream.partial])


def unpack_stream(packed: torch.Tensor) -> Stream:
    rows = list(packed.unbind(0))
    return Stream(bank=rows[:-1], partial=rows[-1])
