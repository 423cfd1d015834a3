"""The real scheduler on a virtual clock (`k3batch.sim.clock`): the engine over the runners'
twins makes the batches it makes over the real runners (same steps, same batches: seq_lens,
cached_lens, KDA blocks and page tables, in the same order), and the clock moves by the costs
as the module doc says (a hand-computed pipeline timeline, batches overlapping in the
pipeline, the overlapped decode hiding host time).

Against the real runners: one device, LocalRunner on k3batch.testing.K3_MINI (the schedule does
not depend on depth; k3-debug's 93 layers cost ten times as much); disaggregated, the Ray
prefill pipeline (pp 2) and decode group (tp 2, dcp 2) of tests/parallel/test_decode_group.py.
There the engine's schedule also depends on when a prefill batch is `ready` and a handoff's
export has run on every stage (`exported`), wall-clock facts: the real run is given the
answers the simulation's clock gave (the real batch or export is waited for where the answer is
yes), so both run one schedule and any difference is the runners'."""

import dataclasses
import itertools

import pytest
import torch

from k3batch.actors.world import spawn_runners
from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import Phase, SamplingParams
from k3batch.engine.runner import LocalRunner
from k3batch.model import get_flavor
from k3batch.model.forward_batch import ForwardBatch
from k3batch.parallel.layout import ParallelLayout, split_layers
from k3batch.sim import comm
from k3batch.sim.clock import HostCost, SimDecodeGroup, SimPipeline, SimRunner, VirtualClock, drive
from k3batch.sim.cluster import cluster_from
from k3batch.sim.cost import LinkCost, StepCost, build_replica
from k3batch.testing import K3_MINI, batch_key, random_prompts

GREEDY = SamplingParams(temperature=0, max_new_tokens=14, ignore_eos=True)


def _record(runner, role: str, log: list) -> None:
    """Log every batch `runner` is submitted, and every request handed over through it."""
    submit = runner.submit

    def spy(ids, batch, all_logits, **feed):
        log.append((role, batch_key(batch)))
        return submit(ids, batch, all_logits, **feed)

    runner.submit = spy
    for name in ("export_request", "import_request"):
        if hasattr(runner, name):
            call = getattr(runner, name)
            setattr(runner, name, lambda block, pages, x, call=call, name=name: (
                log.append((name, block, tuple(pages))) or call(block, pages, x)))  # fmt: skip


# ---- one device ---------------------------------------------------------------------------------
ONE = EngineConfig(max_num_seqs=4, max_seq_len=64, chunk_size=16, max_batch_tokens=32,
                   page_size=4)  # fmt: skip


@pytest.mark.parametrize(
    "prefix_cache,prompts",
    [
        (False, random_prompts([37, 5, 44, 23, 30, 12])),
        (True, random_prompts([9, 21, 3, 9, 14], seed=1, prefix=range(100, 123))),
    ],
    ids=["retraction", "prefix-cache"],
)
def test_one_device_schedule_is_the_real_runners(model_factory, prefix_cache, prompts):
    """Prompts longer than chunk_size and an arena of 2.6 requests of max_seq_len: requests
    wait for room and are retracted; with shared prefixes, admissions hit the prefix cache.
    The real runner pads decode batches (its static path: CUDA graphs' on a GPU)."""
    model = model_factory("k3-mini")
    request_bytes = LocalRunner(model, ONE).cache.layout.request_bytes(ONE.max_seq_len)
    cfg = dataclasses.replace(ONE, prefix_cache=prefix_cache,
                              cache_bytes=int(2.6 * request_bytes))  # fmt: skip
    real = LocalRunner(model, cfg, static_decode=True)
    want, got = [], []
    _record(real, "device", want)
    engine = Engine(model, cfg, runner=real)
    ref = engine.generate(prompts, GREEDY)
    sim = SimRunner(model.config, cfg, lambda batch: 1e-3 * batch.num_tokens, dtype=torch.float32)
    _record(sim, "device", got)
    twin = Engine(None, cfg, runner=sim)
    for i, p in enumerate(prompts):
        twin.add_request(str(i), p, GREEDY)
    out = {t.result.request_id: t.result for t in drive(twin, sim.clock)}
    assert sim.cache_specs() == real.cache_specs()
    assert got == want
    assert [(len(r.output_token_ids), r.finish_reason) for r in ref] == [
        (len(out[str(i)].output_token_ids), out[str(i)].finish_reason) for i in range(len(ref))
    ]
    assert vars(twin.pool.stats) == vars(engine.pool.stats)
    stats = engine.pool.stats
    assert stats.retracted > 0 if not prefix_cache else stats.prefix_hits >= 3
    assert sim.clock.now == pytest.approx(sum(s.end - s.start for s in sim.clock.trace))


# ---- disaggregated: the Ray pipeline and decode group -------------------------------------------
PD = EngineConfig(
    max_num_seqs=4,
    max_seq_len=64,
    chunk_size=6,
    max_batch_tokens=12,
    page_size=4,
    cache_bytes=3 * 29184,
)  # 3 requests of 64 tokens on a decode rank
PP, TP, DCP = 2, 2, 2


RANGES = split_layers(K3_MINI.num_hidden_layers, PP, K3_MINI.attn_res_block_size)
LINKS = LinkCost(K3_MINI, cluster_from("h200x8"), RANGES, tp=TP, dcp=DCP, dtype_bytes=4)


def _sim_pd(clock):
    costs = [lambda b: 2e-3 * b.num_tokens, lambda b: 3e-3 * b.num_tokens]
    prefill = SimPipeline(
        K3_MINI,
        PD,
        RANGES,
        costs,
        stream_s=LINKS.stream_s,
        handoff_s=LINKS.handoff_s,
        clock=clock,
        dtype=torch.float32,
    )
    decode = SimDecodeGroup(K3_MINI, PD, lambda b: 0.01, tp=TP, dcp=DCP, clock=clock,
                            dtype=torch.float32)  # fmt: skip
    return prefill, decode


def _run(engine, prompts) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    out = {}
    while engine.has_unfinished():
        out |= {r.request_id: r for r in engine.step()}
    return out


def _answering(runner, answers: list) -> None:
    """Log the answers of `runner`'s non-blocking questions, (question, answer) in order."""
    for name in ("ready", "exported"):
        ask = getattr(runner, name)
        setattr(runner, name, lambda x, ask=ask, name=name: (
            answers.append((name, ask(x))) or answers[-1][1]))  # fmt: skip


def test_disaggregated_schedule_is_the_real_runners(local_ray, mini_model_dir):
    """pp 2 -> tp 2 / dcp 2 with prefill slower than a decode step (ready() and exported() say
    no several times: decode steps run while a handoff's export waits behind prefill batches),
    a decode arena of 3 requests (retraction on the decode side) and six prompts. The handoff's
    bytes per decode rank (`LinkCost.handoff_bytes`, from `sim.comm`) are what the real ranks
    received."""
    prompts = random_prompts([11, 4, 23, 17, 30, 8], seed=5)
    clock = VirtualClock()
    sim_prefill, sim_decode = _sim_pd(clock)
    got, answers = [], []
    _record(sim_prefill, "prefill", got)
    _record(sim_decode, "decode", got)
    _answering(sim_prefill, answers)
    twin = Engine(None, PD, runner=sim_prefill, decode_runner=sim_decode)
    sim_out = _run(twin, prompts)
    for name in ("ready", "exported"):
        assert {(name, False), (name, True)} <= set(answers), name

    prefill, decode = spawn_runners(
        mini_model_dir, num_stages=PP, decode_layout=ParallelLayout(tp_size=TP, dcp_size=DCP),
        engine_config=PD, device="cpu", dtype=torch.float32,
    )  # fmt: skip
    try:
        assert sim_prefill.cache_specs() == prefill.cache_specs()
        assert sim_decode.cache_specs() == decode.cache_specs()
        want, replay = [], iter(answers)

        def replayed(name, wait):  # the simulation's answer; a yes waits for the real thing
            def answer(x):
                asked, yes = next(replay)
                assert asked == name
                if yes:
                    wait(x)
                return yes

            return answer

        prefill.ready = replayed("ready", prefill.wait)
        prefill.exported = replayed("exported", prefill.wait_exported)
        _record(prefill, "prefill", want)
        _record(decode, "decode", want)
        engine = Engine(None, PD, runner=prefill, decode_runner=decode)
        out = _run(engine, prompts)
        assert next(replay, None) is None  # asked as often
        received = decode.stats()["handoff_bytes_per_rank"]
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert got == want
    assert [len(sim_out[k].output_token_ids) for k in sorted(out)] == [
        len(out[k].output_token_ids) for k in sorted(out)
    ]
    assert twin.cache_stats() == engine.cache_stats()
    assert engine.decode_pool.stats.retracted > 0
    sent = [LINKS.handoff_bytes(s.stage, s.seq_lens[0]) for s in clock.trace if s.kind == "handoff"]
    assert [sum(rank) for rank in zip(*sent)] == received


# ---- the clock ----------------------------------------------------------------------------------
def _batch(*seq_lens):
    return ForwardBatch(seq_lens=list(seq_lens), cached_lens=[0] * len(seq_lens))


def _pipeline(clock, **kw):
    cfg = EngineConfig(max_num_seqs=2, max_seq_len=64, page_size=4)
    return SimPipeline(K3_MINI, cfg, [(0, 4), (4, 9)], [lambda b: 1.0, lambda b: 2.0],
                       clock=clock, **kw)  # fmt: skip


def test_two_stage_pipeline_timeline_by_hand():
    """Stage costs 1 and 2, the stream 0.5. Batch A: stage 0 [0, 1], sent [1, 1.5], stage 1
    [1.5, 3.5]. Batch B (submitted at once: depth 2): stage 0 [1, 2], but stage 1 receives
    only when free: sent [3.5, 4], stage 1 [4, 6]. Then a handoff at 6.5 of 10 tokens (0.1
    s per stage) into a decode group busy until 7: both stages send at 7, it ends at 7.1, and
    the group's next step starts then."""
    clock = VirtualClock()
    pipe = _pipeline(clock, stream_s=lambda s, b: 0.5, handoff_s=lambda s, n: 0.01 * n)
    a, b = pipe.submit([0] * 3, _batch(3), False), pipe.submit([0] * 2, _batch(2), False)
    times = [(s.stage, s.kind, s.start, s.end) for s in clock.trace]
    assert times == [(0, "prefill", 0, 1), (0, "stream", 1, 1.5), (1, "prefill", 1.5, 3.5),
                     (0, "prefill", 1, 2), (0, "stream", 3.5, 4), (1, "prefill", 4, 6)]  # fmt: skip
    assert not pipe.ready(a)
    assert pipe.wait(a).shape == (1, 16) and clock.now == 3.5
    assert pipe.ready(a) and not pipe.ready(b)
    pipe.wait(b)
    assert clock.now == 6 and pipe.bubble() == {"busy": [2 / 6, 4 / 6], "bubble": 0.5,
                                                "span_s": 6}  # fmt: skip
    group = SimDecodeGroup(K3_MINI, pipe.engine_config, lambda b: 1.0, clock=clock)
    clock.now = 6.0
    group.submit([0], _batch(1), False)  # [6, 7]
    clock.now = 6.5
    group.import_request(0, [0, 1, 2], pipe.export_request(0, [0, 1, 2], 10))
    handoffs = [(s.stage, s.start, s.end) for s in clock.trace if s.kind == "handoff"]
    assert handoffs == [(0, 7, 7.1), (1, 7, 7.1)]
    assert group.submit([0], _batch(1), False).end == pytest.approx(8.1)


def test_import_waits_for_the_export_only_if_called_early():
    """Stage costs 1 and 2, a batch submitted at 0 (stage 0 [0, 1], stage 1 [1, 3]) and a
    handoff of 10 tokens exported at 0.5: stage 0 runs the export at 1, stage 1 at 3, so it
    is `exported` at 3 (`wait_exported` moves the clock there). Imported then (as the engine
    does), the group is busy for the transfer alone, [3, 3.1], and a decode step submitted at
    1 ran at once, [1, 2]. Imported at 0.5 (as the engine did before), the group is held from
    0.5 to 3.1, and that decode step starts at 3.1."""
    for early in (False, True):
        clock = VirtualClock()
        pipe = _pipeline(clock, handoff_s=lambda s, n: 0.01 * n)
        group = SimDecodeGroup(K3_MINI, pipe.engine_config, lambda b: 1.0, clock=clock)
        pipe.submit([0] * 3, _batch(3), False)
        clock.now = 0.5
        sent = pipe.export_request(0, [0, 1, 2], 10)
        assert not pipe.exported(sent)
        if early:
            group.import_request(0, [0, 1, 2], sent)
        clock.now = 1.0
        step = group.submit([0], _batch(1), False)
        assert not pipe.exported(sent)
        pipe.wait_exported(sent)
        assert clock.now == 3 and pipe.exported(sent)
        if not early:
            group.import_request(0, [0, 1, 2], sent)
        imports = [(s.start, s.end) for s in clock.trace if s.kind == "import"]
        handoffs = [(s.stage, s.start, s.end) for s in clock.trace if s.kind == "handoff"]
        if early:
            assert imports == [(0.5, pytest.approx(3.1))] and step.end == pytest.approx(4.1)
            assert handoffs == [(0, 1, 1.1), (1, 3, pytest.approx(3.1))]
        else:
            assert imports == [(3, pytest.approx(3.1))] and step.end == 2
            assert handoffs == [(0, 3, pytest.approx(3.1)), (1, 3, pytest.approx(3.1))]


def test_decode_steps_are_not_held_behind_an_export():
    """The engine over the twins, pp 2 stages of 0.1 s per batch -> a decode group of 50 ms
    steps: prompts of 1-7 chunks finish while others decode, and their exports wait behind
    the batches queued on the stages. Decode steps run meanwhile (between an export and the
    moment every stage has run it), and each import holds the group for its transfer alone
    (handoff_s per stage, the stages sending at once)."""
    clock = VirtualClock()
    pipe = SimPipeline(K3_MINI, PD, RANGES, [lambda b: 0.1] * 2, clock=clock,
                       handoff_s=lambda s, n: 1e-4 * n, dtype=torch.float32)  # fmt: skip
    group = SimDecodeGroup(K3_MINI, PD, lambda b: 0.05, tp=TP, dcp=DCP, clock=clock,
                           dtype=torch.float32)  # fmt: skip
    exports, export = [], pipe.export_request  # (time, sent, whether any request decodes)

    def spy(*args):
        decoding = any(r.phase is Phase.DECODE for r in engine.running)
        exports.append((clock.now, export(*args), decoding))
        return exports[-1][1]

    pipe.export_request = spy
    engine = Engine(None, PD, runner=pipe, decode_runner=group)
    out = _run(engine, random_prompts([29, 5, 17, 11, 23, 8, 40, 3], seed=6))
    assert sorted(len(r.output_token_ids) for r in out.values()) == [14] * 8
    decode = [s.start for s in clock.trace if s.kind == "decode"]
    waited = [(t, max(sent.ready)) for t, sent, decoding in exports
              if decoding and max(sent.ready) > t]  # fmt: skip
    assert len(waited) >= 5
    assert all(any(t <= d < ready for d in decode) for t, ready in waited)
    imports = [s for s in clock.trace if s.kind == "import"]
    assert len(imports) == len(exports) >= 8
    transfers = [1e-4 * s.seq_lens[0] for s in imports]
    assert [s.end - s.start for s in imports] == pytest.approx(transfers)


def test_pipeline_stages_work_at_once():
    """The engine keeps `depth` prompt chunks in flight across steps, each step taking the
    oldest: on two stages of cost c, two chunks take 3 c, not 4 c (stage 0 works on the second
    chunk while stage 1 works on the first), and six chunks 7 c in six steps, stage 0 never
    idle (waiting for each step's chunks before the next took 9 c: 3 c a pair)."""
    clock = VirtualClock()
    cfg = EngineConfig(max_num_seqs=1, max_seq_len=64, chunk_size=8, max_batch_tokens=8,
                       page_size=4, prefix_cache=False)  # fmt: skip
    pipe = SimPipeline(K3_MINI, cfg, [(0, 4), (4, 9)], [lambda b: 1.0] * 2, clock=clock)
    engine = Engine(None, cfg, runner=pipe)
    engine.add_request("a", list(range(48)), SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.step()
    assert clock.now == 2.0 and len(engine._prefilling) == 1  # the first of two taken
    for _ in range(5):
        engine.step()
    s0 = [s for s in clock.trace if s.stage == 0 and s.kind == "prefill"]
    s1 = [s for s in clock.trace if s.stage == 1]
    assert len(s0) == 6 and clock.now == 7.0 and not engine.has_unfinished()
    assert [(a.start, b.start) for a, b in zip(s0, s1)] == [(k, k + 1) for k in range(6)]


@pytest.mark.parametrize("host_s", [0.004, 0.015])
def test_overlapped_decode_hides_host_time(host_s):
    """Decode steps of 10 ms with host_s of host work per step: overlapped, a step takes
    max(10 ms, host_s); not overlapped, 10 ms + host_s. The prefill step takes its device
    time + host_s either way."""
    for overlap in (True, False):
        cfg = EngineConfig(
            max_num_seqs=2, max_seq_len=64, page_size=4, overlap=overlap, prefix_cache=False
        )
        sim = SimRunner(K3_MINI, cfg, lambda b: 0.01)
        engine = Engine(None, cfg, runner=sim)
        engine.add_request("a", [1] * 8, SamplingParams(max_new_tokens=20, ignore_eos=True))
        drive(engine, sim.clock, HostCost(prefill_s=host_s, decode_s=host_s))
        starts = [s.start for s in sim.clock.trace]
        assert [s.kind for s in sim.clock.trace] == ["prefill"] + ["decode"] * 19
        assert starts[1] == pytest.approx(0.01 + host_s)
        step = max(0.01, host_s) if overlap else 0.01 + host_s
        gaps = [b - a for a, b in itertools.pairwise(starts[2:])]
        assert gaps == pytest.approx([step] * len(gaps))


# ---- costs --------------------------------------------------------------------------------------
RATE = {"embed": 1e-6, "kda": 2e-6, "mla": 3e-6, "dense_ffn": 4e-6, "moe": 5e-6, "attn_res": 6e-7,
        "head": 7e-6}  # fmt: skip


class FakeCalibration:
    """part_s = RATE[part] x tokens (+ 1e-9 x context for mla); records what it is asked."""

    def __init__(self):
        self.asked = {}

    def part_s(self, part, *, phase, tp, dcp, tokens, seqs, context_tokens, experts=""):
        self.asked[part] = (phase, tp, dcp, tokens, seqs, context_tokens, experts)
        return RATE[part] * tokens + (1e-9 * context_tokens if part == "mla" else 0.0)


def test_step_cost_sums_the_parts_of_the_layers_held():
    """k3-debug's 93 layers: 69 KDA and 24 MLA (spec: every 4th and the last), layer 0's dense
    FFN and 92 MoE, 93 AttnRes; with the embedding and the head."""
    cal = FakeCalibration()
    cost = StepCost(get_flavor("k3-debug"), cal, None, layer_ids=range(93), embed=True,
                    head=True)  # fmt: skip
    batch = ForwardBatch(seq_lens=[5, 7], cached_lens=[0, 16])
    layer = 69 * 2e-6 + 24 * 3e-6 + 4e-6 + 92 * 5e-6 + 93 * 6e-7
    assert cost.forward_s(batch) == pytest.approx(12 * (1e-6 + layer + 7e-6) + 24 * 16e-9)
    assert cal.asked["moe"] == ("prefill", 1, 1, 12, 2, 16, "8x2 bf16")
    assert cal.asked["head"] == ("prefill", 1, 1, 12, 2, 16, "")


def test_step_cost_of_a_decode_rank_adds_its_collectives():
    """A tp 2 / dcp 2 rank of K3_MINI in a decode step: mla at its DCP shard, the rest at dcp 1,
    plus the collectives `sim.comm` lists at the node's link; a stage at tp 1 has none."""
    cal, cluster = FakeCalibration(), cluster_from("h200x8")
    rank = StepCost(K3_MINI, cal, cluster, layer_ids=range(9), tp=2, dcp=2, embed=True,
                    head=True)  # fmt: skip
    batch = ForwardBatch(seq_lens=[1] * 4, cached_lens=[10, 20, 30, 40])
    items = comm.collectives(K3_MINI, range(9), 4, 4, 2, 2, head=True)
    assert rank.forward_s(batch) - rank.compute_s(batch) == pytest.approx(
        comm.collectives_s(items, cluster)
    )
    assert rank.comm_s(batch) > 0
    assert cal.asked["mla"][:3] == ("decode", 2, 2) and cal.asked["kda"][:3] == ("decode", 2, 1)
    stage = StepCost(K3_MINI, cal, cluster, layer_ids=range(4, 9), embed=False, head=True)
    assert stage.comm_s(batch) == 0
    assert stage.compute_s(batch) == pytest.approx(
        4 * (3 * 2e-6 + 2 * 3e-6 + 5 * 5e-6 + 5 * 6e-7 + 7e-6) + 2 * 100e-9
    )


def test_link_cost_takes_the_link_between_the_gpus():
    """Stage 0 -> 1 within a node (NVLink) or across nodes (one GPU per node: InfiniBand); the
    handoff sends each decode rank its share, one send after another."""
    batch = ForwardBatch(seq_lens=[6, 4], cached_lens=[0, 0])
    stream = comm.pp_stream_bytes(K3_MINI, RANGES[1][0], 10, 4)
    for name, link in (("h200x8", "intra"), ("h200x1x4", "inter")):
        cluster = cluster_from(name)
        links = LinkCost(K3_MINI, cluster, RANGES, tp=TP, dcp=DCP, dtype_bytes=4)
        assert links.stream_s(0, batch) == comm.p2p_s(stream, getattr(cluster, link))
        shares = [comm.handoff_bytes(K3_MINI, 10, range(4, 9), tp=2, dcp=2, dcp_rank=r,
                                     dtype_bytes=4) for r in (0, 1)]  # fmt: skip
        assert links.handoff_bytes(1, 10) == shares
        assert links.handoff_s(1, 10) == pytest.approx(
            sum(comm.p2p_s(n, getattr(cluster, link)) for n in shares)
        )


@pytest.mark.parametrize(
    "pp_layers,tp,dcp,runners",
    [(None, 1, 1, {"device"}), (RANGES, 1, 1, {"prefill"}),
     (RANGES, 2, 2, {"prefill", "decode"}), (None, 2, 1, {"prefill", "decode"})],
    ids=["one-device", "pp2", "pp2-tp2-dcp2", "pp1-tp2"],
)  # fmt: skip
def test_build_replica_runs_every_layout(pp_layers, tp, dcp, runners):
    """A replica of each kind, built from plain numbers, runs a small job to its end with the
    runners `actors.build.build_engine` would make; each request is admitted, then has its
    first token, then finishes."""
    cfg = EngineConfig(max_num_seqs=4, max_seq_len=64, chunk_size=8, page_size=4)
    engine, clock = build_replica(K3_MINI, cfg, FakeCalibration(), cluster_from("h200x8"),
                                  arena_bytes=1 << 20, pp_layers=pp_layers, tp=tp, dcp=dcp)  # fmt: skip
    for i, p in enumerate(random_prompts([20, 9, 30], seed=2)):
        engine.add_request(str(i), p, GREEDY)
    timed = drive(engine, clock)
    assert sorted(len(t.result.output_token_ids) for t in timed) == [14] * 3
    assert all(0 <= t.admitted_s < t.first_token_s < t.finish_s <= clock.now for t in timed)
    assert {s.runner for s in clock.trace} == runners
