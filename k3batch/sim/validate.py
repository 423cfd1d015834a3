"""`python -m k3batch.sim.validate`: the simulation against every measurement we have (issue 55's
validation table). Each row: the prediction from the calibration tables (`sim.calibration`),
the cluster catalog (`sim.cluster`) and the code (the engine's own scheduler on virtual-clock
runners, `sim.clock` / `sim.cost`; the volumes of `sim.comm`), beside the recorded value, their
ratio, the issue's tolerance and PASS / MISS. Nothing is fitted to these rows: a MISS says which
term of the model is off, from the recording's own facts (how it ran, what it measured beside).

Rows, each read from its file in benchmarks/ (measured values are only ever read there):
- engine (one H200, 10%): `bench engine` rows of k3-slice (`engine_k3slice_h200.jsonl`: the
  latest row of each batch, prompt_len, new_tokens, chunk_size and expert dtype; rows of a MoE
  GEMM other than the default left out), prefill tok/s and decode step ms, by bench engine's
  own procedure (`bench.engine.engine_throughput`) on a simulated engine (`sim.replay`).
- job (one H200, 10%): the latest `bench job` of k3-slice, 1,024 prompts of 1,024 -> 256
  (`job_h200.jsonl`), output tok/s after start-up (and the engine alone on the same prompts):
  the engine sized as the job sized it, run to its end by `sim.clock.drive`.
- layouts (two H200s of one node, 15%): `layouts_k3slice_h200x2.jsonl`, by `bench layouts`'
  procedures: PP2 prefill of one prompt in chunks through a `SimPipeline`, TP2 prefill as one
  rank's forwards one after another, TP2 and TP2/DCP2 decode steps.
- pd (two H200s, bytes exact, time 15%): the k3-slice handoff of `pd_h200x2.txt` (prose, parsed).
- fill (this machine's CPU; 10% of the fill, a tolerance chosen here, the issue names none):
  `pipeline_fill_cpu.json`, the fill of an 8-stage chunked prefill pipeline of k3-debug against
  chunk counts, predicted from a CPU calibration of k3-debug (measured by this command unless
  given) and a SimPipeline, beside the teaching n / (n + P - 1).
What no row models: host time (the engine's bookkeeping, sampling, launches: `HostCost` is zero
here), so a recording whose steps are host-bound reads slower than predicted.
Records: `--only 1,2 --out benchmarks/sim_validation_h200.txt` with the H200 tables (the
GPU rows; pd needs no table); `--only 3 --out benchmarks/sim_validation_cpu.txt` on the CPU
machine the fill was recorded on (the 2-core dev machine).
"""

import dataclasses
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from k3batch.bench.engine import teaching_fill
from k3batch.bench.layouts import LayoutBench, comm_bytes_per_1k
from k3batch.model import get_flavor
from k3batch.sim import records
from k3batch.sim.calibration import Calibration, experts_key
from k3batch.sim.cluster import GPUS, cluster_from
from k3batch.sim.records import BENCH, expert_dtype
from k3batch.sim.replay import (
    cpu_calibration,
    sim_decode_step,
    sim_engine,
    sim_handoff,
    sim_job,
    sim_pp_prefill,
    sim_tp_prefill,
)

TABLES = ("calibration_h200.jsonl", "calibration_h200_k3-slice.jsonl")  # k3, then k3-slice
GROUPS = ("engine", "job", "layouts", "pd", "fill")
TOLERANCE = {"engine": 0.10, "job": 0.10, "layouts": 0.15, "pd": 0.15, "fill": 0.10}
FILL_FLAVOR = "k3-debug"  # pipeline_fill_cpu: `make demo`'s model (benchmarks/README.md)
RECORD_CORES = 2  # pipeline_fill_cpu: "on the 2-core CPU dev machine" (benchmarks/README.md)


@dataclass(frozen=True, slots=True)
class Check:
    """One row of the table. tolerance: relative (0: must equal; None: shown, not judged);
    predicted None: no prediction (why says what is missing)."""

    group: str
    what: str
    predicted: float | None
    measured: float
    tolerance: float | None
    source: str  # the file the measured value comes from
    why: str = ""  # the model's terms where the two differ beyond the tolerance
    extra: str = ""  # shown after the verdict: figures beside the two (not judged)

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.measured

    @property
    def verdict(self) -> str:
        if self.predicted is None:
            return "N/A"
        if self.tolerance is None:
            return "-"
        if self.tolerance == 0:
            return "PASS" if self.predicted == self.measured else "MISS"
        return "PASS" if abs(self.ratio - 1) <= self.tolerance else "MISS"


# ---- the checks -------------------------------------------------------------------------------
def _when(row: dict) -> str:
    """When a record was taken: its commit and date, else the start of its note."""
    parts = [str(row[k]) for k in ("commit", "date") if row.get(k)]
    note = row.get("note") or row.get("code") or "no commit recorded"
    return ", ".join(parts) or note[:60]


def _host_words(records_dir: Path) -> str:
    """`bench host`'s host time per step (`host_cpu.jsonl`), for the MISS lines."""
    row = records.host_row(records_dir / "host_cpu.jsonl")
    if row is None:
        return "host time not measured"
    return (f"bench host: {row['prefill_host_ms_per_step']} ms per prefill step, "
            f"{row['decode_host_ms_per_step']} per decode step on the project's 2-core CPU, "
            f"host_cpu.jsonl")  # fmt: skip


def _outside(calibration, shapes, phases=("prefill", "decode")) -> str:
    """Where the simulated forwards of `phases` lie outside the table's points (there
    `part_s` extends the points' lines): token counts, and sequences per prefill forward."""
    words = []
    for phase in phases:
        points = [p for p in calibration.points if p.phase == phase]
        got = [(t, n) for kind, t, n in shapes if kind == phase]
        if not points or not got:
            continue
        lo, hi = min(p.tokens for p in points), max(p.tokens for p in points)
        least, most = min(t for t, _ in got), max(t for t, _ in got)
        if least < lo or most > hi:
            span = f"{least:,}" if least == most else f"{least:,}-{most:,}"
            words.append(f"{phase} forwards of {span} tokens (points {lo:,}-{hi:,})")
        seqs, top = max(n for _, n in got), max(p.seqs for p in points)
        if phase == "prefill" and seqs > top:
            words.append(f"prefill forwards of up to {seqs} sequences (points to {top})")
    return f"; extended beyond the table's points: {', '.join(words)}" if words else ""


def _judged(check: Check, why: str) -> Check:
    """check with its explanation where it misses."""
    return dataclasses.replace(check, why=why) if check.verdict == "MISS" else check


def _missing(group: str, what: str, measured: float, source: str, error: Exception) -> Check:
    """A row the calibration cannot predict: the KeyError names the points it lacks."""
    return Check(group, what, None, measured, TOLERANCE[group], source,
                 f"no prediction: {str(error).strip(chr(34))[:300]}")  # fmt: skip


def engine_checks(config, calibration, cluster, records_dir: Path = BENCH,
                  rows: list[dict] | None = None) -> list[Check]:  # fmt: skip
    """Prefill tok/s and decode step ms of each `bench engine` row (`records.engine_rows`),
    by `replay.sim_engine` with the row's experts, arena and overlap."""
    src = "engine_k3slice_h200.jsonl"
    rows = records.engine_rows(records_dir / src) if rows is None else rows
    out, host = [], _host_words(records_dir)
    for row in rows:
        dtype = expert_dtype(row)
        name = (f"{row['batch']} x {row['prompt_len']} -> {row['new_tokens']}, chunk "
                f"{row['chunk_size']}, {dtype}")  # fmt: skip
        prefill, decode = f"{name}: prefill tok/s", f"{name}: decode ms/step"
        # the arena as recorded (to 0.1 GiB); under 1 GiB the engine's default then (room for
        # max_num_seqs + 1 requests), which the rounded figure cannot give back
        arena = round(row["arena_gib"] * 2**30) if row.get("arena_gib", 0) >= 1 else None
        try:
            sim = sim_engine(config, calibration, cluster, batch=row["batch"],
                             prompt_len=row["prompt_len"], new_tokens=row["new_tokens"],
                             chunk_size=row["chunk_size"], experts=experts_key(config, dtype),
                             arena_bytes=arena, overlap=row.get("overlap", False))  # fmt: skip
        except (KeyError, ValueError) as e:
            out += [_missing("engine", prefill, row["prefill_tokens_per_s"], src, e),
                    _missing("engine", decode, row["decode_step_ms"], src, e)]  # fmt: skip
            continue
        tokens = row["batch"] * row["prompt_len"]
        steps = statistics.median(r[2] for r in sim["prefill_runs"])
        gap = 1e3 * (tokens / row["prefill_tokens_per_s"] - tokens / sim["prefill_tok_s"]) / steps
        if gap > 0:
            why = (f"the recording took {gap:.2f} ms per prefill step ({steps:g} steps) more "
                   f"than the calibrated parts sum to: host time per step is not modelled "
                   f"({host}); recorded at {_when(row)}")  # fmt: skip
        else:
            why = (f"the calibrated parts sum to {-gap:.2f} ms per prefill step ({steps:g} "
                   f"steps) more than the engine's forward took: the parts timed alone (eager, "
                   f"each its own launches) overstate the whole forward, or the kernels differ "
                   f"from the recording's ({_when(row)})")  # fmt: skip
        check = Check("engine", prefill, sim["prefill_tok_s"], row["prefill_tokens_per_s"],
                      TOLERANCE["engine"], src)  # fmt: skip
        out.append(_judged(check, why + _outside(calibration, sim["shapes"], ["prefill"])))
        gap = row["decode_step_ms"] - sim["decode_step_ms"]
        if not row.get("graphs"):
            why = (f"recorded eagerly (no CUDA graphs; {_when(row)}): the host's kernel "
                   f"launches bound that step; the calibration's decode points are graph "
                   f"replays")  # fmt: skip
        elif gap > 0:
            overlap = "on" if row.get("overlap") else "off: the host's step adds to each"
            why = (f"the step took {gap:.2f} ms more than its calibrated parts: host time "
                   f"between graph replays is not modelled (overlapped decode {overlap}; "
                   f"{host}); recorded at {_when(row)}")  # fmt: skip
        else:
            why = (f"the parts' graph replays, each alone, sum to {-gap:.2f} ms more than the "
                   f"step's one graph, or the kernels differ from the recording's "
                   f"({_when(row)})")  # fmt: skip
        out.append(_judged(Check("engine", decode, sim["decode_step_ms"], row["decode_step_ms"],
                                 TOLERANCE["engine"], src),
                           why + _outside(calibration, sim["shapes"], ["decode"])))  # fmt: skip
    return out


def job_checks(config, calibration, cluster, records_dir: Path = BENCH,
               row: dict | None = None) -> list[Check]:  # fmt: skip
    """Output tok/s of the latest k3-slice `bench job` (`records.job_row`), after start-up and
    of the engine alone on the same prompts, by `replay.sim_job`: MXFP4 experts (`bench job`
    writes K3 flavors so)."""
    src = "job_h200.jsonl"
    row = records.job_row(records_dir / src) if row is None else row
    name = f"{row['num_prompts']:,} x {row['input_len']:,} -> {row['output_len']}"
    measured = [("job, output tok/s after start-up", row["job_output_tokens_per_s_after_startup"])]
    if "engine_output_tokens_per_s" in row:
        measured.append(("engine alone, output tok/s", row["engine_output_tokens_per_s"]))
    try:
        sim = sim_job(config, calibration, cluster, row, experts=experts_key(config, "mxfp4"))
    except KeyError as e:
        return [_missing("job", f"{name}: {what}", value, src, e) for what, value in measured]
    out, host, tokens = [], _host_words(records_dir), row["num_prompts"] * row["output_len"]
    outside = _outside(calibration, sim["shapes"])
    for what, value in measured:
        gap = 1e3 * (tokens / value - sim["seconds"]) / sim["steps"]
        if gap > 0:
            why = (f"over the run's {sim['steps']} engine steps the recording spent {gap:.2f} ms "
                   f"per step more than the calibrated forwards: host time is not modelled "
                   f"({host}); recorded at {_when(row)}")  # fmt: skip
        else:
            why = (f"the calibrated forwards take {-gap:.2f} ms per step ({sim['steps']} steps) "
                   f"more than the recording's: the parts alone overstate the forwards, or the "
                   f"kernels differ from the recording's ({_when(row)})")  # fmt: skip
        out.append(_judged(Check("job", f"{name}: {what}", sim["output_tok_s"], value,
                                 TOLERANCE["job"], src), why + outside))  # fmt: skip
    return out


def _at_bandwidth(cluster, bytes_per_s: float):
    """cluster with its in-node link at another bandwidth (a recording's), latency kept."""
    name = f"{cluster.intra.name} at {bytes_per_s / 1e9:.0f} GB/s"
    intra = dataclasses.replace(cluster.intra, bytes_per_s=bytes_per_s, name=name)
    return dataclasses.replace(cluster, intra=intra)


def _layout_prefill(config, calibration, cluster, row: dict, experts: str, src: str) -> Check:
    """A PP-N or TP-N prefill row; where it misses, the prediction again with the link at the
    rate the recording measured beside the run (its ping, or its all-reduces alone: bytes
    moved per 1K tokens over the exposed time per 1K tokens), to tell the link from compute."""
    layout, n, measured = row["layout"], row["gpus"], row["tokens_per_s"]
    what = f"prefill {layout}, chunk {row['chunk_size']}: tok/s"
    kw = {"prompt_len": row.get("prompt_len", LayoutBench().prompt_len),
          "chunk_size": row["chunk_size"], "experts": experts}  # fmt: skip
    pp = layout.startswith("pp")

    def run(at):
        if pp:
            return sim_pp_prefill(config, calibration, at, num_stages=n, **kw)
        return sim_tp_prefill(config, calibration, at, tp=n, **kw)

    try:
        sim = run(cluster)
    except KeyError as e:
        return _missing("layouts", what, measured, src, e)
    recorded_bw = row["comm_bytes_per_1k"] / (row["exposed_comm_ms_per_1k"] / 1e3)
    at_recorded = kw["prompt_len"] / run(_at_bandwidth(cluster, recorded_bw))["seconds"]
    off = ("the link's rate is the term that is off"
           if abs(at_recorded / measured - 1) <= TOLERANCE["layouts"]
           else "the link does not account for the gap: the compute differs; "
           + _older_engine(BENCH))  # fmt: skip
    link = cluster.intra
    why = (f"{'the stream' if pp else 'the all-reduces'} assumed at {link.name}'s "
           f"{link.bytes_per_s / 1e9:.0f} GB/s per direction (published); the recording's "
           f"{'ping' if pp else 'all-reduces'} alone moved {recorded_bw / 1e9:.0f} GB/s (latency "
           f"included); at that rate {at_recorded:,.0f} tok/s: {off}")  # fmt: skip
    if pp:
        why += (f"; stage busy {', '.join(f'{b:.0%}' for b in sim['busy'])} predicted, stream "
                f"{1e3 * sim['stream_s_per_chunk']:.3f} ms per chunk")  # fmt: skip
    else:
        why += (f"; collectives {1e3 * sim['comm_s']:.1f} of {1e3 * sim['seconds']:.1f} ms "
                f"predicted (comm.py's volumes, a MoE layer all-reducing fp32 [T, Din + D]: "
                f"{comm_bytes_per_1k(config, n)['tp'] / 1e6:.0f} MB per 1K tokens per rank; the "
                f"recording timed [T, D] bf16 twice per layer, "
                f"{row['comm_bytes_per_1k'] / 1e6:.0f} MB)")  # fmt: skip
    predicted = kw["prompt_len"] / sim["seconds"]
    return _judged(Check("layouts", what, predicted, measured, TOLERANCE["layouts"], src), why)


def _layout_decode(config, calibration, cluster, row: dict, experts: str, src: str) -> Check:
    layout, n = row["layout"], row["gpus"]
    dcp = int(layout.split("dcp")[1]) if "dcp" in layout else 1
    what = f"decode {layout}, batch {row['batch']} at {row['context_len']:,}: ms/step"
    try:
        sim = sim_decode_step(config, calibration, cluster, tp=n, dcp=dcp, batch=row["batch"],
                              context_len=row["context_len"], steps=LayoutBench().decode_steps,
                              experts=experts)  # fmt: skip
    except KeyError as e:
        return _missing("layouts", what, row["step_ms"], src, e)
    why = (f"recorded eagerly (`bench layouts` calls the rank model's forward_batch, no CUDA "
           f"graphs): the host's launches bound the step; predicted "
           f"{1e3 * (sim['seconds'] - sim['comm_s']):.2f} ms of graph-replayed parts + "
           f"{1e3 * sim['comm_s']:.2f} ms of collectives at {cluster.intra.name}")  # fmt: skip
    return _judged(Check("layouts", what, 1e3 * sim["seconds"], row["step_ms"],
                         TOLERANCE["layouts"], src), why)  # fmt: skip


def layout_checks(config, calibration, cluster, records_dir: Path = BENCH,
                  rows: list[dict] | None = None) -> list[Check]:  # fmt: skip
    """`bench layouts` on GPUs of one node (`layouts_k3slice_h200x2.jsonl`): PP and TP
    prefill tok/s per chunk size, TP and TP/DCP decode step ms. The recordings ran bf16
    experts (K3Model's and the rank model's default) and `LayoutBench`'s prompt_len and
    decode_steps (the file's command, benchmarks/README.md)."""
    src = "layouts_k3slice_h200x2.jsonl"
    rows = records.read_jsonl(records_dir / src) if rows is None else rows
    experts = experts_key(config, "bf16")
    return [(_layout_prefill if row["phase"] == "prefill" else _layout_decode)(
        config, calibration, cluster, row, experts, src) for row in rows]  # fmt: skip


def pd_checks(config, cluster, records_dir: Path = BENCH, flavor: str = "k3-slice") -> list[Check]:
    """The handoff of `flavor`'s requests in pd_h200x2.txt (a 1+1 replica: one prefill stage,
    one decode rank): bytes per request (must equal) and milliseconds per request."""
    src, out = "pd_h200x2.txt", []
    for h in (h for h in records.pd_handoffs(records_dir / src) if h["flavor"] == flavor):
        sim = sim_handoff(config, cluster, num_tokens=h["input_len"])
        name = f"handoff 1+1, {h['input_len']:,}-token request"
        check = Check("pd", f"{name}: bytes", sim["bytes"], h["bytes"], 0, src)
        out.append(_judged(check, "comm.handoff_bytes differs from the packed buffers received"))
        link = cluster.p2p_link(0, 1)
        at = _at_bandwidth(cluster, h["gb_per_s"] * 1e9)
        at_recorded = sim_handoff(config, at, num_tokens=h["input_len"])["seconds"]
        why = (f"the link assumed at {link.name}'s {link.bytes_per_s / 1e9:.0f} GB/s per "
               f"direction (published) while the recording measured {h['gb_per_s']} GB/s per "
               f"request (posting the receives -> data in memory; one NCCL send): at that rate "
               f"{1e3 * at_recorded:.3f} ms")  # fmt: skip
        out.append(_judged(Check("pd", f"{name}: ms", 1e3 * sim["seconds"], h["ms"],
                                 TOLERANCE["pd"], src), why))  # fmt: skip
    return out


def fill_checks(calibration, records_dir: Path = BENCH, record: dict | None = None) -> list[Check]:
    """The fill of the chunked prefill pipeline per chunk count (`pipeline_fill_cpu.json`),
    predicted by a SimPipeline of its stages costed from a CPU table of FILL_FLAVOR; the
    stream between the stage actors is not charged (no link model of this CPU). Beside each,
    not judged: the teaching fill, and the wall time predicted with a device per stage and on
    RECORD_CORES cores (the longer of that and the stages' summed compute over the cores)."""
    src = "pipeline_fill_cpu.json"
    record = records.fill_record(records_dir / src) if record is None else record
    config, P, T = get_flavor(FILL_FLAVOR), record["stages"], record["chunk_tokens"]
    out, experts = [], experts_key(config, "bf16")  # dense: the loader widened MXFP4 then
    for row in record["rows"]:
        n = row["chunks"]
        sim = sim_pp_prefill(config, calibration, None, num_stages=P, prompt_len=n * T,
                             chunk_size=T, experts=experts, links=False)  # fmt: skip
        on_cores = max(sim["seconds"], sum(sim["busy"]) * sim["seconds"] / RECORD_CORES)
        extra = (f"teaching {teaching_fill(n, P):.3f}; wall {sim['seconds']:.2f} s with a "
                 f"device per stage, {on_cores:.2f} s on {RECORD_CORES} cores (the stages' "
                 f"compute shared), {row['wall_s']:.2f} s measured")  # fmt: skip
        why = (f"the simulation gives each of the {P} stages its own device, the recording's "
               f"{P} stage actors shared {RECORD_CORES} cores (stages computing at once slow "
               f"each other: measured busy {', '.join(f'{b:.0%}' for b in row['busy'])}, "
               f"predicted {', '.join(f'{b:.0%}' for b in sim['busy'])}); the stream between "
               f"actors is not charged")  # fmt: skip
        what = f"P = {P}, {n} chunk{'s' * (n > 1)} of {T} tokens: fill"
        out.append(_judged(Check("fill", what, sim["fill"], row["fill"], TOLERANCE["fill"], src,
                                 extra=extra), why))  # fmt: skip
    return out


def _older_engine(records_dir: Path) -> str:
    """The single-GPU prefill of the first `bench engine` rows (recorded before the prefill
    kernels, as were the 2-GPU layouts rows): the calibration has today's kernels."""
    rows = [json.loads(line) for line in (records_dir / "engine_k3slice_h200.jsonl").open()
            if line.strip()][:2]  # fmt: skip
    tps = sorted(r["prefill_tokens_per_s"] for r in rows)
    return (f"the recording predates the prefill kernels (one H200's engine then: "
            f"{tps[0]:,.0f}-{tps[-1]:,.0f} tok/s, the first rows of engine_k3slice_h200.jsonl; "
            "the calibration measures today's)")


# ---- the table --------------------------------------------------------------------------------
def run_checks(groups=GROUPS, *, calibration=None, cpu_table=None, flavor: str = "k3-slice",
               records_dir: Path = BENCH) -> list[Check]:  # fmt: skip
    """The checks of `groups` (of GROUPS): engine and job on one H200 (`cluster_from("h200x1")`),
    layouts and pd on one node of two (`"h200x2"`), with `calibration` (the GPU table, as
    measured: its GPU is the cluster's) for `flavor`; fill with `cpu_table` (a CPU table of
    FILL_FLAVOR)."""
    config, out = get_flavor(flavor), []
    one, two = cluster_from("h200x1"), cluster_from("h200x2")
    if "engine" in groups:
        out += engine_checks(config, calibration, one, records_dir)
    if "job" in groups:
        out += job_checks(config, calibration, one, records_dir)
    if "layouts" in groups:
        out += layout_checks(config, calibration, two, records_dir)
    if "pd" in groups:
        out += pd_checks(config, two, records_dir, flavor)
    if "fill" in groups:
        out += fill_checks(cpu_table, records_dir)
    return out


def table_lines(label: str, cal: Calibration) -> list[str]:
    """A calibration table's header: GPU, clocks, commit, command."""
    h = cal.header
    clocks = (f"SM {h['sm_mhz']}/{h['max_sm_mhz']} MHz, power limit {h['power_limit_w']:g} W"
              if "sm_mhz" in h else "no clocks (not a GPU)")  # fmt: skip
    first = (f"calibration {label}: {h.get('gpu')}, flavor {h.get('flavor')}, "
             f"{h.get('dtype')}, {clocks}, commit {h.get('commit')}, {h.get('time')}, "
             f"{len(cal.points)} points")  # fmt: skip
    return [first, f"  command: {h.get('command')}"]


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"


GROUP_TITLES = {
    "engine": "1. one H200: bench engine, k3-slice",
    "job": "1. one H200: bench job, k3-slice",
    "layouts": "2. two H200s (one node): bench layouts, k3-slice",
    "pd": "2. two H200s (one node): the 1+1 handoff, k3-slice",
    "fill": "3. CPU: the fill of a chunked prefill pipeline, k3-debug, stage actors on 2 cores",
}
VERDICTS = ("PASS", "MISS", "N/A")  # judged; "-": shown, not judged


def format_checks(checks: list[Check]) -> list[str]:
    """The rows by group, each group's MISS and N/A lines after it, and a tally."""
    lines, tally = [], dict.fromkeys(VERDICTS, 0)
    for group in GROUPS:
        rows = [c for c in checks if c.group == group]
        if not rows:
            continue
        exact = ", bytes exact" if group == "pd" else ""
        title = f"## {GROUP_TITLES[group]} ({rows[0].source}; tolerance {TOLERANCE[group]:.0%}"
        columns = (f"{'id':<4} {'measurement':<62} {'predicted':>12} {'measured':>12} "
                   f"{'pred/meas':>9} {'verdict':>7}")  # fmt: skip
        lines += ["", f"{title}{exact})", columns]
        notes = []
        for i, c in enumerate(rows, 1):
            cid = f"{group[0].upper()}{i}"
            ratio = "-" if c.ratio is None else f"{c.ratio:.3f}"
            line = (f"{cid:<4} {c.what:<62} {_num(c.predicted):>12} {_num(c.measured):>12} "
                    f"{ratio:>9} {c.verdict:>7}")  # fmt: skip
            lines.append(f"{line}  {c.extra}" if c.extra else line)
            if c.verdict in tally:
                tally[c.verdict] += 1
            if c.verdict in ("MISS", "N/A"):
                notes.append(f"  {c.verdict} {cid}: {c.why}")
        lines += notes
    counts = ", ".join(f"{v} {n}" for v, n in tally.items())
    return [*lines, "", f"tally: {counts} of {sum(tally.values())} judged rows"]


def _groups(only: str | None) -> tuple[str, ...]:
    if not only:
        return GROUPS
    numbered = {"1": ("engine", "job"), "2": ("layouts", "pd"), "3": ("fill",)}
    out = []
    for word in only.split(","):
        word = word.strip()
        if word not in GROUPS and word not in numbered:
            raise click.BadParameter(f"{word!r}: rows are {', '.join(GROUPS)} or 1, 2, 3")
        out += numbered.get(word, (word,))
    return tuple(g for g in GROUPS if g in out)


def _shown(path: str) -> str:
    """A path as the table shows it: from the repository's root when inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(BENCH.parent)) if p.is_relative_to(BENCH.parent) else path


def header_lines(groups, tables: list[tuple[str, Calibration]],
                 cpu: tuple[str, Calibration] | None) -> list[str]:  # fmt: skip
    """The command, the calibration tables' headers, the clusters, what is not modelled."""
    command = f"python -m k3batch.sim.validate {' '.join(sys.argv[1:])}".rstrip()
    lines = [("# sim validation: predicted (calibration tables + communication model + the "
              "engine's own scheduler on a virtual clock) vs measured; nothing fitted to these "
              "rows"), f"# command: {command}"]  # fmt: skip
    for label, cal in [*tables, *([cpu] if cpu else [])]:
        lines += table_lines(label, cal)
    for name, preset, need in (("engine, job", "h200x1", {"engine", "job"}),
                               ("layouts, pd", "h200x2", {"layouts", "pd"})):  # fmt: skip
        if need & set(groups):
            first, *rest = cluster_from(preset).lines()
            lines += [f"cluster ({name} rows): {first}", *rest]
    lines.append("not modelled: host time (HostCost 0: the engine's bookkeeping, sampling and "
                 "eager launches), the driver's intake and writes")  # fmt: skip
    return lines


@click.command()
@click.option("--calibration", "tables", default=None,
              show_default=",".join(f"benchmarks/{t}" for t in TABLES),
              help="GPU calibration tables (JSONL), comma-separated, merged in order "
              "(`Calibration.merge`: a later table's points of a part replace an earlier "
              "one's).")  # fmt: skip
@click.option("--cpu-calibration", "cpu_path",
              type=click.Path(exists=True, dir_okay=False),
              help="CPU table of k3-debug for the fill rows (default: measured now).")  # fmt: skip
@click.option("--only", help="Rows: of engine, job, layouts, pd, fill; or 1 (engine, job), "
              "2 (layouts, pd), 3 (fill).")  # fmt: skip
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Also write it here.")
def main(tables, cpu_path, only, out_path):
    """The validation table: predicted (calibration + communication model + the engine on a
    virtual clock) against every recorded measurement."""
    groups = _groups(only)
    loaded, cpu = [], None
    if {"engine", "job", "layouts"} & set(groups):
        for path in (tables or ",".join(str(BENCH / t) for t in TABLES)).split(","):
            if not Path(path).is_file():
                raise click.UsageError(f"calibration table {path} does not exist: run "
                                       "`k3batch bench calibrate` on an H200 (or --only "
                                       "pd,fill)")  # fmt: skip
            loaded.append((_shown(path), Calibration.load(path)))
    if "fill" in groups:
        cpu = ((_shown(cpu_path), Calibration.load(cpu_path)) if cpu_path
               else (f"measured by this command ({os.cpu_count()} cores here)",
                     cpu_calibration(FILL_FLAVOR)))  # fmt: skip
    cal = Calibration.merge(c for _, c in loaded) if loaded else None
    lines = header_lines(groups, loaded, cpu)
    if cal is not None and "H200" not in cal.gpu:
        measured = cal.gpu
        cal = cal.on(GPUS["h200"])
        lines.append(f"note: the tables were measured on {measured}, the records on H200s: the "
                     f"points are carried to the H200 ({cal.source})")  # fmt: skip
    lines += format_checks(run_checks(groups, calibration=cal, cpu_table=cpu and cpu[1]))
    text = "\n".join(lines)
    click.echo(text)
    if out_path:
        Path(out_path).write_text(text + "\n")


if __name__ == "__main__":
    main()
