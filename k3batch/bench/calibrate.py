"""`k3batch bench calibrate`: each part of ONE layer of a flavor timed alone on one device, at the
shapes the layouts give it: the table `k3batch.sim.calibration` reads. What a part is, how a
TP rank's share of it is built and what is counted: `bench/layer_parts.py`.

Shapes. Prefill: chunks of `prefill_tokens` in one sequence, and for kda, mla and head in
`prefill_seqs` sequences; mla also after `prefill_contexts` cached tokens (one sequence: the
later chunks of a long prompt attend its prefix). Decode: `decode_batches` sequences, mla at
each of `contexts` and each dcp of `dcp` that divides tp; the other parts at the first context
(they do not depend on it). moe for each of `experts` (bf16, mxfp4).
Order: tp as given (the layouts' degrees first: 1, 8, 16, then 2, 4), all of one tp's points
before the next's; within a tp the probe's parts (prefill, then decode), the MoE per expert
dtype, MLA decode per DCP degree. A shape that does not fit memory is skipped with a note (so
is a point that fails); no point or model build starts after `budget_s`.
Timing. Prefill runs eagerly, as the engine runs it (at small chunks the host's launches may
bound a part alone); decode as replays of a CUDA graph of the part, as the engine's decode
step. Each point: a warm-up (compilation, autotuning), then the median of `repeats` by CUDA
events (`bench.kernels.time_ms`; perf_counter on the CPU). Random weights made on the device;
caches of zeros.
Table: appended to `out_path` (`benchmarks/calibration_<gpu>.jsonl`): a header row (GPU, SM
clock, commit, command, versions, the peak rates efficiency is taken against), one row per
point as it is measured (a run cut short keeps its rows), a closing row (elapsed seconds, the
notes of skipped shapes, the clock after the run).
"""

import json
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from importlib import metadata

import torch

from k3batch.bench.kernels import time_ms
from k3batch.bench.layer_parts import (
    PAGE_SIZE,
    PartBench,
    Skip,
    mean_bank,
    moe_block,
    part_case,
    probe_model,
)
from k3batch.bench.roofline import BF16_TFLOPS, COPY_TBPS, gpu_name, gpu_rates
from k3batch.model import get_flavor
from k3batch.model.moe import EXPERT_DTYPES
from k3batch.parallel.layout import ParallelLayout
from k3batch.sim.calibration import PARTS, PHASES, Point, experts_key, roofline_s

PROBE_PARTS = ("embed", "kda", "mla", "dense_ffn", "attn_res", "head")  # the probe model's


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrateSpec:
    flavor: str = "k3"
    device: str = "cuda"
    parts: tuple[str, ...] = PARTS
    tp: tuple[int, ...] = (1, 8, 16, 2, 4)  # in this order
    dcp: tuple[int, ...] = (1, 8, 16)  # each that divides a tp, for mla decode
    prefill_tokens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    prefill_seqs: tuple[int, ...] = (1, 8)  # kda, mla, head
    prefill_contexts: tuple[int, ...] = (8192, 32768)  # mla, one sequence
    decode_batches: tuple[int, ...] = (1, 4, 16, 64, 256)
    contexts: tuple[int, ...] = (1024, 8192, 32768, 131072)  # mla decode
    experts: tuple[str, ...] = ("bf16", "mxfp4")
    repeats: int = 5
    budget_s: float = 480.0
    peak_flops: float = BF16_TFLOPS * 1e12  # default: the measured GPU's (`roofline.gpu_rates`)
    peak_bytes_per_s: float = COPY_TBPS * 1e12
    seed: int = 0

    @classmethod
    def for_device(cls, device: str, **given) -> "CalibrateSpec":
        """The defaults for `device` ("cpu": small shapes, seconds for k3-debug; a GPU: its
        peak rates, `roofline.gpu_rates`), then the given fields that are not None."""
        base = dict(CPU_SHAPES) if device == "cpu" else {}
        if torch.device(device).type == "cuda":
            tflops, tbps = gpu_rates(gpu_name(device))
            base["peak_flops"], base["peak_bytes_per_s"] = tflops * 1e12, tbps * 1e12
        return cls(device=device, **base | {k: v for k, v in given.items() if v is not None})

    def validate(self) -> "CalibrateSpec":
        if not set(self.parts) <= set(PARTS):
            raise ValueError(f"parts {sorted(set(self.parts) - set(PARTS))}; known: {PARTS}")
        if not set(self.experts) <= set(EXPERT_DTYPES):
            raise ValueError(f"experts {self.experts}; known: {EXPERT_DTYPES}")
        sizes = (*self.tp, *self.dcp, *self.prefill_tokens, *self.prefill_seqs,
                 *self.prefill_contexts, *self.decode_batches, *self.contexts, self.repeats)  # fmt: skip
        if min(sizes) < 1 or not self.contexts:
            raise ValueError(f"degrees, shapes and repeats must be >= 1 (and a context given): "
                             f"{sizes}")  # fmt: skip
        return self


CPU_SHAPES = {"tp": (1, 2), "dcp": (1, 2), "prefill_tokens": (16, 64), "prefill_seqs": (1, 4),
              "prefill_contexts": (64,), "decode_batches": (1, 4), "contexts": (32, 128),
              "repeats": 2}  # fmt: skip


class _OutOfTime(Exception):
    pass


class _Run:
    """One calibration run: the spec, where the parts run, the output file, the budget, the
    points and notes so far."""

    def __init__(self, spec: CalibrateSpec, out_path, log):
        self.spec, self.out_path, self.log = spec, out_path, log
        self.config = get_flavor(spec.flavor)
        self.bench = PartBench(self.config, torch.device(spec.device), spec.seed)
        self.points, self.notes = [], []
        self.deadline = time.monotonic() + spec.budget_s

    def write(self, row: dict) -> None:
        with open(self.out_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.log(f"note: {text}")

    def free(self) -> None:
        if self.bench.cuda:
            torch.cuda.empty_cache()

    def build(self, what: str, make):
        """make(), or None with a note where it does not fit or fails."""
        if time.monotonic() > self.deadline:
            raise _OutOfTime
        try:
            return make()
        except (Skip, torch.OutOfMemoryError, ValueError, RuntimeError) as e:
            self.free()
            self.note(f"skipped {what}: {type(e).__name__}: {str(e)[:200]}")
            return None

    def measure(self, part, phase, tp, dcp, tokens, seqs, context, make, experts="") -> None:
        """Time the Case make() returns and write its Point; one that does not fit or fails
        is a note."""
        if time.monotonic() > self.deadline:
            raise _OutOfTime
        what = f"{part} {phase} tp {tp} dcp {dcp} T {tokens} S {seqs} ctx {context} {experts}"
        try:
            case = make()
            s = _time_s(case.run, cuda=self.bench.cuda, graph=phase == "decode",
                        repeats=self.spec.repeats)  # fmt: skip
        except Exception as e:  # noqa: BLE001 (one failing shape must not end the run)
            self.free()
            return self.note(f"skipped {what}: {type(e).__name__}: {str(e)[:200]}")
        p = Point(part, phase, tp, dcp, tokens, seqs, context, round(s * 1e3, 5),
                  float(case.flops), float(case.nbytes), experts)  # fmt: skip
        self.points.append(p)
        self.write(p.row())
        eff = roofline_s(p.flops, p.bytes, self.spec.peak_flops, self.spec.peak_bytes_per_s) / s
        self.log(f"{what.rstrip()}: {p.ms:.4f} ms ({eff:.0%} of roofline)")

    def shapes(self, part: str, phase: str) -> list[tuple[int, int, int]]:
        """(tokens, seqs, context) of each point of a part."""
        s = self.spec
        if phase == "decode":
            ctxs = s.contexts if part == "mla" else s.contexts[:1]
            return [(b, b, c) for c in ctxs for b in s.decode_batches]
        seqs = s.prefill_seqs if part in ("kda", "mla", "head") else (1,)
        out = [(t, n, 0) for n in seqs for t in s.prefill_tokens if n <= t]
        if part == "mla":
            out += [(t, 1, c) for c in s.prefill_contexts for t in s.prefill_tokens]
        return out


def _time_s(fn, *, cuda: bool, graph: bool, repeats: int) -> float:
    if cuda:
        fn()  # Triton compiles and fla autotunes here, never inside a capture
        return time_ms(fn, repeats, graph=graph) / 1e3
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_all(run: _Run, model, parts, phases, tp: int, dcp: int, experts: str = "") -> None:
    """Every shape of `parts` in `phases` on `model` (a probe, or a moe block)."""
    for phase in phases:
        for part in parts:
            for shape in run.shapes(part, phase):
                case = partial(part_case, part, run.bench, model, phase, *shape, tp, dcp)
                run.measure(part, phase, tp, dcp, *shape, case, experts)


def _tp_points(run: _Run, tp: int) -> None:
    """Every point of one TP degree: the probe's parts, the MoE per expert dtype, MLA decode
    per DCP degree; each model freed before the next is built."""
    s, cfg, bench = run.spec, run.config, run.bench
    try:
        ParallelLayout(tp_size=tp).validate(cfg)
    except ValueError as e:
        return run.note(f"skipped tp {tp}: {e}")
    parts = [p for p in PROBE_PARTS if p in s.parts and (p != "attn_res" or cfg.has_attn_res)]
    model = run.build(f"probe at tp {tp}", partial(probe_model, bench, tp)) if parts else None
    if model is not None:
        _measure_all(run, model, parts, PHASES, tp, 1)
    del model
    run.free()
    for dtype in s.experts if "moe" in s.parts else ():
        block = run.build(f"moe {dtype} at tp {tp}", partial(moe_block, bench, tp, dtype))
        if block is not None:
            _measure_all(run, block, ["moe"], PHASES, tp, 1, experts_key(cfg, dtype))
        del block
        run.free()
    for dcp in [d for d in s.dcp if 1 < d <= tp and tp % d == 0] if "mla" in s.parts else ():
        model = run.build(f"probe at tp {tp} dcp {dcp}", partial(probe_model, bench, tp, dcp))
        if model is not None:
            _measure_all(run, model, ["mla"], ["decode"], tp, dcp)
        del model
        run.free()


def run_calibration(spec: CalibrateSpec, out_path, *, command: str = "", commit=None,
                    log=print) -> list[Point]:  # fmt: skip
    """Measure spec's points into out_path (appended: the module docstring's rows); returns
    the points."""
    spec.validate()
    run = _Run(spec, out_path, log)
    t0 = time.monotonic()
    run.write(_header(run, command, commit))
    try:
        with torch.inference_mode():
            for tp in spec.tp:
                _tp_points(run, tp)
    except _OutOfTime:
        run.note(f"budget of {spec.budget_s:g} s spent: the points after the last row were not run")
    run.write({"kind": "end", "elapsed_s": round(time.monotonic() - t0, 1),
               "points": len(run.points), "notes": run.notes, **_clocks(run.bench)})  # fmt: skip
    return run.points


def _header(run: _Run, command: str, commit) -> dict:
    spec, bench = run.spec, run.bench
    return {
        "kind": "header", "gpu": gpu_name(spec.device), "commit": commit or _git_commit(),
        "command": command, "flavor": spec.flavor, "device": spec.device,
        "dtype": str(bench.dtype).removeprefix("torch."), "torch": torch.__version__,
        "triton": _version("triton"), "fla": _version("fla-core"), **_clocks(bench),
        "peak_flops": spec.peak_flops, "peak_bytes_per_s": spec.peak_bytes_per_s,
        "page_size": PAGE_SIZE, "repeats": spec.repeats,
        "attn_res_bank": mean_bank(run.config) if run.config.has_attn_res else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip


def default_out(device: str, flavor: str = "k3") -> str:
    """calibration_<gpu>.jsonl for k3 ("NVIDIA H200" -> calibration_h200.jsonl; the CPU's
    _cpu), calibration_<gpu>_<flavor>.jsonl for another flavor."""
    gpu = gpu_name(device).lower().removeprefix("nvidia ").split()[0]
    return f"calibration_{gpu}{'' if flavor == 'k3' else '_' + flavor}.jsonl"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _clocks(bench: PartBench) -> dict:
    """{"sm_mhz", "max_sm_mhz", "power_limit_w"} of the device now (nvidia-smi); {} without."""
    if not bench.cuda or shutil.which("nvidia-smi") is None:
        return {}
    index = bench.device.index if bench.device.index is not None else torch.cuda.current_device()
    query = ["nvidia-smi", f"--id={index}", "--query-gpu=clocks.sm,clocks.max.sm,power.limit",
             "--format=csv,noheader,nounits"]  # fmt: skip
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=False)
        sm, max_sm, watts = (float(v) for v in out.stdout.strip().split(","))
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    return {"sm_mhz": round(sm), "max_sm_mhz": round(max_sm), "power_limit_w": watts}
