"""What a cluster is, for the simulation: a GPU (`GpuSpec`: memory and peak rates, each with its
source), how many per node, how many nodes, and two links (`Link`: bandwidth and latency), one
inside a node and one between nodes. `cluster_from` reads a preset name, a TOML or JSON file, a
dict or flags.

A "node" is the set of GPUs that share the fast link (an NVLink domain): 8 on an HGX H100, H200
or B200 board, 72 in a GB300 NVL72 rack ("gb300-nvl72"). GPU memory sizes come from the capacity
planner's table (`parallel.plan.GPUS`) and the H200's measured rates from `bench.roofline`, so
`k3batch plan`, the rooflines and the simulation read one figure each.

Rates are per GPU and per direction. Link latencies are per step of a ring (one hop, one chunk):
NCCL's own tuning model puts a ring step at 0.5-3.4 us over NVLink and 2.7-9.6 us over the
network, by protocol, plus a fixed 4-8 us per call (nccl src/graph/tuning.cc, hwLat / baseLat);
we take 2 us (NVLink) and 5 us (InfiniBand) per step and no fixed term: an assumption, printed
with every estimate (`ClusterSpec.lines`).
"""

import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from k3batch.bench.roofline import BF16_TFLOPS, COPY_TBPS
from k3batch.parallel.plan import GPUS as MEMORY_BYTES
from k3batch.parallel.plan import GPUS_PER_NODE


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU: memory in bytes, dense peak rates in FLOP/s and bytes/s, and where they come
    from ("measured here: ..." or "published: ..."). fp4_flops is None where the GPU has no
    FP4 tensor cores."""

    name: str
    memory_bytes: int
    bf16_flops: float
    fp4_flops: float | None
    hbm_bytes_per_s: float
    source: str


@dataclass(frozen=True, slots=True)
class Link:
    """A link as one GPU sees it: bytes/s per direction and seconds of latency per step."""

    bytes_per_s: float
    latency_s: float
    name: str


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        "h100", int(MEMORY_BYTES["h100"]), 989e12, None, 3.35e12,
        "published: NVIDIA H100 SXM datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB)",
    ),
    "h200": GpuSpec(
        "h200", int(MEMORY_BYTES["h200"]), BF16_TFLOPS * 1e12, None, COPY_TBPS * 1e12,
        f"measured here on one H200: {BF16_TFLOPS:g} TFLOP/s bf16 GEMM, {COPY_TBPS:g} TB/s "
        "device copy (published: 989 TFLOP/s, 4.8 TB/s); 141 GB published",
    ),
    # HGX B200 datasheet, 8 GPUs: 36 PFLOP/s FP16/BF16 and 144 PFLOP/s FP4, both "with
    # sparsity" (dense: half), 64 TB/s HBM3e, 1.4 TB.
    "b200": GpuSpec(
        "b200", int(MEMORY_BYTES["b200"]), 2.25e15, 9e15, 8e12,
        "published: NVIDIA datasheet (HGX B200, per GPU: 2.25 PFLOP/s dense bf16, 9 PFLOP/s "
        "dense FP4, 8 TB/s HBM3e, 180 GB)",
    ),
    # GB300 NVL72 datasheet, 72 GPUs: 360 PFLOP/s FP16/BF16 with sparsity (dense bf16 taken as
    # half: 2.5 PFLOP/s per GPU), 1,440 PFLOP/s FP4 with sparsity, 576 TB/s HBM3e, 288 GB per
    # GPU. The dense FP4 rate is NVIDIA's Blackwell Ultra figure of 15 PFLOP/s (not half of the
    # sparse 20); of the four it is the least certain.
    "gb300": GpuSpec(
        "gb300", int(MEMORY_BYTES["gb300"]), 2.5e15, 15e15, 8e12,
        "published: NVIDIA datasheet (GB300 NVL72, per GPU: 2.5 PFLOP/s dense bf16, 15 PFLOP/s "
        "dense FP4 (Blackwell Ultra), 8 TB/s HBM3e, 288 GB)",
    ),
}  # fmt: skip

# The H200's published peaks, against which the measured ones above are a fraction (`derated`).
H200_PUBLISHED_FLOPS, H200_PUBLISHED_BYTES_PER_S = 989e12, 4.8e12

LINKS: dict[str, Link] = {
    "nvlink4": Link(450e9, 2e-6, "nvlink4"),  # H100/H200: 900 GB/s both directions, per GPU
    "nvlink5": Link(900e9, 2e-6, "nvlink5"),  # B200/GB300: 1.8 TB/s both directions, per GPU
    "ib-ndr": Link(50e9, 5e-6, "ib-ndr"),  # InfiniBand NDR, one 400 Gb/s NIC per GPU
    "ib-xdr": Link(100e9, 5e-6, "ib-xdr"),  # InfiniBand XDR, one 800 Gb/s NIC per GPU
}
DEFAULT_LINKS = {  # gpu -> (intra, inter): what its usual systems have
    "h100": ("nvlink4", "ib-ndr"),
    "h200": ("nvlink4", "ib-ndr"),
    "b200": ("nvlink5", "ib-ndr"),
    "gb300": ("nvlink5", "ib-xdr"),
}
# name -> (gpu, gpus_per_node, nodes); "<gpu>x<per node>[x<nodes>]" is read for any GPU too.
PRESETS = {"gb300-nvl72": ("gb300", 72, 1)}


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """nodes x gpus_per_node GPUs; `intra` links the GPUs of a node, `inter` the nodes (each
    GPU with its own NIC)."""

    gpu: GpuSpec
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def validate(self) -> "ClusterSpec":
        """Raise ValueError naming the field when a count or rate is not positive."""
        for name, value in (("gpus_per_node", self.gpus_per_node), ("nodes", self.nodes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} = {value!r} must be a positive integer")
        g = self.gpu
        for name, value in (("gpu.memory_bytes", g.memory_bytes), ("gpu.bf16_flops", g.bf16_flops),
                            ("gpu.hbm_bytes_per_s", g.hbm_bytes_per_s),
                            ("intra.bytes_per_s", self.intra.bytes_per_s),
                            ("inter.bytes_per_s", self.inter.bytes_per_s)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"{name} = {value!r} must be > 0")
        if g.fp4_flops is not None and not g.fp4_flops > 0:
            raise ValueError(f"gpu.fp4_flops = {g.fp4_flops!r} must be > 0 or absent")
        for name, value in (("intra.latency_s", self.intra.latency_s),
                            ("inter.latency_s", self.inter.latency_s)):  # fmt: skip
            if not value >= 0:
                raise ValueError(f"{name} = {value!r} must be >= 0")
        return self

    def link(self, group_gpus: int) -> Link:
        """The link a collective over `group_gpus` consecutive GPUs (a group placed from a node's
        first GPU) runs at: `intra` if the group fits in a node. Otherwise a ring over the
        k = ceil(n / gpus_per_node) nodes it spans: `inter`'s bandwidth (each GPU's NIC is the
        narrowest hop) and, per step, the mean latency of its n - 1 steps of which k - 1 cross
        the network (NCCL's ring model)."""
        n = group_gpus
        if not 1 <= n <= self.num_gpus:
            raise ValueError(f"a group of {n} GPUs does not fit the cluster's {self.num_gpus}")
        if n <= self.gpus_per_node:
            return self.intra
        k = math.ceil(n / self.gpus_per_node)
        latency = ((n - k) * self.intra.latency_s + (k - 1) * self.inter.latency_s) / (n - 1)
        name = f"{self.inter.name} ring over {k} nodes"
        return Link(min(self.inter.bytes_per_s, self.intra.bytes_per_s), latency, name)

    def p2p_link(self, src_gpu: int, dst_gpu: int) -> Link:
        """The link between two GPUs (global indices, node-major): `intra` within a node."""
        for g in (src_gpu, dst_gpu):
            if not 0 <= g < self.num_gpus:
                raise ValueError(f"GPU {g} not in [0, {self.num_gpus})")
        same = src_gpu // self.gpus_per_node == dst_gpu // self.gpus_per_node
        return self.intra if same else self.inter

    def lines(self) -> list[str]:
        """The description and its assumptions, for an estimate's output."""
        g = self.gpu
        fp4 = "no FP4" if g.fp4_flops is None else f"{g.fp4_flops / 1e12:,.0f} TFLOP/s FP4"
        return [
            (f"cluster: {self.nodes} node{'s' if self.nodes > 1 else ''} x "
             f"{self.gpus_per_node} {g.name} = {self.num_gpus} GPUs"),
            (f"  {g.name}: {g.memory_bytes / 1e9:,.0f} GB, {g.bf16_flops / 1e12:,.0f} TFLOP/s "
             f"bf16, {fp4}, {g.hbm_bytes_per_s / 1e12:,.2f} TB/s ({g.source})"),
            *(f"  {role}: {ln.name}, {ln.bytes_per_s / 1e9:,.0f} GB/s per GPU per direction, "
              f"{ln.latency_s * 1e6:g} us per ring step"
              for role, ln in (("within a node", self.intra), ("between nodes", self.inter))),
            ("  assumed: links at their rate per direction, ring collectives (NCCL's model), a "
             "latency per ring step and none per call"),
        ]  # fmt: skip


def gpu_from_rates(name: str, *, memory_gb: float, bf16_tflops: float, hbm_tbps: float,
                   fp4_tflops: float | None = None, source: str = "given") -> GpuSpec:  # fmt: skip
    """A GPU by its peak rates (dense TFLOP/s, TB/s, GB of 1e9 bytes), measured or published:
    say which in `source`. Raises ValueError naming a rate that is not a positive number."""
    rates = {"memory_gb": memory_gb, "bf16_tflops": bf16_tflops, "hbm_tbps": hbm_tbps}
    if fp4_tflops is not None:
        rates["fp4_tflops"] = fp4_tflops
    for k, v in rates.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{k} = {v!r} must be a positive number")
    fp4 = None if fp4_tflops is None else fp4_tflops * 1e12
    return GpuSpec(name, int(memory_gb * 1e9), bf16_tflops * 1e12, fp4, hbm_tbps * 1e12, source)


def derated(gpu: GpuSpec) -> GpuSpec:
    """`gpu` at the fraction of its published peaks that the H200 measured here reaches of its
    own (777 / 989 of the bf16 rate, 4.26 / 4.8 of the memory bandwidth; FP4 as bf16): the
    like-for-like rates to scale a calibration measured on the H200 to a GPU known only by
    its datasheet. An assumption (the same fraction on another GPU); the H200 is unchanged."""
    h200 = GPUS["h200"]
    if gpu == h200:
        return gpu
    f = h200.bf16_flops / H200_PUBLISHED_FLOPS
    b = h200.hbm_bytes_per_s / H200_PUBLISHED_BYTES_PER_S
    return replace(
        gpu,
        bf16_flops=gpu.bf16_flops * f,
        fp4_flops=None if gpu.fp4_flops is None else gpu.fp4_flops * f,
        hbm_bytes_per_s=gpu.hbm_bytes_per_s * b,
        source=f"{gpu.source}; derated to the H200's measured fractions of its published peaks "
        f"({f:.3f} of the FLOP/s, {b:.3f} of the bandwidth)",
    )


_FIELDS = ("gpu", "gpus_per_node", "nodes", "intra", "inter")
_GPU_FIELDS = ("name", "memory_gb", "bf16_tflops", "fp4_tflops", "hbm_tbps", "source")
_LINK_FIELDS = ("name", "gb_per_s", "latency_us")


def cluster_from(
    spec: str | os.PathLike | dict | None = None,
    *,
    gpu: str | GpuSpec | None = None,
    gpus_per_node: int | None = None,
    nodes: int | None = None,
    intra: str | Link | None = None,
    inter: str | Link | None = None,
) -> ClusterSpec:
    """A cluster from `spec`, then the flags given (each replaces that field).

    spec: a preset ("h200x8": one node of 8; "h200x8x4": 4 nodes of 8; "gb300x4x2": 2 nodes of
    4; any "<gpu>x<per node>[x<nodes>]"; "gb300-nvl72": 72 GPUs in one NVLink domain), a path to
    a .toml or .json file, or its dict; None: the flags alone (gpu required). A file holds
      gpu = "h200"                    # a name in GPUS, or a table: name, memory_gb,
                                      # bf16_tflops, hbm_tbps, fp4_tflops (optional), source
      gpus_per_node = 8               # default: the GPU's usual board (plan.GPUS_PER_NODE)
      nodes = 2                       # default 1
      intra = "nvlink4"               # optional: a name in LINKS, or a table: name (optional,
      [inter]                         # a LINKS name to start from), gb_per_s, latency_us
      gb_per_s = 50
      latency_us = 5
    at its top level or under [cluster] (so a job spec can carry it). A GPU outside GPUS has
    no default links: give intra and inter. Raises ValueError naming the file and field.
    """
    where = "cluster"
    if spec is None:
        raw = {}
    elif isinstance(spec, dict):
        raw = dict(spec)
    else:
        text = os.fspath(spec)
        if text in PRESETS or _PRESET.fullmatch(text) and not Path(text).is_file():
            raw = _preset(text)
        else:
            where, raw = text, _read(Path(text))
    flags = {"gpu": gpu, "gpus_per_node": gpus_per_node, "nodes": nodes, "intra": intra,
             "inter": inter}  # fmt: skip
    raw |= {k: v for k, v in flags.items() if v is not None}
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; expected "
                         f"{', '.join(_FIELDS)}")  # fmt: skip
    if "gpu" not in raw:
        raise ValueError(f"{where}: field gpu is missing (one of {', '.join(GPUS)}, or a table)")
    g = _gpu(raw["gpu"], where)
    per_node = raw.get("gpus_per_node", GPUS_PER_NODE.get(g.name))
    if per_node is None:
        raise ValueError(f"{where}: field gpus_per_node is missing (no default for {g.name})")
    links = DEFAULT_LINKS.get(g.name, (None, None))
    spec = ClusterSpec(
        gpu=g,
        gpus_per_node=per_node,
        nodes=raw.get("nodes", 1),
        intra=_link(raw.get("intra", links[0]), f"{where}: intra", g.name),
        inter=_link(raw.get("inter", links[1]), f"{where}: inter", g.name),
    )
    try:
        return spec.validate()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


_PRESET = re.compile(r"([a-z0-9]+?)x(\d+)(?:x(\d+))?")


def _preset(name: str) -> dict:
    if name in PRESETS:
        gpu, per_node, nodes = PRESETS[name]
        return {"gpu": gpu, "gpus_per_node": per_node, "nodes": nodes}
    m = _PRESET.fullmatch(name)
    if m.group(1) not in GPUS:
        raise ValueError(f"cluster {name!r}: unknown gpu {m.group(1)!r}; known: {', '.join(GPUS)}")
    return {"gpu": m.group(1), "gpus_per_node": int(m.group(2)), "nodes": int(m.group(3) or 1)}


def _read(path: Path) -> dict:
    if path.suffix not in (".toml", ".json"):
        raise ValueError(
            f"cluster {str(path)!r} is neither a preset (<gpu>x<per node>[x<nodes>], "
            f"{', '.join(PRESETS)}) nor a .toml or .json file"
        )
    if not path.is_file():
        raise ValueError(f"cluster file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text()) if path.suffix == ".toml" else (
            json.loads(path.read_text()))  # fmt: skip
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid {path.suffix[1:].upper()}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a table of fields, got {type(raw).__name__}")
    return raw["cluster"] if isinstance(raw.get("cluster"), dict) else raw


def _gpu(value, where: str) -> GpuSpec:
    if isinstance(value, GpuSpec):
        return value
    if isinstance(value, str):
        if value not in GPUS:
            raise ValueError(f"{where}: gpu = {value!r} unknown; known: {', '.join(GPUS)} (or "
                             "give a table with its rates)")  # fmt: skip
        return GPUS[value]
    if not isinstance(value, dict):
        raise ValueError(f"{where}: gpu must be a name or a table, got {value!r}")
    _check_table(value, _GPU_FIELDS, ("name", "memory_gb", "bf16_tflops", "hbm_tbps"),
                 f"{where}: gpu")  # fmt: skip
    kw = {k: value[k] for k in _GPU_FIELDS[1:5] if k in value}
    source = value.get("source", f"given in {where}")
    try:
        return gpu_from_rates(str(value["name"]), **kw, source=source)
    except ValueError as e:
        raise ValueError(f"{where}: gpu {value['name']!r}: {e}") from None


def _link(value, where: str, gpu_name: str) -> Link:
    if isinstance(value, Link):
        return value
    if value is None:
        raise ValueError(
            f"{where} is missing: gpu {gpu_name!r} has no default links; give a name in "
            f"{', '.join(LINKS)} or a table of {', '.join(_LINK_FIELDS)}"
        )
    if isinstance(value, str):
        if value not in LINKS:
            raise ValueError(f"{where} = {value!r} unknown; known: {', '.join(LINKS)}")
        return LINKS[value]
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a link name or a table, got {value!r}")
    base = _link(value["name"], where, gpu_name) if value.get("name") in LINKS else None
    need = () if base else ("gb_per_s", "latency_us")
    _check_table(value, _LINK_FIELDS, need, where)
    for k in ("gb_per_s", "latency_us"):
        if k in value and not isinstance(value[k], (int, float)) or value.get(k) is True:
            raise ValueError(f"{where}: {k} = {value[k]!r} must be a number")
    return Link(
        value["gb_per_s"] * 1e9 if "gb_per_s" in value else base.bytes_per_s,
        value["latency_us"] * 1e-6 if "latency_us" in value else base.latency_s,
        str(value.get("name", where.split(": ")[-1])),
    )


def _check_table(value: dict, allowed: tuple[str, ...], required: tuple[str, ...],
                 where: str) -> None:  # fmt: skip
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; expected "
                         f"{', '.join(allowed)}")  # fmt: skip
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"{where}: field(s) {', '.join(missing)} missing")
