"""Seconds of a replica's work, from a calibration (one layer's parts measured on one GPU,
`sim.calibration`) and the communication model (`sim.comm`): what the virtual-clock runners
(`sim.clock`) charge.

`StepCost.forward_s(batch)`: one forward of a ForwardBatch on one device of a layout (a whole
model, a pipeline stage, a decode rank) = the sum over the parts of the layers it holds of the
calibrated part at the batch's shape, plus its TP/DCP collectives at the cluster's link. A
layer's parts: its attention ("kda" or "mla" by `K3Config.layer_types`), its FFN ("dense_ffn"
in the first_k_dense_replace layers, "moe" after), and "attn_res" where the config has Block
AttnRes; "embed" on the first stage, "head" on the last. The shape: phase "decode" when every
sequence brings one token, else "prefill"; tokens, sequences, and the cached tokens summed over
sequences (the calibration's parts take the batch's shape: "head" mixes every token's stream
and scores one row per sequence, as the engine does but for prompt log-probabilities). Every
layer of one type has the same shape in K3, so the cost asks the calibration once per part and
multiplies by the layer count; "mla" at the DCP shard, the other parts at dcp 1 (DCP shards
only the MLA latent).

`LinkCost`: the pipeline's transfers: the AttnRes stream at each stage boundary
(`comm.pp_stream_bytes`) and each stage's handoff of one request to the decode ranks
(`comm.handoff_bytes` per rank, sent one after another), over the link between the two GPUs.
GPUs are placed as the replica's placement group orders them: stage s on GPU first_gpu + s,
decode rank r on first_gpu + P + r, node-major (`ClusterSpec.p2p_link`).

`build_replica`: an Engine over the virtual-clock runners of one replica of any layout, with
these costs.
"""

from collections import Counter

import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.model.forward_batch import ForwardBatch
from k3batch.sim import comm
from k3batch.sim.calibration import experts_key
from k3batch.sim.clock import SimDecodeGroup, SimPipeline, SimRunner, VirtualClock, phase


def layer_parts(config, layer_ids) -> Counter:
    """part -> how many of `layer_ids` have it."""
    parts, types = Counter(), config.layer_types
    for i in layer_ids:
        parts[types[i]] += 1
        parts["moe" if config.is_moe_layer(i) else "dense_ffn"] += 1
        if config.has_attn_res:
            parts["attn_res"] += 1
    return parts


class StepCost:
    """Seconds of one forward of a ForwardBatch on one device of a layout: the sum of the
    calibrated parts of the layers it holds (layer_ids), at its tp/dcp shard, plus the TP/DCP
    collectives of those layers at the cluster's link."""

    def __init__(self, config, calibration, cluster, *, layer_ids, tp: int = 1, dcp: int = 1,
                 embed: bool, head: bool, experts: str | None = None):  # fmt: skip
        """calibration: has part_s(part, *, phase, tp, dcp, tokens, seqs, context_tokens,
        experts) (`sim.calibration.Calibration`); cluster: a `sim.cluster.ClusterSpec` (its
        links time the collectives; None will do with tp 1); experts: the moe points' key
        (default: the config's, `calibration.experts_key`, e.g. "896x16 mxfp4")."""
        self.config, self.calibration, self.cluster = config, calibration, cluster
        self.layer_ids, self.tp, self.dcp, self.head = tuple(layer_ids), tp, dcp, head
        if experts is None:
            experts = experts_key(config, "mxfp4" if config.experts_mxfp4 else "bf16")
        self.experts = experts
        self._comm_s: dict[tuple[int, int], float] = {}  # (tokens, seqs) -> seconds
        self.parts = layer_parts(config, self.layer_ids)
        self.parts.update(["embed"] * embed + ["head"] * head)

    def forward_s(self, batch: ForwardBatch) -> float:
        return self.compute_s(batch) + self.comm_s(batch)

    def compute_s(self, batch: ForwardBatch) -> float:
        """The calibrated parts alone."""
        return sum(self.parts_s(batch).values())

    def parts_s(self, batch: ForwardBatch) -> dict[str, float]:
        """part -> seconds of its layers here (count x one layer's calibrated part)."""
        shape = {"phase": phase(batch), "tp": self.tp, "tokens": batch.num_tokens,
                 "seqs": batch.num_seqs, "context_tokens": sum(batch.cached_lens)}  # fmt: skip
        part_s = self.calibration.part_s
        return {part: n * part_s(part, **shape, dcp=self.shard_dcp(part),
                                 experts=self.experts if part == "moe" else "")
                for part, n in self.parts.items()}  # fmt: skip

    def shard_dcp(self, part: str) -> int:
        """The DCP shard a part's points are taken at: mla's, 1 for the rest."""
        return self.dcp if part == "mla" else 1

    def comm_s(self, batch: ForwardBatch) -> float:
        """The TP all-reduces and head all-gather, the DCP all-gather and merge, in order."""
        if self.tp == 1:
            return 0.0
        shape = batch.num_tokens, batch.num_seqs
        if shape not in self._comm_s:  # they depend on nothing else
            items = comm.collectives(self.config, self.layer_ids, *shape, self.tp, self.dcp,
                                     head=self.head)  # fmt: skip
            self._comm_s[shape] = comm.collectives_s(items, self.cluster)
        return self._comm_s[shape]


class LinkCost:
    """Transfer seconds of a replica's pipeline of layer_ranges (P stages) handing requests to
    a decode group of tp ranks (DCP dcp): `stream_s` and `handoff_s` as `sim.clock.SimPipeline`
    takes them."""

    def __init__(self, config, cluster, layer_ranges, *, tp: int = 1, dcp: int = 1,
                 first_gpu: int = 0, dtype_bytes: int = 2):  # fmt: skip
        self.config, self.cluster, self.layer_ranges = config, cluster, list(layer_ranges)
        self.tp, self.dcp, self.first_gpu, self.dtype_bytes = tp, dcp, first_gpu, dtype_bytes
        self._handoff: dict[tuple[int, int], list[int]] = {}  # (stage, tokens) -> bytes per rank

    def stream_s(self, stage: int, batch: ForwardBatch) -> float:
        """Stage `stage` sending the stream of `batch` to the next stage."""
        first = self.layer_ranges[stage + 1][0]
        nbytes = comm.pp_stream_bytes(self.config, first, batch.num_tokens, self.dtype_bytes)
        g = self.first_gpu + stage
        return comm.p2p_s(nbytes, self.cluster.p2p_link(g, g + 1))

    def handoff_bytes(self, stage: int, num_tokens: int) -> list[int]:
        """What stage `stage` sends each decode rank of one request of num_tokens tokens (the
        ranks of one DCP rank receive alike)."""
        key = stage, num_tokens
        if key not in self._handoff:
            layers = range(*self.layer_ranges[stage])
            per_dcp_rank = [comm.handoff_bytes(self.config, num_tokens, layers, tp=self.tp,
                                               dcp=self.dcp, dcp_rank=d,
                                               dtype_bytes=self.dtype_bytes)
                            for d in range(self.dcp)]  # fmt: skip
            self._handoff[key] = [per_dcp_rank[r % self.dcp] for r in range(self.tp)]
        return self._handoff[key]

    def handoff_s(self, stage: int, num_tokens: int) -> float:
        """Stage `stage` sending its layers of one request to every decode rank, one send after
        another."""
        src, first_rank = self.first_gpu + stage, self.first_gpu + len(self.layer_ranges)
        return sum(comm.p2p_s(n, self.cluster.p2p_link(src, first_rank + r))
                   for r, n in enumerate(self.handoff_bytes(stage, num_tokens)))  # fmt: skip


def build_replica(config, engine_config: EngineConfig, calibration, cluster, *, arena_bytes: int,
                  pp_layers=None, tp: int = 1, dcp: int = 1, disaggregate: bool = False,
                  stage_arena_bytes=None, experts: str | None = None, first_gpu: int = 0,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[Engine, VirtualClock]:  # fmt: skip
    """An Engine over the virtual-clock runners of one replica, laid out as
    `actors.build.build_engine` lays one out, and its clock: one device (no pp_layers, tp 1,
    not disaggregate: `SimRunner`), else a prefill pipeline of the stages pp_layers ([first,
    last) each, e.g. `Plan.stage_layers`; one stage of every layer when None) and, with tp > 1
    or disaggregate, a decode group of tp ranks with DCP dcp. arena_bytes: the arena of the
    one device or of each decode rank (e.g. `Plan.pool_bytes`); stage_arena_bytes: each
    prefill stage's, one figure or one per stage (default arena_bytes). Costs: `StepCost` per
    device, `LinkCost` for the transfers, GPUs from first_gpu on."""
    clock, L = VirtualClock(), config.num_hidden_layers

    def cost(layers, *, embed: bool, head: bool, tp: int = 1, dcp: int = 1) -> StepCost:
        return StepCost(config, calibration, cluster, layer_ids=layers, tp=tp, dcp=dcp,
                        embed=embed, head=head, experts=experts)  # fmt: skip

    group = tp > 1 or disaggregate
    if pp_layers is None and not group:
        runner = SimRunner(config, engine_config, cost(range(L), embed=True, head=True),
                           arena_bytes=arena_bytes, clock=clock, dtype=dtype)  # fmt: skip
        return Engine(None, engine_config, runner=runner), clock
    ranges = list(pp_layers or [(0, L)])
    links = LinkCost(config, cluster, ranges, tp=tp, dcp=dcp, first_gpu=first_gpu,
                     dtype_bytes=dtype.itemsize)  # fmt: skip
    costs = [cost(range(*r), embed=s == 0, head=s == len(ranges) - 1) for s, r in enumerate(ranges)]
    pipeline = SimPipeline(config, engine_config, ranges, costs,
                           arena_bytes=stage_arena_bytes or arena_bytes, stream_s=links.stream_s,
                           handoff_s=links.handoff_s, clock=clock, dtype=dtype)  # fmt: skip
    decode = None
    if group:
        decode = SimDecodeGroup(config, engine_config, cost(range(L), embed=True, head=True,
                                                            tp=tp, dcp=dcp),
                                tp=tp, dcp=dcp, arena_bytes=arena_bytes, clock=clock,
                                dtype=dtype)  # fmt: skip
    return Engine(None, engine_config, runner=pipeline, decode_runner=decode), clock
