"""The communication model against the code it models: the collectives a real rank model issues
(recorded through groups that only log), the real packed stream of a pipeline stage, the real
handoff buffers, and `k3batch bench comm`'s figures; then the time formulas on round numbers."""

import dataclasses

import pytest
import torch
from click.testing import CliRunner

from k3batch.bench.layouts import comm_bytes_per_1k
from k3batch.cache.layout import CacheLayout
from k3batch.cache.paged import PagedCache
from k3batch.cli import main
from k3batch.model import K3Model, get_flavor
from k3batch.model.init import init_random_
from k3batch.parallel import handoff
from k3batch.parallel.layout import ParallelLayout, split_layers
from k3batch.parallel.pipeline import pack_stream
from k3batch.parallel.tp import build_rank_model
from k3batch.sim.cluster import Link, cluster_from
from k3batch.sim.comm import (
    Collective,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    boundary_stream_bytes,
    collective_s,
    collectives,
    collectives_s,
    dcp_bytes,
    handoff_bytes,
    p2p_s,
    pp_stream_bytes,
    tp_all_reduce_bytes,
)
from k3batch.testing import K3_MINI, slot_batch, slot_cache

K3_MINI_H4 = dataclasses.replace(K3_MINI, kda_num_heads=4, num_attention_heads=4)  # TP 4


class _RecordingGroup:
    """A ParallelGroup of `size` seen from rank `rank` that logs (kind, bytes, size) of every
    collective and returns tensors of the right shapes (values are not what a group would give:
    only the shapes and the order matter here)."""

    def __init__(self, rank: int, size: int, log: list):
        self.group, self.rank, self.size, self.log = None, rank, size, log

    def all_reduce(self, t):
        self.log.append(("all_reduce", t.nbytes, self.size))
        return t

    def all_gather(self, t, dim):
        out = torch.cat([t] * self.size, dim=dim)
        self.log.append(("all_gather", out.nbytes, self.size))
        return out

    def all_to_all(self, tensors):
        self.log.append(("all_to_all", sum(t.nbytes for t in tensors), self.size))
        return list(tensors)


@pytest.mark.parametrize(
    "config, tp, dcp, seq_lens, cached_lens",
    [
        pytest.param(K3_MINI, 2, 1, [5, 3], [0, 0], id="k3-mini-tp2-prefill-B2-T8"),
        pytest.param(K3_MINI, 2, 1, [4, 1], [6, 9], id="k3-mini-tp2-mixed-B2-T5"),
        pytest.param(K3_MINI, 2, 2, [1, 1, 1], [7, 4, 9], id="k3-mini-tp2-dcp2-decode-B3"),
        pytest.param(K3_MINI_H4, 4, 2, [1, 1], [7, 4], id="k3-mini-h4-tp4-dcp2-decode-B2"),
        pytest.param(get_flavor("kimi-linear-debug"), 2, 2, [1, 1], [3, 8],
                     id="kimi-linear-debug-tp2-dcp2-decode-B2"),  # fmt: skip
    ],
)
def test_collectives_equal_what_the_rank_model_issues(config, tp, dcp, seq_lens, cached_lens):
    log = []
    layout = ParallelLayout(tp_size=tp, dcp_size=dcp)
    model = build_rank_model(config, layout, _RecordingGroup(0, tp, log),
                             _RecordingGroup(0, dcp, log), dtype=torch.bfloat16,
                             device="cpu")  # fmt: skip
    init_random_(model, seed=0).eval().set_backend("torch")
    layers = range(config.num_hidden_layers)
    cache = slot_cache(config, layers, num_slots=len(seq_lens), max_seq_len=32, device="cpu",
                       dtype=torch.bfloat16, tp_size=tp, dcp_size=dcp)  # fmt: skip
    batch = slot_batch(cache, seq_lens, cached_lens, range(len(seq_lens)))
    with torch.no_grad():
        model.forward_batch(torch.zeros(sum(seq_lens), dtype=torch.long), batch, cache)
    want = collectives(config, layers, sum(seq_lens), len(seq_lens), tp, dcp, head=True)
    assert log == [tuple(c) for c in want]  # kinds, bytes, group sizes and order
    assert sum(c.nbytes for c in want if c.kind == "all_reduce" and c.group_size == tp) == (
        tp_all_reduce_bytes(config, layers, sum(seq_lens))
    )
    dcp_traffic = sum(c.nbytes for c in want[:-1] if c.kind != "all_reduce")  # [-1]: the head
    assert dcp_traffic == dcp_bytes(config, len(seq_lens), tp, dcp) * len(config.mla_layer_ids)


def test_collectives_refuse_what_the_model_refuses():
    assert collectives(K3_MINI, range(9), 8, 2) == []  # tp 1: no collective
    with pytest.raises(ValueError, match="decode steps only"):
        collectives(K3_MINI, range(9), 8, 2, tp=2, dcp=2)
    with pytest.raises(ValueError, match="does not divide"):
        collectives(K3_MINI, range(9), 8, 2, tp=4)  # K3_MINI has 2 heads


@pytest.mark.parametrize("config", [K3_MINI, get_flavor("kimi-linear-debug")],
                         ids=["k3-mini-block4", "kimi-linear-debug-no-attnres"])  # fmt: skip
@pytest.mark.parametrize("boundary", [1, 3, 4, 5, 8])
def test_pp_stream_bytes_equal_the_packed_stream(config, boundary):
    stage = K3Model(config, layer_range=(0, boundary), dtype=torch.bfloat16)
    init_random_(stage, seed=0).eval().set_backend("torch")
    T = 7
    cache = slot_cache(config, range(boundary), num_slots=1, max_seq_len=16, device="cpu",
                       dtype=torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        stream = stage.run_layers(stage.embed(torch.arange(T)), slot_batch(cache, [T], [0], [0]),
                                  cache)  # fmt: skip
    assert pack_stream(stream).nbytes == pp_stream_bytes(config, boundary, T)


@pytest.mark.parametrize(
    "config, tp, dcp, stage_layers, num_tokens",
    [
        pytest.param(K3_MINI, 1, 1, range(9), 13, id="k3-mini-tp1-all-layers-L13"),
        pytest.param(K3_MINI, 2, 2, range(9), 13, id="k3-mini-tp2-dcp2-all-layers-L13"),
        pytest.param(K3_MINI_H4, 4, 4, range(4, 9), 11, id="k3-mini-h4-tp4-dcp4-stage-4:9-L11"),
        pytest.param(K3_MINI_H4, 4, 2, range(0, 4), 1, id="k3-mini-h4-tp4-dcp2-stage-0:4-L1"),
    ],
)
def test_handoff_bytes_equal_the_packed_pieces(config, tp, dcp, stage_layers, num_tokens):
    """The stage's single-device cache of one request, cut for every rank and packed as the
    prefill actor sends it: Manifest.num_bytes (and handoff.handoff_bytes, the same here: no
    tensor needs padding at these widths)."""
    layout = CacheLayout.build(config, stage_layers, page_size=4, dtype_bytes=2)
    cache = PagedCache(layout, layout.request_bytes(num_tokens), device="cpu",
                       dtype=torch.bfloat16)  # fmt: skip
    full = cache.request_tensors(0, list(range(layout.pages_for(num_tokens))), num_tokens)
    for rank in range(tp):
        pieces = handoff.reshard_request(full, config, ParallelLayout(tp_size=tp, dcp_size=dcp),
                                         rank)  # fmt: skip
        _, manifest = handoff.pack(pieces, "cpu")
        want = handoff_bytes(config, num_tokens, stage_layers, tp=tp, dcp=dcp,
                             dcp_rank=rank % dcp)  # fmt: skip
        assert manifest.num_bytes == handoff.handoff_bytes(pieces) == want, rank


def test_handoff_bytes_of_k3_slice_equal_the_measured_handoff():
    """benchmarks/pd_h200x2.txt: k3-slice, 1,024-token prompts, 1+1 disaggregated on 2 H200s:
    41,435,136 B per request. K3 at TP8: tests/parallel/test_handoff_bytes.py's figures."""
    assert handoff_bytes(get_flavor("k3-slice"), 1024, range(8)) == 41_435_136
    k3 = get_flavor("k3")
    for dcp, rank0_tokens in ((1, 1000), (8, 125)):
        got = handoff_bytes(k3, 1000, range(93), tp=8, dcp=dcp)
        assert got == 54_263_808 + 1_907_712 + rank0_tokens * 27_648


@pytest.mark.parametrize(
    "flavor, gpus",
    [("k3", 2), ("k3", 4), ("k3", 8), ("k3", 16), ("k3-slice", 2), ("k3-slice", 4),
     ("k3-slice", 8)],
)  # fmt: skip
def test_volumes_equal_bench_comm(flavor, gpus):
    """`k3batch bench comm` prints per 1K tokens the TP-N bytes per rank (2(N-1)/N of every
    all-reduce of a forward, ring) and the PP-N bytes at the widest boundary."""
    config = get_flavor(flavor)
    reduces = collectives(config, range(config.num_hidden_layers), 1000, 1, tp=gpus)
    tp = int(sum(c.nbytes for c in reduces) * 2 * (gpus - 1) / gpus)
    pp = max(boundary_stream_bytes(config, gpus, 1000))
    assert comm_bytes_per_1k(config, gpus) == {"tp": tp, "pp": pp, "tp_all_reduces": len(reduces)}
    ranges = split_layers(config.num_hidden_layers, gpus, config.attn_res_block_size)
    assert pp == max(pp_stream_bytes(config, first, 1000) for first, _ in ranges[1:])
    out = CliRunner().invoke(main, ["bench", "comm", "--flavor", flavor, "--gpus", str(gpus),
                                    "--p2p-gbps", "100", "--busbw-gbps", "200"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert f"{tp / 1e6:,.1f} MB per rank ({len(reduces)} all-reduces)" in out.output
    assert f"-> {tp / 200e6:.2f} ms at 200 GB/s" in out.output
    assert f"{pp / 1e6:,.1f} MB at the widest stage boundary -> {pp / 100e6:.2f} ms" in out.output


def test_collective_times_follow_the_ring_formulas():
    link = Link(400e9, 1e-6, "test")
    assert p2p_s(4e6, link) == pytest.approx(1e-6 + 10e-6)
    assert all_reduce_s(8e6, 8, link) == pytest.approx(14e-6 + 2 * 7 / 8 * 8e6 / 400e9)
    assert all_gather_s(8e6, 8, link) == pytest.approx(7e-6 + 7 / 8 * 8e6 / 400e9)
    assert all_to_all_s(8e6, 8, link) == pytest.approx(7e-6 + 7 / 8 * 8e6 / 400e9)
    for fn in (all_reduce_s, all_gather_s, all_to_all_s):
        assert fn(8e6, 1, link) == 0.0  # a group of one: the code skips the collective


def test_collective_times_at_a_cluster_pick_the_link():
    cluster = cluster_from({"gpu": "h200", "gpus_per_node": 8, "nodes": 2,
                            "intra": {"gb_per_s": 400, "latency_us": 1},
                            "inter": {"gb_per_s": 50, "latency_us": 5}})  # fmt: skip
    intra, inter = cluster.intra, cluster.inter
    c8 = Collective("all_reduce", 8_000_000, 8)
    assert collective_s(c8, cluster) == all_reduce_s(8_000_000, 8, intra)
    # 16 GPUs: a ring over 2 nodes at the NIC's bandwidth; of its 15 steps 1 crosses the network
    c16 = Collective("all_reduce", 8_000_000, 16)
    latency = (14 * 1e-6 + 5e-6) / 15
    assert collective_s(c16, cluster) == pytest.approx(
        2 * 15 * latency + 2 * 15 / 16 * 8e6 / 50e9
    )
    # an all-to-all over 16: 7 parts within the node, 8 over the network, at the same time
    a16 = Collective("all_to_all", 16_000_000, 16)
    assert collective_s(a16, cluster) == pytest.approx(
        max(7e6 / 400e9, 8e6 / 50e9) + 7 * 1e-6 + 8 * 5e-6
    )
    assert collectives_s([c8, c16, a16], cluster) == pytest.approx(
        sum(collective_s(c, cluster) for c in (c8, c16, a16))
    )
    assert inter.bytes_per_s == 50e9
    with pytest.raises(ValueError, match="does not fit"):
        collective_s(Collective("all_reduce", 1, 32), cluster)
