"""Calibration: one layer's parts measured on one GPU, and what they predict at other shapes and
on other GPUs.

A table is a JSONL file (`k3batch bench calibrate` writes it, `benchmarks/calibration_<gpu>.jsonl`):
a header row ({"kind": "header"}: the GPU, its clocks, the commit, the command, and the peak
rates each point's efficiency is taken against) and one row per `Point` ({"kind": "point"}):
one part of ONE layer (embed and head: once per forward) at one shape, on a TP rank's share of
the layer, timed alone, with the FLOPs and bytes counted for that shard. A file may hold several
runs on one GPU (a second run appended for the shapes the first had no time for): their points
are merged, a later one replacing an earlier one of the same shape.

`Calibration.part_s` interpolates the points (the model is in its docstring); `Calibration.on`
carries the table to another GPU by its peak rates, keeping each point's efficiency. Every
GEMM here runs on bf16 tensor cores (MXFP4 experts are widened to bf16 in the W4A16 kernel), so
the FLOP rate is the GPU's bf16 rate.
"""

import bisect
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

PARTS = ("embed", "kda", "mla", "dense_ffn", "moe", "attn_res", "head")
PHASES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Point:
    """One measured point: a part of ONE layer (or embed / head once per forward) on one GPU."""

    part: str
    phase: str  # "prefill" | "decode"
    tp: int  # the shard: a TP rank's share of the layer (heads, experts, FFN width, vocab / tp)
    dcp: int  # a DCP rank's share of the MLA latent (every dcp-th token); 1 for other parts
    tokens: int  # tokens in the forward (prefill: chunk tokens; decode: batch)
    seqs: int  # sequences in the forward
    context: int  # cached tokens per sequence before this forward
    ms: float  # measured (CUDA events, median)
    flops: float  # counted for this shard (`bench/calibrate.py` says what is counted)
    bytes: float
    experts: str = ""  # moe: "896x16 bf16" style key (num_experts x top_k dtype)

    def row(self) -> dict:
        return {"kind": "point"} | dataclasses.asdict(self)


def experts_key(config, expert_dtype: str) -> str:
    """The moe points' key for a config's expert set: "896x16 bf16"."""
    return f"{config.num_experts}x{config.num_experts_per_token} {expert_dtype}"


def roofline_s(flops: float, nbytes: float, peak_flops: float, peak_bytes_per_s: float) -> float:
    """The least time of some work: its FLOPs at the FLOP rate or its bytes at the bandwidth,
    whichever is longer."""
    return max(flops / peak_flops, nbytes / peak_bytes_per_s)


def attended_keys(phase: str, tokens: int, seqs: int, context_tokens: int) -> float:
    """Keys each query attends on average: its sequence's cached tokens, and in prefill its own
    chunk up to itself (causal), the tokens split evenly over the sequences."""
    if phase == "decode":
        return context_tokens / seqs + 1
    return context_tokens / seqs + (tokens / seqs + 1) / 2


class Calibration:
    """The points of one GPU, indexed by (part, phase, tp, dcp, experts).

    gpu: the measured GPU's name ("NVIDIA H200"); peak_flops, peak_bytes_per_s: the rates the
    efficiency is taken against; header: the first run's header row (flavor, commit, command,
    clocks); source: where the times come from (measured, or scaled by `on`)."""

    def __init__(self, *, gpu: str, peak_flops: float, peak_bytes_per_s: float, points,
                 header: dict | None = None, source: str = ""):  # fmt: skip
        self.gpu, self.peak_flops, self.peak_bytes_per_s = gpu, peak_flops, peak_bytes_per_s
        self.header, self.source = header or {}, source or f"measured on {gpu}"
        shapes = {}  # a later point replaces an earlier one of the same shape
        for p in points:
            shapes[(p.part, p.phase, p.tp, p.dcp, p.experts, p.tokens, p.seqs, p.context)] = p
        self.points = tuple(shapes.values())
        self._index: dict[tuple, dict[int, dict[float, float]]] = {}
        for p in self.points:
            y = _y(p.part, p.phase, p.tokens, p.seqs, p.seqs * p.context)
            key = (p.part, p.phase, p.tp, p.dcp, p.experts)
            self._index.setdefault(key, {}).setdefault(p.tokens, {})[y] = p.ms / 1e3

    @classmethod
    def load(cls, path) -> "Calibration":
        """A JSONL table: header rows and point rows (other rows, such as a run's closing
        summary, are skipped). Every header must name the same GPU, flavor and peak rates (the
        attn_res and head points depend on the flavor's depth, moe on its experts)."""
        headers, points = [], []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("kind") == "header":
                headers.append(row)
            elif row.get("kind") == "point":
                fields = {f.name for f in dataclasses.fields(Point)}
                points.append(Point(**{k: v for k, v in row.items() if k in fields}))
        if not headers:
            raise ValueError(f"{path}: no header row")
        first = headers[0]
        for h in headers[1:]:
            for k in ("gpu", "flavor", "peak_flops", "peak_bytes_per_s"):
                if h.get(k) != first.get(k):
                    raise ValueError(f"{path}: runs differ in {k}: {first[k]!r} != {h[k]!r}")
        return cls(gpu=first["gpu"], peak_flops=first["peak_flops"],
                   peak_bytes_per_s=first["peak_bytes_per_s"], points=points,
                   header=first)  # fmt: skip

    @classmethod
    def merge(cls, tables) -> "Calibration":
        """One table from several of one GPU and the same peak rates, e.g. k3's and k3-slice's
        (k3-slice has K3's widths: its kda, mla, dense_ffn and embed are k3's, its moe,
        attn_res and head its own): a later table's points of a (part, phase, tp, dcp,
        experts) replace every earlier point of that key, so no key mixes two tables. The
        header is the first table's. Raises ValueError naming what differs."""
        tables = list(tables)
        first, points = tables[0], list(tables[0].points)
        for t in tables[1:]:
            for k in ("gpu", "peak_flops", "peak_bytes_per_s"):
                if getattr(t, k) != getattr(first, k):
                    raise ValueError(f"tables differ in {k}: {getattr(first, k)!r} != "
                                     f"{getattr(t, k)!r}")  # fmt: skip
            later = {_key(p) for p in t.points}
            points = [p for p in points if _key(p) not in later] + list(t.points)
        flavors = ", ".join(str(t.header.get("flavor", "?")) for t in tables)
        return cls(gpu=first.gpu, peak_flops=first.peak_flops,
                   peak_bytes_per_s=first.peak_bytes_per_s, points=points, header=first.header,
                   source=f"{first.source} (tables of {flavors}, merged)")  # fmt: skip

    def efficiency(self, p: Point) -> float:
        """The point's roofline time at this table's rates over its time."""
        return roofline_s(p.flops, p.bytes, self.peak_flops, self.peak_bytes_per_s) / (p.ms / 1e3)

    def part_s(self, part: str, *, phase: str, tp: int, dcp: int, tokens: int, seqs: int,
               context_tokens: int, experts: str = "") -> float:  # fmt: skip
        """Seconds of one layer's `part` (embed, head: one forward's) on a rank of `tp` (and
        `dcp` for mla) at this shape; context_tokens: the cached tokens summed over sequences.

        The model: the points of (part, phase, tp, dcp, experts) sit at (tokens, y), where y is
        the keys each query attends for mla (`attended_keys`: so tokens * y is the attended
        (query, key) pairs, and attention's cost, linear in the pairs, is bilinear in (tokens,
        y)) and the sequence count for the other parts (their cost does not depend on the
        context: KDA's state and the FFNs do not grow with it). At each measured token count
        the time is piecewise linear in y through the points there; across token counts,
        piecewise linear in tokens. Beyond the last point of either axis: the line through the
        last two, never falling (a slope below zero is taken as zero); before the first: the
        line through the first two, clamped between the first point's time scaled down in
        proportion (no fixed cost) and the first point's time; one point alone: its time (in
        y), scaled in proportion (in tokens). Prefill pairs assume the tokens split evenly over
        the sequences. Measured points come back exactly.
        Raises KeyError naming the part, phase, tp, dcp and experts with no points."""
        key = (part, phase, tp, dcp, experts)
        grid = self._index.get(key)
        if grid is None:
            have = sorted(k for k in self._index if k[0] == part)
            raise KeyError(
                f"no calibration points for part {part!r}, phase {phase!r}, tp {tp}, dcp {dcp}, "
                f"experts {experts!r} on {self.gpu}; the table has for {part!r}: {have}"
            )
        y = _y(part, phase, tokens, seqs, context_tokens)
        xs = sorted(grid)
        ts = [_interp(y, sorted(grid[x]), [grid[x][v] for v in sorted(grid[x])], False)
              for x in xs]  # fmt: skip
        return _interp(tokens, xs, ts, True)

    def on(self, gpu) -> "Calibration":
        """The same table for another GPU (`sim.cluster.GpuSpec`, or anything with name,
        bf16_flops and hbm_bytes_per_s): each point keeps its efficiency (its roofline time at
        this table's rates over its time), its roofline recomputed at gpu's rates. An
        assumption: kernels reach the same fraction of another GPU's peaks, whichever binds
        there (a point bound by its bytes here may be bound by its FLOPs there)."""
        f, b = gpu.bf16_flops, gpu.hbm_bytes_per_s
        points = []
        for p in self.points:
            here = roofline_s(p.flops, p.bytes, self.peak_flops, self.peak_bytes_per_s)
            there = roofline_s(p.flops, p.bytes, f, b)
            points.append(dataclasses.replace(p, ms=p.ms * there / here) if here > 0 else p)
        source = (f"{self.source}, scaled to {gpu.name} by its peak rates ({f / 1e12:.0f} "
                  f"TFLOP/s bf16, {b / 1e12:.2f} TB/s), each point's efficiency kept "
                  f"({getattr(gpu, 'source', 'rates given')})")  # fmt: skip
        return Calibration(gpu=gpu.name, peak_flops=f, peak_bytes_per_s=b, points=points,
                           header=self.header, source=source)  # fmt: skip


def _key(p: Point) -> tuple:
    return p.part, p.phase, p.tp, p.dcp, p.experts


def _y(part: str, phase: str, tokens: int, seqs: int, context_tokens: int) -> float:
    if part == "mla":
        return attended_keys(phase, tokens, seqs, context_tokens)
    return float(seqs)


def _interp(x: float, xs: list, ts: list, proportional: bool) -> float:
    """Piecewise linear through (xs, ts) (xs ascending), extended as `Calibration.part_s`
    says; with one point, its time (or in proportion to x, if `proportional`)."""
    if len(xs) == 1:
        return ts[0] * x / xs[0] if proportional else ts[0]
    if x >= xs[-1]:
        slope = max(0.0, (ts[-1] - ts[-2]) / (xs[-1] - xs[-2]))
        return ts[-1] + slope * (x - xs[-1])
    if x <= xs[0]:
        line = ts[0] + (ts[1] - ts[0]) / (xs[1] - xs[0]) * (x - xs[0])
        return min(ts[0], max(line, ts[0] * x / xs[0]))
    i = bisect.bisect_right(xs, x)
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ts[i - 1] + w * (ts[i] - ts[i - 1])
