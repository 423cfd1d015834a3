"""The checks of the validation table (`sim.validate`): each recorded measurement beside its
prediction from the calibration, the cluster catalog and the code, judged against the issue's
tolerance, and per MISS the term of the model that is off (from the recording's own facts).
The rows and what each compares are in `sim.validate`'s docstring.
"""

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from k3batch.bench.engine import teaching_fill
from k3batch.bench.layouts import LayoutBench, comm_bytes_per_1k
from k3batch.model import get_flavor
from k3batch.sim import records
from k3batch.sim.calibration import experts_key
from k3batch.sim.records import BENCH, expert_dtype, recorded_tables
from k3batch.sim.replay import (
    sim_decode_step,
    sim_engine,
    sim_handoff,
    sim_job,
    sim_pp_prefill,
    sim_tp_prefill,
)

TABLES = recorded_tables()  # k3, then k3-slice
GROUPS = ("engine", "job", "layouts", "pd", "fill")
FEW_DECODE_TOKENS = 8  # a bench row of at most this many new tokens times few decode steps
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
            if row["new_tokens"] <= FEW_DECODE_TOKENS:
                why += (f"; only {row['new_tokens'] - 1} steps were timed, so the host's fixed "
                        f"cost at the decode's start and end (the overlap's fill and drain, the "
                        f"last sync) is spread over few steps: Kimi Linear on one H100 took "
                        f"28.29 ms a step at batch 256 over 3 steps, 24.09 over 63 "
                        f"(engine_kimi_linear_h100.txt)")
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
