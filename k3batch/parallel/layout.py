"""Parallel layouts as plain numbers, no torch: the TP and DCP degrees of a decode group
(`ParallelLayout`, with one `validate`) and the layers each pipeline stage holds
(`split_layers`). The job spec validates with them in processes that never load torch (the
`k3batch run` driver, a worker that reads a spec).

Default stage partition: whole AttnRes blocks per stage when the stage count allows it (93
layers, P = 8 gives 12,12,12,12,12,12,12,9), else layers split as evenly as possible.
"""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """Degrees of one decode group: tensor parallel over tp_size ranks, and decode context
    parallelism (the MLA latent's tokens striped over dcp_size ranks) inside it."""

    tp_size: int = 1
    dcp_size: int = 1

    def validate(self, config=None) -> "ParallelLayout":
        """Raise ValueError naming the numbers; with a K3Config, also check that every split
        dimension divides evenly."""
        if self.tp_size < 1 or self.dcp_size < 1:
            raise ValueError(
                f"tp_size = {self.tp_size} and dcp_size = {self.dcp_size} must be >= 1"
            )
        if self.tp_size % self.dcp_size:
            raise ValueError(f"dcp_size = {self.dcp_size} must divide tp_size = {self.tp_size}")
        if config is None:
            return self
        widths = {
            "kda_num_heads": config.kda_num_heads,
            "num_attention_heads": config.num_attention_heads,
            "num_experts": config.num_experts,
            "vocab_size": config.vocab_size,
        }
        if config.first_k_dense_replace > 0:
            widths["intermediate_size"] = config.intermediate_size
        if config.num_shared_experts:
            widths["shared expert width (moe_intermediate_size * num_shared_experts)"] = (
                config.moe_intermediate_size * config.num_shared_experts
            )
        for name, value in widths.items():
            if value % self.tp_size:
                raise ValueError(f"tp_size = {self.tp_size} does not divide {name} = {value}")
        return self

    def dcp_rank(self, tp_rank: int) -> int:
        return tp_rank % self.dcp_size

    def dcp_ranks(self, tp_rank: int) -> list[int]:
        """The TP ranks of tp_rank's DCP group, in DCP-rank order."""
        first = tp_rank - tp_rank % self.dcp_size
        return list(range(first, first + self.dcp_size))


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
