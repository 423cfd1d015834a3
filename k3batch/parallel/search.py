"""The smallest layout that fits: `smallest_layout(config, gpu=...)` plans layouts
(`parallel.plan.make_plan`) in order of GPUs per replica and returns the first that holds the
weights plus a workload (`min_requests` requests of `context_len` tokens in one decode group's
pool), with every layout it tried and why each does not fit (`LayoutSearch`)."""

import itertools
import math
from dataclasses import dataclass

from k3batch.model.config import K3Config
from k3batch.parallel.layout import ParallelLayout
from k3batch.parallel.plan import GPUS_PER_NODE, Plan, make_plan, weight_sides

# The search's default workload: 32 requests of 128K tokens held at once by one decode group
# (4M tokens of context). Long-context batch jobs (documents, agent traces) at a decode batch
# that keeps a TP group's GEMMs from running on a handful of rows.
DEFAULT_MIN_REQUESTS = 32
DEFAULT_SEARCH_CONTEXT = 128 * 1024
MAX_SEARCH_PP = 32
MAX_SEARCH_TP = 64


def tp_sizes(config: K3Config, max_tp: int = MAX_SEARCH_TP) -> list[int]:
    """The TP sizes up to max_tp that `ParallelLayout.validate` accepts for config, ascending."""
    sizes = []
    for tp in range(1, max_tp + 1):
        try:
            ParallelLayout(tp_size=tp).validate(config)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def shortfall(plan: Plan, min_requests: int) -> list[str]:
    """Why `plan` does not hold its weights plus min_requests requests of plan.context_len
    tokens per decode group: each side that is over and by how much. Empty when it fits."""
    why = []
    sides = weight_sides(plan.is_single_device, plan.prefill_weight_bytes, plan.decode_weight_bytes)
    for side, nbytes in sides:
        over = nbytes + plan.reserve_bytes - plan.usable_bytes
        if over > 0:
            why.append(f"{side} {over / 1e9:,.1f} GB over")
    if why or plan.problems:
        return why or list(plan.problems)
    held = plan.max_requests or 0
    if held < min_requests:
        short = min_requests * plan.request_bytes - (plan.pool_bytes or 0)
        why.append(f"cache holds {held} of {min_requests} requests ({short / 1e9:,.1f} GB short)")
    return why


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutSearch:
    """What `smallest_layout` did: the plans it made, in the order tried, and the one it chose
    (None when no layout within its limits fits)."""

    min_requests: int
    pp_sizes: tuple[int, ...]
    tp_sizes: tuple[int, ...]
    tried: tuple[Plan, ...]
    chosen: Plan | None

    def lines(self) -> list[str]:
        first = self.tried[0]
        ctx = f"{first.context_len:,}"
        out = [
            (f"search: the fewest GPUs per replica (pp prefill stages + a tp decode group, or "
             f"one single-device GPU at pp 1, tp 1) for {first.name} on {first.gpu} ({first.gpu_bytes / 1e9:.0f} GB, memory fraction "
             f"{first.memory_fraction}) holding the weights and {self.min_requests} requests "
             f"of {ctx} tokens per decode group"),
            (f"  pp in {', '.join(map(str, self.pp_sizes))}; tp in "
             f"{', '.join(map(str, self.tp_sizes))}; dcp = tp (DCP moves no weights and "
             f"divides the MLA latent); ties: the most requests"),
            f"  {'gpus':>4} {'pp':>3} {'tp':>3} {'dcp':>3} {'prefill GB':>10} "
            f"{'decode GB':>10} {'requests':>8}  result",
        ]  # fmt: skip
        for p in self.tried:
            why = shortfall(p, self.min_requests)
            result = "; ".join(why) or ("fits (chosen)" if p is self.chosen else "fits")
            held = "-" if p.max_requests is None else f"{p.max_requests:,}"
            out.append(
                f"  {p.num_gpus:>4} {p.pp_size:>3} {p.tp_size:>3} {p.dcp_size:>3} "
                f"{p.prefill_weight_bytes / 1e9:>10,.1f} {p.decode_weight_bytes / 1e9:>10,.1f} "
                f"{held:>8}  {result}"
            )
        c = self.chosen
        if c is None:
            gpus = max(p.num_gpus for p in self.tried)
            return out + [f"no layout of up to {gpus} GPUs per replica fits"]
        per_node = GPUS_PER_NODE[c.gpu]
        split = "a single-device engine" if c.is_single_device else (
            f"{c.pp_size} prefill + {c.tp_size} decode")  # fmt: skip
        out += [
            (f"smallest layout: pp {c.pp_size}, tp {c.tp_size}, dcp {c.dcp_size} = "
             f"{c.num_gpus} GPU{'s' if c.num_gpus > 1 else ''} per replica ({split}; "
             f"{_nodes(c.num_gpus, per_node)} of {per_node} {c.gpu}): "
             f"{'' if c.is_single_device else 'decode '}weights "
             f"{c.decode_weight_bytes / 1e9:,.1f} GB and cache pool "
             f"{c.pool_bytes / 1e9:,.1f} GB per GPU, {c.max_requests:,} requests of {ctx} "
             f"tokens (>= {self.min_requests})"),
        ]  # fmt: skip
        if c.tp_size > per_node:
            out.append(
                f"  note: the decode group spans {_nodes(c.tp_size, per_node)} of {per_node} "
                "(its TP collectives cross the network): the replica's placement group is then "
                "PACK (driver/replicas.py); not yet run across nodes"
            )
        return out + [""] + c.lines()

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _nodes(num_gpus: int, per_node: int) -> str:
    n = math.ceil(num_gpus / per_node)
    return f"{n} node{'s' if n > 1 else ''}"


def smallest_layout(
    config: K3Config,
    *,
    gpu: str = "h200",
    min_requests: int = DEFAULT_MIN_REQUESTS,
    context_len: int = DEFAULT_SEARCH_CONTEXT,
    max_pp: int = MAX_SEARCH_PP,
    max_tp: int = MAX_SEARCH_TP,
    **plan_kw,
) -> LayoutSearch:
    """Plan layouts in order of GPUs per replica (pp + tp, 1 for pp = tp = 1; pp a power of two
    up to max_pp and num_hidden_layers, tp in `tp_sizes`, dcp = tp) and choose, among those of
    the fewest GPUs whose weights fit and whose decode pool holds min_requests requests of
    context_len tokens, the one holding the most requests. `plan_kw` goes to `make_plan` (name,
    memory_fraction, page_size, reserve_bytes, ...). Raises ValueError on bad values."""
    if min_requests < 1:
        raise ValueError(f"min_requests = {min_requests} must be >= 1")
    if max_pp < 1 or max_tp < 1:
        raise ValueError(f"max_pp = {max_pp} and max_tp = {max_tp} must be >= 1")
    pps = [1 << i for i in range(max_pp.bit_length()) if 1 << i <= config.num_hidden_layers]
    tps = tp_sizes(config, max_tp)

    def num_gpus(pt: tuple[int, int]) -> int:
        return 1 if pt == (1, 1) else sum(pt)  # as `Plan.num_gpus`

    layouts = sorted(itertools.product(pps, tps), key=lambda pt: (num_gpus(pt), pt))
    tried, fits = [], []
    for _, group in itertools.groupby(layouts, key=num_gpus):
        for pp, tp in group:
            plan = make_plan(config, gpu=gpu, pp_size=pp, tp_size=tp, dcp_size=tp,
                             context_len=context_len, **plan_kw)  # fmt: skip
            tried.append(plan)
            if not shortfall(plan, min_requests):
                fits.append(plan)
        if fits:
            break
    return LayoutSearch(
        min_requests=min_requests,
        pp_sizes=tuple(pps),
        tp_sizes=tuple(tps),
        tried=tuple(tried),
        chosen=max(fits, key=lambda p: (p.max_requests, p.capacity_tokens), default=None),
    )
