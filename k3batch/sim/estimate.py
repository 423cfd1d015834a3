"""`k3batch plan --estimate`: how long a job takes on a cluster, layout by layout.

For each candidate layout (a single GPU; or pp prefill stages + a tp decode group with DCP 1
or tp, as `parallel.plan` counts them) the planner first says whether the weights and one
request fit (`make_plan`): a layout that does not fit is refused with its reason, as `plan`
refuses it. A layout that fits is run: the engine's own scheduler (`sim.cost.build_replica`:
the real `Engine` over virtual-clock runners) on a sample of the workload, with each forward
costed from the calibration table (one GPU's measured layer parts, carried to the cluster's GPU
by its peak rates when it is another) and each transfer and collective from the communication
model at the cluster's links (`sim.comm`, `sim.cluster`).

The job's length comes from two runs of one replica, of n and 2n requests (n: twice the
replica's max_num_seqs, at least 32): the second run's extra time is the marginal time of n
requests at the replica's steady state, so fill and drain are counted once:
T(N) = T(n) + (N - n) / n x (T(2n) - T(n)) for the N = num_prompts / replicas requests of one
replica (all replicas alike and independent: they share no link). Replicas: as many whole
ones as the cluster holds. Output tok/s per GPU = the job's output tokens / (T x GPUs used).
TTFT and per-user tok/s are the medians over the 2n-request run of admission -> first token and
of (output tokens - 1) / (first token -> last token). What binds: the busiest device's share of
the run (the decode group, or the busiest prefill stage), the pipeline bubble (1 - the stages'
mean busy fraction while they have work), and the links' share of a stage's time.

Assumptions, printed with every estimate: requests generate their `max_new_tokens` (EOS never
comes early); routing spreads tokens over experts as uniformly as the calibration's random
routing did; the host adds `HostCost` per step (the engine's bookkeeping, measured by `bench
host`), hidden behind the device by the overlapped decode where the engine overlaps.
"""

import dataclasses
import math
import statistics
from dataclasses import dataclass

import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.request import SamplingParams
from k3batch.parallel.plan import Plan, make_plan, pool_bytes
from k3batch.parallel.search import tp_sizes
from k3batch.sim.clock import HostCost, drive
from k3batch.sim.cost import build_replica
from k3batch.sim.records import BENCH, recorded_tables
from k3batch.sim.workload import Workload

DEFAULT_TABLE = BENCH / recorded_tables()[0]  # the recorded k3 table (the H200's, else the H100's)
MIN_SAMPLE = 32  # requests of the first run, at least


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutEstimate:
    pp: int
    tp: int
    dcp: int
    gpus: int  # per replica
    replicas: int
    fits: bool
    why: str = ""  # does not fit / not run: the reason
    max_num_seqs: int = 0
    job_s: float = 0.0
    output_tok_s_per_gpu: float = 0.0
    gpu_hours: float = 0.0
    ttft_s: float = 0.0  # median: admission -> first token
    user_tok_s: float = 0.0  # median per request, after its first token
    binds: str = ""
    busy: dict = dataclasses.field(default_factory=dict)  # device -> busy fraction

    @property
    def name(self) -> str:
        if self.pp == 1 and self.tp == 1:
            return "1 GPU"
        return f"pp{self.pp}+tp{self.tp}" + (f"/dcp{self.dcp}" if self.dcp > 1 else "")


def candidates(config, gpu: str, num_gpus: int, *, dcps=None, **plan_kw) -> list[Plan]:
    """The layouts of at most num_gpus GPUs per replica: one GPU; pp in powers of two up to
    the layer count, tp in `tp_sizes`, dcp 1 or tp (or `dcps`), pp + tp GPUs. Plans of every
    one, fitting or not, in order of GPUs per replica."""
    pps = [1 << i for i in range(8) if 1 << i <= config.num_hidden_layers]
    plans = []
    for pp in pps:
        for tp in tp_sizes(config, num_gpus):
            gpus = 1 if pp == tp == 1 else pp + tp
            if gpus > num_gpus:
                continue
            for dcp in sorted({1, tp} if dcps is None else {d for d in dcps if tp % d == 0}):
                plans.append(make_plan(config, gpu=gpu, pp_size=pp, tp_size=tp, dcp_size=dcp,
                                       **plan_kw))  # fmt: skip
    return sorted(plans, key=lambda p: (p.num_gpus, p.pp_size, p.dcp_size))


def _stage_pools(plan: Plan) -> list[int]:
    """Each prefill stage's arena: what its GPU has left after its weights and the reserve
    (`plan.pool_bytes`, the formula the runners size their pools by)."""
    return [pool_bytes(plan.gpu_bytes, plan.memory_fraction, w, plan.reserve_bytes)
            for w in plan.stage_weight_bytes]  # fmt: skip


def _replica(config, plan: Plan, calibration, cluster, engine_config: EngineConfig,
             max_seq_len: int, pipeline_only: bool = False):
    single = plan.is_single_device
    engine_config = dataclasses.replace(engine_config, cache_bytes=0,
                                        max_seq_len=max(engine_config.max_seq_len, max_seq_len))
    return build_replica(
        config, engine_config, calibration, cluster, arena_bytes=plan.pool_bytes,
        pp_layers=None if single else plan.stage_layers, tp=plan.tp_size, dcp=plan.dcp_size,
        disaggregate=not (single or pipeline_only),
        stage_arena_bytes=None if single else _stage_pools(plan),
    )  # fmt: skip


def run_replica(config, plan: Plan, calibration, cluster, workload: Workload, num_requests: int,
                *, engine_config: EngineConfig, host: HostCost | None = None, seed: int = 0,
                pipeline_only: bool = False) -> tuple[list, object, object]:  # fmt: skip
    """num_requests of the workload through one replica of `plan`'s layout on the virtual
    clock; returns (timed requests, engine, clock). pipeline_only: the plan's stages prefill
    and decode, no decode group (a replica of pp stages and tp 1, not disaggregated)."""
    engine, clock = _replica(config, plan, calibration, cluster, engine_config,
                             workload.max_seq_len, pipeline_only)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for i, (n_in, n_out) in enumerate(workload.sample(num_requests)):
        # distinct prompts: the prefix cache must not share them
        ids = torch.randint(1, engine.vocab_size, (n_in,), generator=gen).tolist()
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_new_tokens=n_out,
                                                       ignore_eos=True))  # fmt: skip
    timed = drive(engine, clock, host)
    return timed, engine, clock


def estimate_layout(config, plan: Plan, calibration, cluster, workload: Workload, *,
                    engine_config: EngineConfig, host: HostCost | None = None,
                    sample: int | None = None) -> LayoutEstimate:  # fmt: skip
    """One layout's estimate (see the module doc); `sample`: n, the first run's requests."""
    base = {"pp": plan.pp_size, "tp": plan.tp_size, "dcp": plan.dcp_size, "gpus": plan.num_gpus}
    replicas = cluster.num_gpus // plan.num_gpus
    if not plan.fits:
        return LayoutEstimate(**base, replicas=replicas, fits=False, why="; ".join(plan.problems))
    if replicas < 1:
        return LayoutEstimate(**base, replicas=0, fits=False,
                              why=f"needs {plan.num_gpus} GPUs, the cluster has {cluster.num_gpus}")
    per_replica = math.ceil(workload.num_prompts / replicas)
    engine, _ = _replica(config, plan, calibration, cluster, engine_config, workload.max_seq_len)
    seqs = engine.config.max_num_seqs
    n = min(per_replica, sample or max(MIN_SAMPLE, 2 * seqs))
    timed, _, clock = run_replica(config, plan, calibration, cluster, workload, n,
                                  engine_config=engine_config, host=host)  # fmt: skip
    job_s = t1 = clock.now
    if per_replica > n:  # the marginal time of n requests at the steady state
        timed, _, clock = run_replica(config, plan, calibration, cluster, workload, 2 * n,
                                      engine_config=engine_config, host=host)  # fmt: skip
        job_s = t1 + (per_replica - n) / n * (clock.now - t1)
    gpus_used = replicas * plan.num_gpus
    started = [t for t in timed if t.first_token_s is not None]
    rates = [(len(t.result.output_token_ids) - 1) / (t.finish_s - t.first_token_s)
             for t in started if t.finish_s > t.first_token_s]  # fmt: skip
    busy = _busy(clock, clock.now)
    return LayoutEstimate(
        **base, replicas=replicas, fits=True, max_num_seqs=seqs, job_s=job_s,
        output_tok_s_per_gpu=workload.total_output_tokens() / (job_s * gpus_used),
        gpu_hours=job_s * gpus_used / 3600,
        ttft_s=statistics.median(t.first_token_s - t.admitted_s for t in started),
        user_tok_s=statistics.median(rates) if rates else 0.0,
        binds=_binds(config, plan, calibration, cluster, busy, clock), busy=busy,
    )  # fmt: skip


def _busy(clock, span_s: float) -> dict[str, float]:
    """Busy fraction of each device over the run: the decode group's ranks (in lockstep: one
    figure), each prefill stage, or the one device."""
    out = {}
    for (runner, stage), seconds in clock.busy.items():
        key = runner if runner != "prefill" else f"stage {stage}"
        out[key] = seconds / span_s if span_s > 0 else 0.0
    return out


def _binds(config, plan: Plan, calibration, cluster, busy: dict[str, float], clock) -> str:
    """What bounds the replica: its busiest device, that device's median batch split into the
    time of parts bound by FLOPs, by bytes (each part as its nearest calibration point) and of
    collectives; the stages' mean busy fraction; the decode group's time receiving handoffs."""
    if not busy:
        return "nothing ran"
    top = max(busy, key=busy.get)
    words = [f"{top} busy {100 * busy[top]:.0f}%"]
    runner, stage = ("prefill", int(top.split()[1])) if top.startswith("stage") else (top, 0)
    spans = [s for s in clock.trace if s.kind in ("prefill", "decode") and s.runner == runner
             and s.stage == stage]  # fmt: skip
    if spans:
        kind = max(("prefill", "decode"), key=lambda k: sum(s.end - s.start for s in spans
                                                             if s.kind == k))  # fmt: skip
        spans = sorted((s for s in spans if s.kind == kind), key=lambda s: s.end - s.start)
        words.append(_split(config, plan, calibration, cluster, runner, stage,
                            spans[len(spans) // 2]))  # fmt: skip
    stages = [v for k, v in busy.items() if k.startswith("stage")]
    if len(stages) > 1:
        words.append(f"stages busy {100 * sum(stages) / len(stages):.0f}% on average")
    waits = sum(s.end - s.start for s in clock.trace if s.kind == "import")
    if waits and clock.now > 0:
        words.append(f"decode group receiving handoffs {100 * waits / clock.now:.0f}% of the run")
    return "; ".join(words)


def _split(config, plan: Plan, calibration, cluster, runner: str, stage: int, span) -> str:
    """One batch of a device: the % of its time in FLOP-bound parts, byte-bound parts and
    collectives."""
    from k3batch.model.forward_batch import ForwardBatch
    from k3batch.sim.cost import StepCost

    if runner == "prefill":
        layers, tp, dcp = range(*plan.stage_layers[stage]), 1, 1
        embed, head = stage == 0, stage == plan.pp_size - 1
    else:
        layers, tp, dcp = range(config.num_hidden_layers), plan.tp_size, plan.dcp_size
        embed = head = True
    cost = StepCost(config, calibration, cluster, layer_ids=layers, tp=tp, dcp=dcp, embed=embed,
                    head=head)  # fmt: skip
    batch = ForwardBatch(seq_lens=list(span.seq_lens), cached_lens=list(span.cached_lens))
    phase = "decode" if all(n == 1 for n in batch.seq_lens) else "prefill"
    by = {"FLOP": 0.0, "byte": 0.0}
    for part, t in cost.parts_s(batch).items():
        experts = cost.experts if part == "moe" else ""
        by[_bound(calibration, part, phase, tp, cost.shard_dcp(part), experts,
                  batch.num_tokens)] += t  # fmt: skip
    comm = cost.comm_s(batch)
    total = sum(by.values()) + comm
    shares = [f"{100 * v / total:.0f}% {k}-bound" for k, v in by.items() if v]
    if comm:
        shares.append(f"{100 * comm / total:.0f}% collectives")
    return f"its {phase} of {batch.num_tokens:,} tokens: " + ", ".join(shares)


def _bound(calibration, part, phase, tp, dcp, experts, tokens) -> str:
    """'FLOP' or 'byte': what binds the calibration point of this part nearest in tokens."""
    pts = [p for p in calibration.points if (p.part, p.phase, p.tp, p.dcp, p.experts)
           == (part, phase, tp, dcp, experts)]  # fmt: skip
    p = min(pts, key=lambda p: abs(math.log(p.tokens / tokens)))
    flops_s, bytes_s = p.flops / calibration.peak_flops, p.bytes / calibration.peak_bytes_per_s
    return "FLOP" if flops_s >= bytes_s else "byte"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobEstimate:
    flavor: str
    workload: Workload
    cluster: object  # sim.cluster.ClusterSpec
    calibration: object  # sim.calibration.Calibration, on the cluster's GPU
    engine_config: EngineConfig
    rows: tuple[LayoutEstimate, ...]

    @property
    def best(self) -> LayoutEstimate | None:
        """The layout that finishes first (most output tok/s of the whole cluster)."""
        run = [r for r in self.rows if r.fits]
        return min(run, key=lambda r: r.job_s, default=None)

    def lines(self) -> list[str]:
        w, ec = self.workload, self.engine_config
        out = [
            f"estimate: {self.flavor}, {w.source}",
            f"  mean {w.mean_input:,.0f} tokens in, {w.mean_output:,.0f} out; engine: chunk_size "
            f"{ec.chunk_size}, max_num_seqs {ec.max_num_seqs or 'auto'}, page_size {ec.page_size}",
            *self.cluster.lines(),
            f"calibration: {self.calibration.source}",
            (f"{'layout':<16} {'GPUs':>4} {'repl':>4} {'tok/s/GPU':>9} {'time':>9} "
             f"{'GPU-h':>9} {'TTFT s':>7} {'tok/s/user':>10}  binds"),
        ]  # fmt: skip
        best = self.best
        for r in self.rows:
            if not r.fits:
                verdict = "" if r.why.startswith("fits") else "refused: "
                out.append(f"{r.name:<16} {r.gpus:>4} {r.replicas:>4}  {verdict}{r.why}")
                continue
            mark = "  <- fastest" if r is best else ""
            out.append(
                f"{r.name:<16} {r.gpus:>4} {r.replicas:>4} {r.output_tok_s_per_gpu:>9,.0f} "
                f"{_duration(r.job_s):>9} {r.gpu_hours:>9,.0f} {r.ttft_s:>7.2f} "
                f"{r.user_tok_s:>10.1f}  {r.binds} (max_num_seqs {r.max_num_seqs}){mark}"
            )
        if best is None:
            out.append(self.no_estimate())
        out += [
            "assumed: every request generates its max_new_tokens (no early EOS); expert routing "
            "as uniform as the calibration's; replicas alike and independent; the host's step "
            "time as given (hidden by the overlapped decode where the engine overlaps)",
        ]
        return out

    def no_estimate(self) -> str:
        if any(r.why.startswith("fits") for r in self.rows):
            return ("no layout estimated: those that fit lack calibration points for their "
                    "shards (`k3batch bench calibrate --tp ...` on the GPU)")
        return "no layout fits this cluster"

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def estimate_job(config, flavor: str, cluster, workload: Workload, *, calibration,
                 engine_config: EngineConfig, layouts: list[tuple[int, int, int]] | None = None,
                 host: HostCost | None = None, sample: int | None = None,
                 **plan_kw) -> JobEstimate:  # fmt: skip
    """Every candidate layout (or `layouts`: (pp, tp, dcp) each) of `config` on `cluster`,
    planned, and run on the virtual clock where it fits. calibration: measured on some GPU
    (`Calibration.load`); carried to the cluster's GPU by its (derated) peak rates when that
    is another (`Calibration.on`). plan_kw: `make_plan`'s memory_fraction, reserve_bytes,
    page_size."""
    from k3batch.sim.cluster import derated

    gpu = cluster.gpu
    if calibration.gpu.lower().replace("nvidia ", "") != gpu.name.lower():
        calibration = calibration.on(derated(gpu))
    plan_kw = {"context_len": workload.max_seq_len, "page_size": engine_config.page_size,
               "gpu_bytes": gpu.memory_bytes, **plan_kw}  # fmt: skip
    if layouts is None:
        plans = candidates(config, gpu.name, cluster.num_gpus, **plan_kw)
    else:
        plans = [make_plan(config, gpu=gpu.name, pp_size=pp, tp_size=tp, dcp_size=dcp, **plan_kw)
                 for pp, tp, dcp in layouts]  # fmt: skip
    rows = []
    for p in plans:
        try:
            rows.append(estimate_layout(config, p, calibration, cluster, workload,
                                        engine_config=engine_config, host=host, sample=sample))
        except KeyError as e:  # the table lacks this layout's shard: say which
            rows.append(LayoutEstimate(pp=p.pp_size, tp=p.tp_size, dcp=p.dcp_size,
                                       gpus=p.num_gpus, replicas=cluster.num_gpus // p.num_gpus,
                                       fits=False, why=f"fits, not estimated: {e.args[0]}"))
    rows = tuple(rows)
    return JobEstimate(flavor=flavor, workload=workload, cluster=cluster,
                       calibration=calibration, engine_config=engine_config, rows=rows)  # fmt: skip
