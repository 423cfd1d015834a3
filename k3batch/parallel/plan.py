"""Capacity planner: weight and cache bytes per GPU, and the context that fits, for one layout.

`make_plan(config, gpu=..., pp_size=..., tp_size=..., dcp_size=...)` returns a frozen `Plan`;
`pool_bytes(...)` is the one formula the engine and the plan both use to size a cache pool.
The search over layouts for the smallest that fits is `parallel.search`.
pp 1 with tp 1 is a single-device replica (`ReplicaSpec.is_single_device`): one engine on one
GPU holds the weights once and prefills and decodes from one pool, so its figures are the
decode rank's and it counts as 1 GPU (disaggregated it would take 2 for the same figures).
Assumptions (also printed by `Plan.lines()`):
- GPU memory is the vendor figure in `GPUS`, in GB of 1e9 bytes (an H200 is 141e9 B).
- Weights are counted in checkpoint bytes per parameter of a meta-device `K3Model`: routed
  experts at 0.53125 B (MXFP4: a 4-bit value plus one 8-bit scale per 32 values) when the
  checkpoint stores them so (`config.experts_mxfp4`; `checkpoint_config("k3")` sets it),
  everything else at 2 B (bf16; the few fp32 checkpoint tensors, < 0.01%, counted at 2 B too).
- A decode rank holds the whole model. Tensors that `parallel.tp.split_dim` splits (routed
  experts expert-parallel, per-head projections, FFN rows, LM head) count 1/tp; tensors it
  replicates (embedding, router, latent MoE projections, q_a / kv_a / f_a projections, norms)
  count whole on every rank, as the engine holds them.
- A prefill stage holds its layers of `split_layers` unsplit on one GPU, plus the embedding
  (first stage) or the final norm and LM head (last stage); the plan reports the largest.
- Caches come from `CacheLayout` (fp32 KDA state, bf16 conv states and MLA latents): KDA heads
  split over TP; the MLA latent is replicated under TP and striped over DCP, so a GPU holds
  token_bytes / dcp per token. Pool per GPU = gpu_bytes * memory_fraction - decode weights -
  an activation reserve (default 4 GiB), unless `cache_bytes` gives the budget explicitly.
- Logical capacity (the K3 blog's figure) = pool / (KDA recurrent state / context_len + MLA
  bytes per token per GPU), fractional requests allowed; conv states are left out, as in the
  blog (with them k3 at TP8 gives 1,550,441 instead of 1,550,543 tokens, < 0.1% less).
  `max_requests` counts whole requests with everything a pool allocates for one: a KDA block
  (state + conv, aligned) and the MLA pages of its DCP stripe.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from k3batch.cache.layout import CacheLayout
from k3batch.model.config import K3Config, get_flavor
from k3batch.model.k3 import K3Model
from k3batch.parallel.layout import ParallelLayout, split_layers

GiB = 1 << 30
GPUS = {"h200": 141e9, "h100": 80e9, "b200": 180e9, "gb300": 288e9}  # bytes (vendor GB = 1e9)
GPUS_PER_NODE = {"h200": 8, "h100": 8, "b200": 8, "gb300": 4}  # HGX boards; a GB300 NVL72 tray
DEFAULT_RESERVE_BYTES = 4 * GiB  # activations, CUDA graphs, NCCL buffers, allocator slack
MXFP4_BYTES_PER_PARAM = 0.53125  # 4 bits + one 8-bit E8M0 scale per 32 values
BF16_BYTES = 2


def checkpoint_config(flavor: str, experts: str = "auto") -> K3Config:
    """The named flavor as its official checkpoint stores it (`k3`'s routed experts are MXFP4,
    Kimi Linear's bf16), or with its routed experts `experts` ("bf16" or "mxfp4", as
    `k3batch init-checkpoint --experts` writes them and `load_model` keeps them)."""
    config = get_flavor(flavor)
    return with_experts(config, "mxfp4" if experts == "auto" and flavor == "k3" else experts)


def with_experts(config: K3Config, experts: str) -> K3Config:
    """`config` with its routed experts stored as `experts`: "auto" (unchanged), "bf16" or
    "mxfp4". Raises ValueError on another value."""
    if experts not in ("auto", "bf16", "mxfp4"):
        raise ValueError(f"experts = {experts!r}; expected auto, bf16 or mxfp4")
    if experts == "auto":
        return config
    return dataclasses.replace(config, experts_mxfp4=experts == "mxfp4")


def pool_bytes(
    device_bytes: int, memory_fraction: float, weight_bytes: int, reserve_bytes: int
) -> int:
    """Bytes left for the cache pool on one GPU: device_bytes * memory_fraction - weight_bytes
    - reserve_bytes. Raises ValueError with the numbers when nothing is left."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction = {memory_fraction} must be in (0, 1]")
    usable = int(device_bytes * memory_fraction)
    left = usable - weight_bytes - reserve_bytes
    if left <= 0:
        raise ValueError(
            f"no memory left for the cache: {memory_fraction} x {device_bytes:,.0f} B = "
            f"{usable:,} B usable < weights {weight_bytes:,} B + reserve {reserve_bytes:,} B "
            f"(short by {-left:,} B = {-left / 1e9:.1f} GB)"
        )
    return left


def capacity_tokens(
    pool_bytes: int, kda_state_bytes: int, token_bytes: float, context_len: int
) -> int:
    """Logical context capacity: tokens of context that fit in a pool of pool_bytes per GPU
    when requests are context_len tokens long, each also holding its KDA state (fractional
    requests allowed). token_bytes: MLA bytes per token per GPU (divided by DCP)."""
    return int(pool_bytes / (kda_state_bytes / context_len + token_bytes))


@functools.lru_cache(maxsize=8)
def _tensors(config: K3Config) -> tuple[tuple[str, float, bool], ...]:
    """(name, checkpoint bytes, split over TP) for every parameter of the whole model."""
    # Imported here: the rank model's split rule is the truth, but `pool_bytes` users (the
    # engine) should not pull in the rank model code by importing this module.
    from k3batch.parallel.tp import split_dim

    with torch.device("meta"):
        model = K3Model(config)
    expert_bytes = MXFP4_BYTES_PER_PARAM if config.experts_mxfp4 else BF16_BYTES
    out = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        routed = parts[-2] == "experts" and parts[-1] in ("w13", "w2")
        nbytes = p.numel() * (expert_bytes if routed else BF16_BYTES)
        out.append((name, nbytes, split_dim(name) is not None))
    return tuple(out)


def weight_bytes(
    config: K3Config, *, tp_size: int = 1, layer_range: tuple[int, int] | None = None,
    routed_only: bool = False,
) -> int:  # fmt: skip
    """Checkpoint bytes one GPU holds: layers [first, last) (default all), the embedding if
    first == 0, the final AttnRes, norm and LM head if last == num_hidden_layers; tensors that
    TP splits divided by tp_size. `routed_only`: of these, the routed experts' alone."""
    first, last = layer_range or (0, config.num_hidden_layers)
    total = 0.0
    for name, nbytes, split in _tensors(config):
        if routed_only and not name.endswith((".experts.w13", ".experts.w2")):
            continue
        if name.startswith("model.layers."):
            held = first <= int(name.split(".")[2]) < last
        elif name.startswith("model.embed_tokens."):
            held = first == 0
        else:
            held = last == config.num_hidden_layers
        if held:
            total += nbytes / tp_size if split else nbytes
    return math.ceil(total)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Per-GPU figures of one layout. Cache figures are for a decode rank; `None` pool and
    capacities mean the weights leave no room for a cache (see `problems`)."""

    name: str
    gpu: str
    gpu_bytes: int
    memory_fraction: float
    reserve_bytes: int
    pp_size: int
    tp_size: int
    dcp_size: int
    page_size: int  # tokens per MLA page
    context_len: int  # tokens per request
    expert_bytes_per_param: float
    stage_layers: tuple[tuple[int, int], ...]  # [first, last) per prefill stage
    total_weight_bytes: int  # the whole checkpoint
    stage_weight_bytes: tuple[int, ...]  # per prefill stage
    decode_weight_bytes: int
    decode_expert_bytes: int  # of decode_weight_bytes, the routed experts'
    kda_state_bytes: int  # fp32 recurrent state, one request, one GPU
    kda_conv_bytes: int  # conv states, one request, one GPU
    kda_block_bytes: int  # what the pool allocates per request: state + conv, aligned
    mla_token_bytes: int  # latent of one token, all MLA layers (replicated under TP)
    mla_bytes_per_token: float  # per GPU: mla_token_bytes / dcp_size
    mla_page_bytes: int
    pages_per_request: int
    request_bytes: int  # one block + its pages, per GPU
    pool_bytes: int | None
    pool_source: str  # "cache_bytes" or "memory"
    max_requests: int | None  # whole requests of context_len per decode group
    capacity_tokens: int | None  # logical context capacity of a decode group
    capacity_tokens_no_dcp: int | None
    problems: tuple[str, ...]

    @property
    def is_single_device(self) -> bool:
        """pp 1 and tp 1: one engine on one GPU prefills and decodes (see the module doc)."""
        return self.pp_size == 1 and self.tp_size == 1

    @property
    def num_gpus(self) -> int:
        """GPUs per replica: pp prefill stages + tp decode ranks, or 1 for a single device."""
        return 1 if self.is_single_device else self.pp_size + self.tp_size

    @property
    def prefill_weight_bytes(self) -> int:
        """The largest prefill stage's weights."""
        return max(self.stage_weight_bytes)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def usable_bytes(self) -> int:
        """What weights, reserve and cache may use on one GPU: gpu_bytes * memory_fraction."""
        return int(self.gpu_bytes * self.memory_fraction)

    @property
    def dcp_gain(self) -> float | None:
        if self.capacity_tokens is None or not self.capacity_tokens_no_dcp:
            return None
        return self.capacity_tokens / self.capacity_tokens_no_dcp

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "num_gpus": self.num_gpus,
            "prefill_weight_bytes": self.prefill_weight_bytes,
            "fits": self.fits,
            "dcp_gain": self.dcp_gain,
        }

    def lines(self) -> list[str]:
        ctx = f"{self.context_len:,}"
        stage_idx = self.stage_weight_bytes.index(self.prefill_weight_bytes)
        first, last = self.stage_layers[stage_idx]
        given = "given budget" if self.pool_source == "cache_bytes" else "memory left"
        one = " (one GPU: a single-device engine prefills and decodes)"
        experts = "MXFP4" if self.expert_bytes_per_param < BF16_BYTES else "bf16"
        holder = "single device" if self.is_single_device else "decode rank"
        out = [
            (f"plan: {self.name} on {self.gpu} ({self.gpu_bytes / 1e9:.0f} GB), "
             f"pp {self.pp_size}, tp {self.tp_size}, dcp {self.dcp_size}"
             f"{one if self.is_single_device else ''}, memory fraction {self.memory_fraction}"),
            f"weights per GPU (checkpoint total {_gb(self.total_weight_bytes)}):",
            f"  {holder} (whole model, tp {self.tp_size}): {_gb(self.decode_weight_bytes)}",
            f"    of which routed experts ({experts}): {_gb(self.decode_expert_bytes)}",
        ]  # fmt: skip
        if not self.is_single_device:
            out.append(f"  prefill stage {stage_idx} (the largest; layers [{first}, {last})): "
                       f"{_gb(self.prefill_weight_bytes)}")  # fmt: skip
        out += [
            "cache per decode GPU:" if not self.is_single_device else "cache on the GPU:",
            (f"  MLA latent: {self.mla_bytes_per_token:,.0f} B / token "
             f"({self.mla_token_bytes:,} B / dcp {self.dcp_size})"),
            (f"  KDA: {self.kda_state_bytes:,} B / request recurrent state "
             f"+ {self.kda_conv_bytes:,} B conv states"),
            (f"  one request of {ctx} tokens: KDA block {self.kda_block_bytes:,} B "
             f"+ {self.pages_per_request:,} pages x {self.mla_page_bytes:,} B "
             f"= {_gb(self.request_bytes)}"),
        ]  # fmt: skip
        if self.pool_bytes is None:
            out.append("  pool: none (the weights do not fit)")
        else:
            out += [
                f"  pool: {_gb(self.pool_bytes)} ({given})",
                f"  max concurrent requests of {ctx} tokens per group: {self.max_requests:,}",
                (f"  logical context capacity: {self.capacity_tokens:,} tokens "
                 f"({self.capacity_tokens / 1e6:.2f}M); without DCP "
                 f"{self.capacity_tokens_no_dcp:,} ({self.capacity_tokens_no_dcp / 1e6:.2f}M); "
                 f"DCP gain {self.dcp_gain:.2f}x"),
            ]  # fmt: skip
        out += [f"DOES NOT FIT: {p}" for p in self.problems] or ["fits: yes"]
        return out + [
            "assumptions:",
            f"  GPU memory in vendor GB (1e9 B); activation reserve {_gb(self.reserve_bytes)}",
            (f"  weights in checkpoint bytes: routed experts {self.expert_bytes_per_param} "
             "B/param, the rest bf16 (2 B); TP-replicated tensors whole on every rank"),
            ("  KDA state fp32, conv states and MLA latents bf16; MLA latent replicated under "
             "TP, striped over DCP"),
            (f"  capacity = pool / (KDA recurrent state / {ctx} + MLA B/token/GPU): conv "
             "states excluded (as in the K3 blog), fractional requests allowed"),
        ]  # fmt: skip

    def __str__(self) -> str:
        return "\n".join(self.lines())


def weight_sides(single_device: bool, prefill: int, decode: int) -> tuple[tuple[str, int], ...]:
    """The GPUs whose weights must fit: one single device (prefill = decode), or the largest
    prefill stage and a decode rank."""
    if single_device:
        return (("single device", decode),)
    return (("prefill stage", prefill), ("decode rank", decode))


def _gb(n: float) -> str:
    return f"{n:,.0f} B ({n / 1e9:,.1f} GB, {n / GiB:,.1f} GiB)"


def make_plan(
    config: K3Config,
    *,
    name: str = "model",
    gpu: str = "h200",
    pp_size: int = 1,
    tp_size: int = 8,
    dcp_size: int = 1,
    memory_fraction: float = 0.9,
    page_size: int = 64,
    context_len: int = 1 << 20,
    cache_bytes: int | None = None,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    gpu_bytes: int | None = None,
) -> Plan:
    """The plan of `config` on `gpu` GPUs with pp prefill stages and a tp x dcp decode group.
    `cache_bytes` (per GPU) overrides the pool computed from memory; `gpu_bytes` the memory of
    a GPU that `GPUS` does not know (one given by its rates). Raises ValueError on a bad layout
    or value; weights that do not fit are reported in `Plan.problems`."""
    config.validate()
    if gpu not in GPUS and gpu_bytes is None:
        raise ValueError(f"gpu = {gpu!r} unknown; known: {', '.join(GPUS)}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction = {memory_fraction} must be in (0, 1]")
    ParallelLayout(tp_size=tp_size, dcp_size=dcp_size).validate(config)
    for field, value, low in (
        ("page_size", page_size, 1),
        ("context_len", context_len, 1),
        ("reserve_bytes", reserve_bytes, 0),
        ("cache_bytes", 1 if cache_bytes is None else cache_bytes, 1),
    ):
        if value < low:
            raise ValueError(f"{field} = {value} must be >= {low}")
    num_layers = config.num_hidden_layers
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size = {pp_size} must be in [1, num_hidden_layers = {num_layers}]")
    stages = split_layers(num_layers, pp_size, config.attn_res_block_size)
    stage_bytes = tuple(weight_bytes(config, layer_range=r) for r in stages)
    prefill = max(stage_bytes)
    decode = weight_bytes(config, tp_size=tp_size)
    layout = CacheLayout.build(
        config, range(num_layers), page_size=page_size, dtype_bytes=2, tp_size=tp_size
    )
    num_kda = len(layout.kda_layers)
    pages = layout.request_pages(context_len, dcp_size)
    request = layout.request_bytes(context_len, dcp_size)
    gpu_bytes = int(GPUS[gpu] if gpu_bytes is None else gpu_bytes)
    usable = int(gpu_bytes * memory_fraction)
    problems = []
    for what, nbytes in weight_sides(pp_size == tp_size == 1, prefill, decode):
        if nbytes + reserve_bytes > usable:
            problems.append(
                f"{what} weights {nbytes / 1e9:.1f} GB + reserve {reserve_bytes / 1e9:.1f} GB > "
                f"{memory_fraction} x {gpu_bytes / 1e9:.0f} GB = {usable / 1e9:.1f} GB of {gpu}"
            )
    pool, source = cache_bytes, "cache_bytes"
    if pool is None:
        source = "memory"
        try:
            pool = pool_bytes(gpu_bytes, memory_fraction, decode, reserve_bytes)
        except ValueError:
            pool = None  # already in problems
    elif decode + reserve_bytes + pool > usable and not problems:
        problems.append(
            f"cache_bytes {pool / 1e9:.1f} GB + decode weights {decode / 1e9:.1f} GB + reserve "
            f"{reserve_bytes / 1e9:.1f} GB > {usable / 1e9:.1f} GB usable on {gpu}"
        )
    state = num_kda * layout.state_bytes

    def capacity(token_bytes: float) -> int | None:
        return None if pool is None else capacity_tokens(pool, state, token_bytes, context_len)

    return Plan(
        name=name,
        gpu=gpu,
        gpu_bytes=gpu_bytes,
        memory_fraction=memory_fraction,
        reserve_bytes=reserve_bytes,
        pp_size=pp_size,
        tp_size=tp_size,
        dcp_size=dcp_size,
        page_size=page_size,
        context_len=context_len,
        expert_bytes_per_param=MXFP4_BYTES_PER_PARAM if config.experts_mxfp4 else BF16_BYTES,
        stage_layers=tuple(stages),
        total_weight_bytes=weight_bytes(config),
        stage_weight_bytes=stage_bytes,
        decode_weight_bytes=decode,
        decode_expert_bytes=weight_bytes(config, tp_size=tp_size, routed_only=True),
        kda_state_bytes=state,
        kda_conv_bytes=num_kda * layout.conv_bytes,
        kda_block_bytes=layout.block_bytes,
        mla_token_bytes=layout.token_bytes,
        mla_bytes_per_token=layout.token_bytes / dcp_size,
        mla_page_bytes=layout.page_bytes,
        pages_per_request=pages,
        request_bytes=request,
        pool_bytes=pool,
        pool_source=source,
        max_requests=None if pool is None else pool // request,
        capacity_tokens=capacity(layout.token_bytes / dcp_size),
        capacity_tokens_no_dcp=capacity(layout.token_bytes),
        problems=tuple(problems),
    )
