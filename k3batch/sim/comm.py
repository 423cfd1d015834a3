"""Communication of a layout, from the code's own formulas: the bytes each transfer carries and
the seconds it takes at a link.

Volumes (each function names the code it follows):
- PP: a stage boundary sends the AttnRes stream [bank + 1, T, D] (`parallel/pipeline.py`; the
  bank size is fixed by the boundary's layer, the stages by `parallel/layout.split_layers`).
- TP (`parallel/tp.py`, `parallel/linear.py`): every layer all-reduces its attention output
  [T, D] (row-parallel o_proj) and its FFN output: a dense layer [T, D] (row-parallel
  down_proj), a MoE layer ONE fp32 buffer [T, Din + D] (the routed experts' partial sum at the
  latent width Din, packed with the shared experts' partial output); the vocab-parallel head
  all-gathers the logits [S, V] of the S rows it scores (one per sequence).
- DCP (`parallel/context.py`), per MLA layer of a decode step: an all-gather of the absorbed
  queries [B, M H/N, L + R] (model dtype) inside the DCP group of M, then one all-to-all of the
  partial contexts and LSEs [M, B, H/N, L + 1] (fp32) for the merge.
- Handoff (`parallel/handoff.py`, `cache/layout.py`): what one decode rank receives of one
  request from one prefill stage: per KDA layer its heads' fp32 state [H/N, K, V] and conv
  states [3, H/N K, W-1], per MLA layer its DCP stripe of the latents [ceil((L - d) / M), C],
  each tensor padded to the packed buffer's alignment.
Times (`p2p_s`, `all_reduce_s`, `all_gather_s`, `all_to_all_s`): latency terms plus the bytes
one GPU sends over the link's bandwidth per direction, ring algorithms (NCCL's): an all-reduce
of n ranks takes 2(n - 1) steps and sends 2(n - 1)/n of the buffer, an all-gather n - 1 steps
and (n - 1)/n of the gathered output; an all-to-all sends (n - 1)/n of its buffer to n - 1
peers, one latency each. Collectives over a group of 1 cost nothing (the code skips them).
"""

import math
from typing import NamedTuple

from k3batch.parallel.handoff import ALIGN_BYTES
from k3batch.parallel.layout import ParallelLayout, split_layers
from k3batch.parallel.pipeline import bank_size
from k3batch.sim.cluster import ClusterSpec, Link

FP32_BYTES = 4  # the MoE all-reduce, the DCP partials and LSEs, the KDA recurrent state


class Collective(NamedTuple):
    """One collective of a forward on one rank. nbytes: all_reduce, the tensor reduced;
    all_gather, the gathered output (every rank's part); all_to_all, one rank's send buffer
    (its part for every rank, its own included)."""

    kind: str  # "all_reduce" | "all_gather" | "all_to_all"
    nbytes: int
    group_size: int


# ---- volumes ------------------------------------------------------------------------------------
def pp_stream_bytes(config, first_layer: int, num_tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes a stage boundary sends for a chunk of num_tokens entering layer `first_layer`:
    the packed stream [bank_size + 1, T, D]."""
    rows = bank_size(first_layer, config.attn_res_block_size) + 1
    return rows * num_tokens * config.hidden_size * dtype_bytes


def boundary_stream_bytes(config, num_stages: int, num_tokens: int, dtype_bytes: int = 2,
                          sizes: list[int] | None = None) -> list[int]:  # fmt: skip
    """`pp_stream_bytes` at each of the num_stages - 1 boundaries of `split_layers`."""
    ranges = split_layers(config.num_hidden_layers, num_stages, config.attn_res_block_size, sizes)
    return [pp_stream_bytes(config, first, num_tokens, dtype_bytes) for first, _ in ranges[1:]]


def _attn_reduce_bytes(config, num_tokens: int, dtype_bytes: int) -> int:
    return num_tokens * config.hidden_size * dtype_bytes  # o_proj output [T, D]


def _ffn_reduce_bytes(config, layer_idx: int, num_tokens: int, dtype_bytes: int) -> int:
    D = config.hidden_size
    if not config.is_moe_layer(layer_idx):
        return num_tokens * D * dtype_bytes  # down_proj output [T, D]
    width = (config.routed_expert_hidden_size or D) + (D if config.num_shared_experts else 0)
    return num_tokens * width * FP32_BYTES  # ParallelSparseMoE: [T, Din (+ D)] fp32


def tp_all_reduce_bytes(config, layers, num_tokens: int, dtype_bytes: int = 2) -> int:
    """The sum of the payloads of the TP all-reduces of `layers` in a forward of num_tokens
    tokens (two per layer, sizes in the module docstring; `collectives` lists them one by one).
    The payload is the full tensor, whatever the TP size."""
    return sum(
        _attn_reduce_bytes(config, num_tokens, dtype_bytes)
        + _ffn_reduce_bytes(config, i, num_tokens, dtype_bytes)
        for i in layers
    )


def dcp_gather_bytes(config, num_seqs: int, tp: int, dcp: int, dtype_bytes: int = 2) -> int:
    """The all-gathered absorbed queries of one MLA layer's decode step: [B, M H/N, L + R]."""
    heads = config.num_attention_heads // tp
    return num_seqs * dcp * heads * config.mla_latent_size * dtype_bytes


def dcp_merge_bytes(config, num_seqs: int, tp: int, dcp: int) -> int:
    """One rank's send buffer of the LSE merge's all-to-all: [M, B, H/N, L + 1] fp32."""
    heads = config.num_attention_heads // tp
    return dcp * num_seqs * heads * (config.kv_lora_rank + 1) * FP32_BYTES


def dcp_bytes(config, num_seqs: int, tp: int, dcp: int, dtype_bytes: int = 2) -> int:
    """DCP traffic of one MLA layer's decode step on one rank: the query all-gather's output
    plus the merge all-to-all's send buffer (0 with dcp = 1)."""
    if dcp == 1:
        return 0
    return dcp_gather_bytes(config, num_seqs, tp, dcp, dtype_bytes) + dcp_merge_bytes(
        config, num_seqs, tp, dcp
    )


def head_gather_bytes(config, num_rows: int, dtype_bytes: int = 2) -> int:
    """The vocab-parallel head's gathered logits [rows, V]."""
    return num_rows * config.vocab_size * dtype_bytes


def collectives(config, layer_ids, num_tokens: int, num_seqs: int, tp: int = 1, dcp: int = 1,
                *, head: bool = False, dtype_bytes: int = 2) -> list[Collective]:  # fmt: skip
    """The collectives of one forward of num_tokens tokens of num_seqs sequences on one rank of
    a TP group of `tp` with DCP groups of `dcp`, holding `layer_ids` (and the LM head with
    `head`), in the order the rank model issues them: per layer, [DCP query all-gather, DCP
    merge all-to-all (MLA layers, dcp > 1)], the attention all-reduce, the FFN all-reduce; then
    the head's all-gather of one row per sequence. Empty with tp = 1. Raises ValueError on a
    layout the model rejects (`ParallelLayout.validate`) or a DCP forward that is not a decode
    step (num_tokens != num_seqs), as the rank model does."""
    ParallelLayout(tp_size=tp, dcp_size=dcp).validate(config)
    if dcp > 1 and num_tokens != num_seqs:
        raise ValueError(
            f"dcp = {dcp} runs decode steps only (one token per sequence); got {num_tokens} "
            f"tokens of {num_seqs} sequences"
        )
    if tp == 1:
        return []
    out, types = [], config.layer_types  # a property that builds a tuple: once, not per layer
    for i in layer_ids:
        if dcp > 1 and types[i] == "mla":
            gather = dcp_gather_bytes(config, num_seqs, tp, dcp, dtype_bytes)
            out.append(Collective("all_gather", gather, dcp))
            out.append(Collective("all_to_all", dcp_merge_bytes(config, num_seqs, tp, dcp), dcp))
        attn = _attn_reduce_bytes(config, num_tokens, dtype_bytes)
        ffn = _ffn_reduce_bytes(config, i, num_tokens, dtype_bytes)
        out += [Collective("all_reduce", attn, tp), Collective("all_reduce", ffn, tp)]
    if head:
        out.append(Collective("all_gather", head_gather_bytes(config, num_seqs, dtype_bytes), tp))
    return out


def handoff_bytes(config, num_tokens: int, layers, *, tp: int = 1, dcp: int = 1,
                  dcp_rank: int = 0, dtype_bytes: int = 2) -> int:  # fmt: skip
    """Bytes one decode rank (DCP rank `dcp_rank` of a TP group of `tp`) receives of one
    request of num_tokens cached tokens from the stage holding `layers`: the packed buffer of
    its pieces (`handoff.pack`'s Manifest.num_bytes). DCP rank 0 holds the longest stripe."""
    ParallelLayout(tp_size=tp, dcp_size=dcp).validate(config)
    if not 0 <= dcp_rank < dcp:
        raise ValueError(f"dcp_rank = {dcp_rank} not in [0, dcp = {dcp})")
    heads, K = config.kda_num_heads // tp, config.kda_head_dim
    stripe = len(range(dcp_rank, num_tokens, dcp))  # tokens i with i % M == d
    sizes, types = [], config.layer_types
    for i in layers:
        if types[i] == "kda":
            sizes.append(heads * K * K * FP32_BYTES)
            sizes.append(3 * heads * K * (config.short_conv_kernel_size - 1) * dtype_bytes)
        else:
            sizes.append(stripe * config.mla_latent_size * dtype_bytes)
    return sum(-(-n // ALIGN_BYTES) * ALIGN_BYTES for n in sizes)


# ---- times ------------------------------------------------------------------------------------
def sent_bytes(c: Collective) -> float:
    """Bytes one rank sends for `c` (ring all-reduce 2(n-1)/n, all-gather and all-to-all
    (n-1)/n of nbytes)."""
    n = c.group_size
    return (2 if c.kind == "all_reduce" else 1) * (n - 1) / n * c.nbytes


def p2p_s(nbytes: int, link: Link) -> float:
    """One send of nbytes: latency + nbytes / bandwidth."""
    return link.latency_s + nbytes / link.bytes_per_s


def all_reduce_s(nbytes: int, group: int, link: Link) -> float:
    """Ring all-reduce of an nbytes tensor over `group` ranks: 2(n-1) latencies + 2(n-1)/n
    nbytes / bandwidth (reduce-scatter, then all-gather)."""
    return _ring_s(Collective("all_reduce", nbytes, group), 2 * (group - 1), link)


def all_gather_s(nbytes: int, group: int, link: Link) -> float:
    """Ring all-gather into an nbytes output: (n-1) latencies + (n-1)/n nbytes / bandwidth."""
    return _ring_s(Collective("all_gather", nbytes, group), group - 1, link)


def all_to_all_s(nbytes: int, group: int, link: Link) -> float:
    """All-to-all of an nbytes send buffer per rank: n - 1 peers, one latency each, and
    (n-1)/n nbytes / bandwidth (the parts to every peer share the GPU's link)."""
    return _ring_s(Collective("all_to_all", nbytes, group), group - 1, link)


def _ring_s(c: Collective, steps: int, link: Link) -> float:
    if c.group_size == 1:
        return 0.0
    return steps * link.latency_s + sent_bytes(c) / link.bytes_per_s


_TIMES = {"all_reduce": all_reduce_s, "all_gather": all_gather_s, "all_to_all": all_to_all_s}


def collective_s(c: Collective, cluster: ClusterSpec) -> float:
    """Seconds of `c` over c.group_size consecutive GPUs of `cluster` (a group placed from a
    node's first GPU), at `cluster.link(group)`; an all-to-all across nodes sends its parts
    within the node and over the network at once, and takes the longer of the two of the
    member with the most peers off its node."""
    n, g = c.group_size, cluster.gpus_per_node
    if c.kind not in _TIMES:
        raise ValueError(f"collective kind {c.kind!r}; expected one of {', '.join(_TIMES)}")
    if c.kind != "all_to_all" or n <= g:
        return _TIMES[c.kind](c.nbytes, n, cluster.link(n))
    cluster.link(n)  # checks that the group fits the cluster
    last = n - g * (math.ceil(n / g) - 1)  # members on the last (maybe partial) node
    return max(_all_to_all_across_s(c.nbytes, n, on_node, cluster) for on_node in {g, last})


def _all_to_all_across_s(nbytes: int, n: int, on_node: int, cluster: ClusterSpec) -> float:
    """A member with on_node - 1 peers on its node and n - on_node off it: each link carries
    its peers' parts (nbytes / n each) at the same time; one latency per peer."""
    part = nbytes / n
    transfer = max((on_node - 1) * part / cluster.intra.bytes_per_s,
                   (n - on_node) * part / cluster.inter.bytes_per_s)  # fmt: skip
    latency = (on_node - 1) * cluster.intra.latency_s + (n - on_node) * cluster.inter.latency_s
    return transfer + latency


def collectives_s(items, cluster: ClusterSpec) -> float:
    """Seconds of a list of collectives run one after another (`collective_s` each)."""
    return sum(collective_s(c, cluster) for c in items)
