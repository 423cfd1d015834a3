"""The parts of one layer, as `bench calibrate` times them: each a `Case` (a forward to time, its
FLOPs and bytes as counted) at one shape, on a TP rank's share of the layer.

Parts (`sim.calibration.PARTS`): embed (the lookup); kda and mla (input norm + mixer); dense_ffn
and moe (post-attention norm + FFN; moe = router, routed and shared experts, latent projections
and norm); attn_res (a layer's two Block AttnRes mixes and two partial-sum adds, at the bank the
flavor's layers hold on average, `mean_bank`); head (the output mix over every block, the final
norm, the LM head on one row per sequence). A layer is the sum of its parts.

Shards. tp 1 runs the single-device modules (`K3Model`: a PP stage's, the one-GPU engine's);
tp > 1 a TP rank's share as `parallel.tp.build_rank_model` cuts it (its KDA and MLA heads and
dense FFN width by `local_config`, E / tp routed experts, shared width / tp, vocabulary / tp),
built for a two-layer probe of the flavor (`probe_config`) over groups that communicate
nothing (`SilentGroup`): the rank runs alone, and the collectives' time is the communication
model's (`sim.comm`). The MoE is built alone, per expert dtype (`moe_block`), routed by the
flavor's router on random weights with its correction bias zeroed (every expert equally likely,
as a trained router balances them). Under DCP a rank holds every dcp-th token of each sequence
and attends the group's heads (`parallel.context`); the points are rank 0's.

Counted per point, for this shard (a: activation bytes; T tokens, S sequences; D hidden):
FLOPs: 2 T per weight of the part's modules, as `bench.roofline` counts a decode step (every
projection, norm and conv weight meets every token), except the embedding (none), the LM head
(one row per sequence), the routed experts (2 x 3 Din I per slot routed to this rank's
experts) and MLA's kv_b_proj in prefill (2 per weight per attended key, cached or new: it
expands them); plus attention: MLA prefill 2 (q_head_dim + v_dim) per (query, key) pair and
head, MLA decode 2 (latent + kv_lora) per cached token and head attended on this rank (as
`bench.roofline`); the KDA recurrence 6 K V per token and head (+ 2 C (K + V) in prefill's
chunks of C = 64); the AttnRes mixes 6 D per candidate and token, the adds D per token.
Bytes: each weight of the part once (routed experts: those the routes touched on this rank,
packed bytes for MXFP4), the part's input and output [T, D] (head: its logits [rows, V / tp]),
the caches read and written (KDA: each sequence's fp32 state and conv states, read where it has
a prefix and written; MLA: the latent of every attended token read once, the new ones written
in prefill), the AttnRes candidates. Intermediate activations are left out (a lower bound).
"""

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from k3batch.cache.layout import CacheLayout
from k3batch.cache.paged import PagedCache
from k3batch.engine.config import EngineConfig
from k3batch.model import K3Model
from k3batch.model.attn_res import Stream, mix
from k3batch.model.forward_batch import ForwardBatch, to_device
from k3batch.model.init import init_random_
from k3batch.model.layers import RMSNorm
from k3batch.model.loader import allocate_
from k3batch.model.moe import SparseMoE
from k3batch.parallel.group import ParallelGroup
from k3batch.parallel.layout import ParallelLayout
from k3batch.parallel.linear import ParallelSparseMoE
from k3batch.parallel.tp import build_rank_model, local_config

PAGE_SIZE = EngineConfig().page_size  # the engine's MLA page
KDA_CHUNK = 64


class Skip(Exception):
    """A shape this device cannot hold."""


@dataclass
class PartBench:
    """Where the parts run: the flavor's config, its probe, the device and dtype (bf16 on CUDA,
    fp32 on the CPU), the random generator and weight seed."""

    config: object  # K3Config
    device: torch.device
    seed: int = 0

    def __post_init__(self):
        self.probe = probe_config(self.config)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.a = self.dtype.itemsize
        self.gen = torch.Generator(device=self.device).manual_seed(self.seed)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.device).to(self.dtype)

    def fits(self, nbytes: int, what: str) -> None:
        """Skip unless nbytes (and 1 GiB to spare) fit the device's free memory (the
        allocator's cached blocks released first when they do not)."""
        if not self.cuda or nbytes + 2**30 <= torch.cuda.mem_get_info(self.device)[0]:
            return
        torch.cuda.empty_cache()
        if nbytes + 2**30 > torch.cuda.mem_get_info(self.device)[0]:
            raise Skip(f"{what}: {nbytes / 2**30:.1f} GiB do not fit")


def probe_config(config):
    """Two layers of the flavor's widths: KDA (layer 0) and MLA (layer 1), each with the dense
    FFN; the MoE is built on its own (`moe_block`), one per expert dtype."""
    return dataclasses.replace(config, num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,),
                               first_k_dense_replace=2).validate()  # fmt: skip


def mean_bank(config) -> int:
    """Block summaries a layer's mixes see, averaged over the layers (K3: 4.3 -> 4)."""
    B, L = config.attn_res_block_size, config.num_hidden_layers
    return round(sum(-(-i // B) for i in range(L)) / L)


class SilentGroup(ParallelGroup):
    """A group of `size` ranks whose collectives communicate nothing, so that one rank's share
    of a layer runs alone: all_reduce returns its input, all_gather a tensor of the gathered
    shape holding only this rank's part, all_to_all what it would send. Built by the benchmark
    only: the production `ParallelGroup` has no such mode."""

    __slots__ = ()

    def all_reduce(self, t):
        return t

    def all_gather(self, t, dim):
        shape = list(t.shape)
        n, shape[dim] = shape[dim], shape[dim] * self.size
        out = t.new_empty(shape)
        out.narrow(dim, self.rank * n, n).copy_(t)
        return out

    def all_to_all(self, tensors):
        return list(tensors)


def probe_model(bench: PartBench, tp: int, dcp: int = 1):
    """The probe at tp 1 (K3Model) or as rank 0 of a TP group of tp (DCP dcp), random weights."""
    if tp == 1:
        model = K3Model(bench.probe, dtype=bench.dtype, device=bench.device)
    else:
        layout = ParallelLayout(tp_size=tp, dcp_size=dcp)
        model = build_rank_model(bench.probe, layout, SilentGroup(None, 0, tp),
                                 SilentGroup(None, 0, dcp), dtype=bench.dtype,
                                 device=bench.device)  # fmt: skip
    backend = "fla" if bench.cuda else "torch"
    return init_random_(model, bench.seed).eval().set_backend(backend)


def moe_block(bench: PartBench, tp: int, expert_dtype: str) -> nn.ModuleDict:
    """{"norm", "moe"}: the post-attention norm and the MoE of the flavor's first MoE layer, at
    tp 1 as the single-device model holds it, else rank 0's (`ParallelSparseMoE`, as
    build_rank_model builds it); random weights, the router's correction bias zeroed."""
    cfg, idx = bench.config, bench.config.first_k_dense_replace
    with torch.device("meta"):
        if tp == 1:
            moe = SparseMoE(cfg, idx, bench.dtype, expert_dtype=expert_dtype)
        else:
            local = local_config(cfg, ParallelLayout(tp_size=tp))
            moe = ParallelSparseMoE(local, idx, SilentGroup(None, 0, tp), bench.dtype,
                                    expert_dtype=expert_dtype)  # fmt: skip
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, bench.dtype)
        block = nn.ModuleDict({"norm": norm, "moe": moe})
    bench.fits(_params(block)[1], f"moe {expert_dtype} at tp {tp}")
    init_random_(allocate_(block, bench.device), bench.seed).eval()
    moe.gate.e_score_correction_bias.zero_()
    return block


class Case:
    """A point ready to time: run() is the part's forward; flops and nbytes as counted."""

    def __init__(self, run, flops: float, nbytes: float):
        self.run, self.flops, self.nbytes = run, flops, nbytes


def part_case(part: str, bench: PartBench, model, phase: str, tokens: int, seqs: int,
              context: int, tp: int, dcp: int) -> Case:  # fmt: skip
    """The Case of `part` on `model` (a probe; for moe, a `moe_block`): `tokens` in `seqs`
    sequences (decode: one each) after `context` cached tokens each."""
    return _CASES[part](bench, model, phase, tokens, seqs, context, tp, dcp)


def _params(*modules) -> tuple[int, int]:
    """(weights, bytes) of the modules' parameters."""
    ps = [p for m in modules for p in m.parameters()]
    return sum(p.numel() for p in ps), sum(p.numel() * p.element_size() for p in ps)


def _batch(phase: str, tokens: int, seqs: int, context: int) -> ForwardBatch:
    lens = [1] * seqs if phase == "decode" else \
        [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]  # fmt: skip
    return ForwardBatch(seq_lens=lens, cached_lens=[context] * seqs, slot_ids=list(range(seqs)))


def _cache(bench: PartBench, layer_idx: int, batch: ForwardBatch, tp: int, dcp: int):
    """A cache of zeros for one probe layer holding the batch's sequences (block = index),
    bound to the batch (page tables set)."""
    layout = CacheLayout.build(bench.probe, [layer_idx], page_size=PAGE_SIZE,
                               dtype_bytes=bench.a, tp_size=tp)  # fmt: skip
    need = max(n + c for n, c in zip(batch.seq_lens, batch.cached_lens))
    pages = layout.request_pages(need, dcp)
    total = batch.num_seqs * layout.request_bytes(need, dcp)
    bench.fits(total, "the cache")
    cache = PagedCache(layout, total, device=bench.device, dtype=bench.dtype, dcp_size=dcp)
    if layout.mla_layers:
        batch.page_tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch.num_seqs)]
    cache.bind(batch)
    return cache


def _embed(bench, model, phase, tokens, seqs, context, tp, dcp):
    ids = torch.randint(0, bench.config.vocab_size, (tokens,), generator=bench.gen,
                        device=bench.device)  # fmt: skip
    emb, D = model.model.embed_tokens, bench.config.hidden_size
    return Case(lambda: emb(ids), 0, 2 * tokens * D * bench.a + 8 * tokens)


def _kda(bench, model, phase, tokens, seqs, context, tp, dcp):
    layer = model.model.layers["0"]
    attn, norm = layer.self_attn, layer.input_layernorm
    batch = _batch(phase, tokens, seqs, context)
    cache = _cache(bench, 0, batch, tp, 1)
    x = bench.randn(tokens, bench.config.hidden_size)
    W, Wb = _params(norm, attn)
    H, K = attn.num_heads, attn.head_dim
    core = tokens * H * (6 * K * K + (4 * KDA_CHUNK * K if phase == "prefill" else 0))
    state = seqs * (cache.layout.state_bytes + cache.layout.conv_bytes) * (1 + (context > 0))
    nbytes = Wb + 2 * tokens * bench.config.hidden_size * bench.a + state
    return Case(lambda: attn(norm(x), batch, cache), 2 * tokens * W + core, nbytes)


def _mla(bench, model, phase, tokens, seqs, context, tp, dcp):
    cfg, layer = bench.config, model.model.layers["1"]
    attn, norm = layer.self_attn, layer.input_layernorm
    batch = _batch(phase, tokens, seqs, context)
    cache = _cache(bench, 1, batch, tp, dcp)
    x = bench.randn(tokens, cfg.hidden_size)
    W, Wb = _params(norm, attn)
    kv_b, H, lat = attn.kv_b_proj.weight.numel(), attn.num_heads, cfg.mla_latent_size
    io = Wb + 2 * tokens * cfg.hidden_size * bench.a
    if phase == "decode":  # rank 0 of dcp holds positions 0, dcp, 2 dcp, ... <= context
        local = seqs * (context // dcp + 1)
        flops = 2 * tokens * W + local * H * dcp * 2 * (lat + cfg.kv_lora_rank)
        return Case(lambda: attn(norm(x), batch, cache), flops, io + local * lat * bench.a)
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(batch.seq_lens, batch.cached_lens))
    keys = tokens + seqs * context
    flops = (2 * tokens * (W - kv_b) + 2 * keys * kv_b
             + pairs * H * 2 * (cfg.q_head_dim + cfg.v_head_dim))  # fmt: skip
    return Case(lambda: attn(norm(x), batch, cache), flops, io + keys * lat * bench.a)


def _dense_ffn(bench, model, phase, tokens, seqs, context, tp, dcp):
    layer, D = model.model.layers["0"], bench.config.hidden_size
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    x = bench.randn(tokens, D)
    W, Wb = _params(norm, mlp)
    return Case(lambda: mlp(norm(x)), 2 * tokens * W, Wb + 2 * tokens * D * bench.a)


def _moe(bench, block, phase, tokens, seqs, context, tp, dcp):
    cfg, D = bench.config, bench.config.hidden_size
    norm, moe = block["norm"], block["moe"]
    x = bench.randn(tokens, D)
    batch = _batch(phase, tokens, seqs, context)
    batch.routes_out = {}
    moe(norm(x), batch)  # the routes, counted once (the timed calls route the same x)
    ids = batch.routes_out[moe.layer_idx]
    batch.routes_out = None
    num_local, first = next(moe.experts.parameters()).shape[0], moe.experts.first_expert
    mine = ids[(ids >= first) & (ids < first + num_local)]
    slots, touched = mine.numel(), int(mine.unique().numel())
    routed, routed_bytes = _params(moe.experts)
    W, Wb = _params(block)
    Din = cfg.routed_expert_hidden_size or D
    flops = 2 * tokens * (W - routed) + 2 * slots * 3 * Din * cfg.moe_intermediate_size
    nbytes = Wb - routed_bytes + touched * routed_bytes // num_local + 2 * tokens * D * bench.a
    return Case(lambda: moe(norm(x), batch), flops, nbytes)


def _attn_res(bench, model, phase, tokens, seqs, context, tp, dcp):
    layer, D = model.model.layers["1"], bench.config.hidden_size
    bank = [bench.randn(tokens, D) for _ in range(mean_bank(bench.config))]
    p, a, f = (bench.randn(tokens, D) for _ in range(3))
    mods = (layer.self_attention_res_proj, layer.self_attention_res_norm, layer.mlp_res_proj,
            layer.mlp_res_norm)  # fmt: skip

    def forward():  # DecoderLayer.forward's AttnRes steps, the mixer's and FFN's outputs given
        mix(Stream(bank, p), mods[0], mods[1])
        q = p + a
        mix(Stream(bank, q), mods[2], mods[3])
        return q + f

    n = len(bank) + 1  # candidates per mix
    flops = 2 * 6 * tokens * D * n + 2 * tokens * D
    return Case(forward, flops, _params(*mods)[1] + (2 * (n + 1) + 6) * tokens * D * bench.a)


def _head(bench, model, phase, tokens, seqs, context, tp, dcp):
    cfg, D = bench.config, bench.config.hidden_size
    n = cfg.num_attn_res_blocks  # the bank after the last layer: every block
    stream = Stream([bench.randn(tokens, D) for _ in range(n)], bench.randn(tokens, D))
    last = _batch(phase, tokens, seqs, context).last_token_idx
    head = model.lm_head

    def forward():  # K3Model.forward_batch's tail
        h = model.final_hidden(stream)
        if tokens != seqs:
            h = h[to_device(last, h.device)]
        return head(h)

    rows, V = len(last), head.weight.shape[0]
    mods = [model.model.norm, head]
    if n:
        mods += [model.model.output_attn_res_proj, model.model.output_attn_res_norm]
    mixed = (6 * tokens * D * (n + 1), (n + 2) * tokens * D * bench.a) if n else (0, 0)
    flops = 2 * rows * V * D + 2 * tokens * D + mixed[0]
    nbytes = _params(*mods)[1] + 2 * tokens * D * bench.a + rows * V * bench.a + mixed[1]
    return Case(forward, flops, nbytes)


_CASES = {"embed": _embed, "kda": _kda, "mla": _mla, "dense_ffn": _dense_ffn, "moe": _moe,
          "attn_res": _attn_res, "head": _head}  # fmt: skip
