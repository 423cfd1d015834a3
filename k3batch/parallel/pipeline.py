"""Pipeline-parallel layout: which layers each prefill stage holds, and what crosses a stage
boundary.

Default partition: whole AttnRes blocks per stage when the stage count allows it (93 layers,
P = 8 gives 12,12,12,12,12,12,12,9), else layers split as evenly as possible. Between stages
only the AttnRes stream crosses: the completed block summaries (the embedding b_0 first) and the
current partial sum, packed as one tensor [num_bank + 1, T, D]. The bank size at a boundary is
fixed by the layer index, so the receiver knows the shape from the batch alone.
"""

import torch

from k3batch.model.attn_res import Stream


def split_layers(
    num_layers: int, num_stages: int, block_size: int | None = None, sizes: list[int] | None = None
) -> list[tuple[int, int]]:
    """[first, last) per stage. `sizes` (layers per stage) overrides the default partition."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pp = {num_stages} must be in [1, num_layers = {num_layers}]")
    if sizes is not None:
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(
                f"stage sizes {sizes} must be {num_stages} positive numbers summing to {num_layers}"
            )
    else:
        units = [num_layers]  # partition whole blocks when there are at least as many
        if block_size:
            units = [min(block_size, num_layers - s) for s in range(0, num_layers, block_size)]
        if len(units) < num_stages:
            units = [1] * num_layers
        sizes = _balance(units, num_stages)
    bounds, first = [], 0
    for n in sizes:
        bounds.append((first, first + n))
        first += n
    return bounds


def _balance(units: list[int], num_stages: int) -> list[int]:
    """Group consecutive units into num_stages groups with near-equal sums (greedy on the
    remaining average; every group gets at least one unit)."""
    sizes, i = [], 0
    for s in range(num_stages):
        left_stages = num_stages - s
        target = sum(units[i:]) / left_stages
        total = units[i]
        i += 1
        while len(units) - i > left_stages - 1 and total + units[i] / 2 <= target:
            total += units[i]
            i += 1
        sizes.append(total)
    return sizes


def bank_size(first_layer: int, block_size: int | None) -> int:
    """Completed block summaries in the stream entering layer `first_layer`."""
    return -(-first_layer // block_size) if block_size else 0


def pack_stream(stream: Stream) -> torch.Tensor:
    """[num_bank + 1, T, D]: the bank rows, then the partial sum."""
    return torch.stack([*stream.bank, stream.partial])


def unpack_stream(packed: torch.Tensor) -> Stream:
    rows = list(packed.unbind(0))
    return Stream(bank=rows[:-1], partial=rows[-1])
