"""Runners on a virtual clock: the engine's own scheduling over runners that compute nothing.

`Engine` runs unchanged over these twins of the real runners (`engine.runner.LocalRunner`,
`actors.pipeline.PipelineRunner`, `actors.decode.DecodeGroupRunner`), so admission, chunking,
the prefix cache, the pipeline's depth, the handoff, retraction and the overlapped decode are
the engine's own: when the engine changes, the simulation follows. A twin has the real
runner's protocol and memory: `cache_specs()` come from PagedCaches on the meta device with
the layout and arena bytes the real one would have (so pages, admission and retraction are the
real ones); `apply()` does nothing; `submit()` places the batch on the runner's timeline with
its cost (seconds of a ForwardBatch: `sim.cost.StepCost`, or any callable) and returns a
handle; `wait()` moves the shared `VirtualClock` to the handle's finish and returns zero logits
of VOCAB columns (cheap to sample; greedy takes token 0); `ready()` compares with the clock.

Time (seconds; `clock.now` is where the host, the engine, stands):
- One device (SimRunner): a batch starts when it is submitted and the device is free. In the
  overlapped decode the host takes a step's tokens after launching the next step, so `wait` on
  a decode batch moves the clock to the end of the step before it; on a prefill, to its own.
  (Decode is told from prefill by shape: every seq_len 1. A prefill batch of one-token chunks
  alone is taken for a decode step: the host then overlaps it, at most one host step early.)
- A pipeline (SimPipeline): stage s computes a batch once it has arrived. Its stream to s + 1
  is sent when s has computed it and s's previous send has arrived (a stage's call waits for
  that, then sends and ends), travels on s's link once that is free and s + 1 is free to
  receive (a stage receives inside its call: a rendezvous), and takes stream_s(s, batch). Up
  to P batches are in flight, as the engine submits them.
- The handoff: `export_request` runs on every stage after its queued forwards (at once, on
  the clock: the copies into the send buffers are not charged); `exported` says whether every
  stage has, `wait_exported` moves the clock there. Stage s's sends of its layers to the decode
  ranks go once the decode group's import has begun (the ranks receive inside their call,
  which starts after their queued decode steps) and the export has run, after the stage's
  earlier handoff sends (they share its bandwidth; its stream to the next stage goes to
  another peer, on its own timeline), and take handoff_s(s, num_tokens); the decode group is
  busy until the last stage's data arrives. The engine imports only what is `exported`, so the
  group is busy for the transfer alone; an import called before would hold it, as it holds the
  real ranks, until the stages reach the export. The copies out of the buffers are not
  charged; neither are `apply`'s moves.
- A decode group (SimDecodeGroup): its ranks in lockstep, one timeline; the cost holds its
  collectives.
- Host time (`drive`): an optional cost per engine step, spent after the step's wait, so an
  overlapped decode step takes max(device, host) and every other step device + host.
Every forward and transfer lands in `clock.trace` as a `Span`; busy seconds per stage in
`clock.busy`. `drive` runs a job to its end and times each request.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from k3batch.cache.layout import CacheLayout
from k3batch.cache.paged import PagedCache
from k3batch.engine.config import EngineConfig
from k3batch.engine.runner import arena_bytes as default_arena_bytes
from k3batch.engine.runner import sized
from k3batch.model.forward_batch import ForwardBatch

VOCAB = 16  # columns of the zero logits that `wait` returns


@dataclass(frozen=True, slots=True)
class Span:
    """One forward ("prefill" | "decode") on a stage, or one transfer on a stage's link
    ("stream": to the next stage; "handoff": one request to the decode group, seq_lens its
    tokens; "import": the decode group receiving it)."""

    runner: str
    stage: int
    kind: str
    start: float
    end: float
    seq_lens: tuple[int, ...]
    cached_lens: tuple[int, ...] = ()


class VirtualClock:
    """Simulated seconds shared by the runners of one replica, their busy time and trace.
    keep_trace=False keeps the sums only (a long run's spans of 256-row batches add up)."""

    def __init__(self, *, keep_trace: bool = True):
        self.now = 0.0
        self.keep_trace = keep_trace
        self.trace: list[Span] = []
        self.busy: dict[tuple[str, int], float] = {}  # (runner, stage) -> seconds of forwards
        self.window: dict[str, tuple[float, float]] = {}  # runner -> first start, last end
        self._end = 0.0

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)

    def record(self, span: Span) -> None:
        self._end = max(self._end, span.end)
        if span.kind in ("prefill", "decode"):
            key = span.runner, span.stage
            self.busy[key] = self.busy.get(key, 0.0) + span.end - span.start
            first, last = self.window.get(span.runner, (span.start, span.end))
            self.window[span.runner] = min(first, span.start), max(last, span.end)
        if self.keep_trace:
            self.trace.append(span)

    def end_s(self) -> float:
        """When everything submitted so far is done."""
        return max(self.now, self._end)


def phase(batch: ForwardBatch) -> str:
    return "decode" if all(n == 1 for n in batch.seq_lens) else "prefill"


class _Handle(NamedTuple):
    end: float  # when every stage (rank) has finished it
    rows: int  # rows of logits
    deferred: bool  # an overlapped decode step: the host syncs on the step before


def _seconds(cost) -> Callable[[ForwardBatch], float]:
    """A cost object's forward_s, or the callable itself."""
    return getattr(cost, "forward_s", cost)


def _meta_cache(config, layer_ids, engine_config: EngineConfig, nbytes: int | None,
                dtype: torch.dtype, *, tp: int = 1, dcp: int = 1,
                extra: int = 0) -> tuple[PagedCache, int]:  # fmt: skip
    """The arena the real runner would hold for these layers (its bytes: `nbytes`, else the
    runner's own default, `engine.runner.arena_bytes`), on the meta device; and its bytes."""
    layout = CacheLayout.build(config, layer_ids, page_size=engine_config.page_size,
                               dtype_bytes=dtype.itemsize, tp_size=tp)  # fmt: skip
    total = nbytes or default_arena_bytes(layout, engine_config, "cpu", dcp_size=dcp, extra=extra)
    return PagedCache(layout, total, device="meta", dtype=dtype, dcp_size=dcp), total


def _span(name, stage, batch, start, end) -> Span:
    return Span(name, stage, phase(batch), start, end, tuple(batch.seq_lens),
                tuple(batch.cached_lens))  # fmt: skip


class SimRunner:
    """LocalRunner's twin on a GPU with CUDA graphs: the whole model on one device, decode
    batches padded (`pads_decode`), fed tokens (the overlapped decode follows
    engine_config.overlap). engine_config is sized as LocalRunner sizes it on a GPU:
    max_num_seqs from the requests of max_seq_len the arena holds (less one request's room
    for the scratch rows), at most MAX_AUTO_SEQS."""

    depth, dcp_size, feeds_tokens, pads_decode = 1, 1, True, True

    def __init__(self, config, engine_config: EngineConfig, cost, *,
                 arena_bytes: int | None = None, clock: VirtualClock | None = None,
                 dtype: torch.dtype = torch.bfloat16, vocab_size: int = VOCAB,
                 name: str = "device"):  # fmt: skip
        """config: the K3Config; cost: seconds of a batch (`StepCost`, or a callable);
        arena_bytes: the device's arena (default: engine_config.cache_bytes, else room for
        max_num_seqs + 1 requests of max_seq_len); vocab_size: columns of the logits."""
        self.config, self.name, self.vocab_size = config, name, vocab_size
        self.clock = clock or VirtualClock()
        self._cost = _seconds(cost)
        layers = range(config.num_hidden_layers)
        self.cache, total = _meta_cache(config, layers, engine_config, arena_bytes, dtype,
                                        extra=1)  # fmt: skip
        fit = total // self.cache.layout.request_bytes(engine_config.max_seq_len) - 1
        self.engine_config = sized(engine_config, cuda=True, seqs_fit=fit)
        self.overlap = self.engine_config.overlap
        self._free = 0.0  # when the device has run everything submitted
        self._deferred: float | None = None  # end of the decode step whose tokens are in flight

    def cache_specs(self) -> list:
        return [self.cache.spec]

    def apply(self, moves) -> None:
        pass

    def submit(self, ids, batch: ForwardBatch, all_logits: bool, feed=None) -> _Handle:
        start = max(self.clock.now, self._free)
        self._free = end = start + self._cost(batch)
        span = _span(self.name, 0, batch, start, end)
        self.clock.record(span)
        rows = batch.num_tokens if all_logits else batch.num_seqs
        return _Handle(end, rows, self.overlap and span.kind == "decode")

    def wait(self, handle: _Handle) -> torch.Tensor:
        if handle.deferred:  # the host takes the tokens of the step before
            sync, self._deferred = self._deferred, handle.end
        else:  # the device runs in order: this covers a deferred step too
            sync, self._deferred = handle.end, None
        if sync is not None:
            self.clock.advance_to(sync)
        return torch.zeros(handle.rows, self.vocab_size)


class SimPipeline:
    """PipelineRunner's twin: P stages of layer_ranges[s] = [first, last) each (depth P), each
    on one device with its own arena; with a decode group, `export_request` hands requests to
    it (once `exported`: `SimDecodeGroup.import_request`). engine_config is sized as
    `actors.build` sizes it on GPUs (max_num_seqs GPU_GROUP_SEQS when 0)."""

    dcp_size = 1

    def __init__(self, config, engine_config: EngineConfig, layer_ranges: Sequence[tuple[int, int]],
                 costs: Sequence, *, arena_bytes: int | Sequence[int] | None = None,
                 stream_s: Callable[[int, ForwardBatch], float] | None = None,
                 handoff_s: Callable[[int, int], float] | None = None,
                 clock: VirtualClock | None = None, dtype: torch.dtype = torch.bfloat16,
                 name: str = "prefill"):  # fmt: skip
        """costs[s]: seconds of a batch on stage s; arena_bytes: per stage, or one figure for
        all (default: engine_config.cache_bytes, else room for max_num_seqs requests);
        stream_s(s, batch): the stream's transfer from stage s to s + 1 (default 0);
        handoff_s(s, num_tokens): stage s's sends of one request to the decode ranks
        (default 0)."""
        if len(costs) != len(layer_ranges):
            raise ValueError(f"{len(costs)} stage costs for {len(layer_ranges)} stages")
        self.config, self.name, self.layer_ranges = config, name, list(layer_ranges)
        self.clock = clock or VirtualClock()
        self.engine_config = sized(engine_config, cuda=True)
        self.depth = n = len(layer_ranges)
        per_stage = arena_bytes if isinstance(arena_bytes, Sequence) else [arena_bytes] * n
        self.caches = [_meta_cache(config, range(*rng), self.engine_config, b, dtype)[0]
                       for rng, b in zip(layer_ranges, per_stage)]  # fmt: skip
        self._costs = [_seconds(c) for c in costs]
        self._stream_s = stream_s or (lambda s, batch: 0.0)
        self._handoff_s = handoff_s or (lambda s, num_tokens: 0.0)
        self._free = [0.0] * n  # when stage s's calls so far have returned
        self._sent = [0.0] * n  # when stage s's last stream send arrived
        self._link = [0.0] * n  # when stage s's stream link (to s + 1) is free
        self._handoff_link = [0.0] * n  # when stage s's handoff sends so far have arrived

    def cache_specs(self) -> list:
        return [c.spec for c in self.caches]

    def apply(self, moves) -> None:
        pass

    def submit(self, ids, batch: ForwardBatch, all_logits: bool) -> _Handle:
        arrive = self.clock.now  # stage 0's input: the ids, with the call
        for s, cost in enumerate(self._costs):
            start = max(arrive, self._free[s])
            end = start + cost(batch)
            self.clock.record(_span(self.name, s, batch, start, end))
            if s == self.depth - 1:
                self._free[s] = end
                break
            self._free[s] = issued = max(end, self._sent[s])
            go = max(issued, self._link[s], self._free[s + 1])
            arrive = go + self._stream_s(s, batch)
            self._sent[s] = self._link[s] = arrive
            self.clock.record(Span(self.name, s, "stream", go, arrive, tuple(batch.seq_lens)))
        rows = batch.num_tokens if all_logits else batch.num_seqs
        return _Handle(max(self._free), rows, False)

    def wait(self, handle: _Handle) -> torch.Tensor:
        self.clock.advance_to(handle.end)
        return torch.zeros(handle.rows, VOCAB)

    def ready(self, handle: _Handle) -> bool:
        return handle.end <= self.clock.now

    def export_request(self, block: int, pages: list[int], num_tokens: int) -> "_Export":
        """Every stage's export call, queued after its forwards (it returns at once: the sends
        go when the decode group receives)."""
        for s in range(self.depth):
            self._free[s] = max(self.clock.now, self._free[s])
        return _Export(self, tuple(self._free), num_tokens)

    def exported(self, sent: "_Export") -> bool:
        """Whether every stage has run this export (an import would not wait)."""
        return max(sent.ready) <= self.clock.now

    def wait_exported(self, sent: "_Export") -> None:
        self.clock.advance_to(max(sent.ready))

    def bubble(self) -> dict:
        """As `PipelineRunner.bubble`: busy fraction per stage over the span from the first
        forward's start to the last one's end, and the bubble = 1 - their mean."""
        if self.name not in self.clock.window:
            return {"busy": [0.0] * self.depth, "bubble": 1.0, "span_s": 0.0}
        first, last = self.clock.window[self.name]
        span = last - first
        busy = [self.clock.busy.get((self.name, s), 0.0) / span for s in range(self.depth)]
        return {"busy": busy, "bubble": 1 - sum(busy) / len(busy), "span_s": span}


class _Export(NamedTuple):
    pipeline: SimPipeline
    ready: tuple[float, ...]  # when each stage's export call ran
    num_tokens: int


class SimDecodeGroup:
    """DecodeGroupRunner's twin: a group of tp ranks (DCP dcp inside it), each with its arena
    of its KDA heads and its DCP stripe of the MLA pages; decode batches padded."""

    depth, pads_decode = 1, True

    def __init__(self, config, engine_config: EngineConfig, cost, *, tp: int = 1, dcp: int = 1,
                 arena_bytes: int | None = None, clock: VirtualClock | None = None,
                 dtype: torch.dtype = torch.bfloat16, name: str = "decode"):  # fmt: skip
        """cost: seconds of a batch on the group (a rank's compute and its collectives);
        arena_bytes: per rank (default: engine_config.cache_bytes, else room for max_num_seqs
        + 1 requests of max_seq_len, as the real ranks size theirs)."""
        if tp < 1 or dcp < 1 or tp % dcp:
            raise ValueError(f"tp = {tp}, dcp = {dcp}: dcp must divide tp")
        self.config, self.name, self.tp, self.dcp_size = config, name, tp, dcp
        self.clock = clock or VirtualClock()
        self._cost = _seconds(cost)
        cfg = sized(engine_config, cuda=True)
        self.cache = _meta_cache(config, range(config.num_hidden_layers), cfg, arena_bytes, dtype,
                                 tp=tp, dcp=dcp, extra=1)[0]  # fmt: skip
        self._free = 0.0

    def cache_specs(self) -> list:
        return [self.cache.spec] * self.tp

    def apply(self, moves) -> None:
        pass

    def submit(self, ids, batch: ForwardBatch, all_logits: bool) -> _Handle:
        start = max(self.clock.now, self._free)
        self._free = end = start + self._cost(batch)
        self.clock.record(_span(self.name, 0, batch, start, end))
        return _Handle(end, batch.num_tokens if all_logits else batch.num_seqs, False)

    def wait(self, handle: _Handle) -> torch.Tensor:
        self.clock.advance_to(handle.end)
        return torch.zeros(handle.rows, VOCAB)

    def import_request(self, block: int, pages: list[int], sent: _Export) -> None:
        """Receive one request from every stage (see the module doc for the model)."""
        p, n = sent.pipeline, sent.num_tokens
        begin = done = max(self.clock.now, self._free)
        for s, ready in enumerate(sent.ready):
            go = max(ready, begin, p._handoff_link[s])
            p._handoff_link[s] = arrive = go + p._handoff_s(s, n)
            self.clock.record(Span(p.name, s, "handoff", go, arrive, (n,)))
            done = max(done, arrive)
        self._free = done
        self.clock.record(Span(self.name, 0, "import", begin, done, (n,)))


@dataclass(frozen=True, slots=True)
class HostCost:
    """Host seconds per engine step (the engine's bookkeeping, sampling, Python), e.g. from
    `k3batch bench host`'s prefill_host_ms_per_step and decode_host_ms_per_step."""

    prefill_s: float = 0.0
    decode_s: float = 0.0

    @classmethod
    def from_bench(cls, row: dict) -> "HostCost":
        return cls(row["prefill_host_ms_per_step"] / 1e3, row["decode_host_ms_per_step"] / 1e3)


class Timed(NamedTuple):
    """A finished request and its times on the clock: admitted (first entered the running set),
    first token (its first output token on the host), finished."""

    result: object  # engine.request.GenerationResult
    admitted_s: float
    first_token_s: float | None  # None: it failed before
    finish_s: float


def drive(engine, clock: VirtualClock, host: HostCost | None = None) -> list[Timed]:
    """Run the engine's requests to their end on the virtual clock, spending host time after
    each step (a prefill step's when it ran prompt chunks); then wait for the devices. Returns
    the requests in the order they finished, with their times (a retracted request keeps the
    times of its first run)."""
    host = host or HostCost()
    admitted, first, out = {}, {}, []
    while engine.has_unfinished():
        t = clock.now
        results = engine.step()
        for r in engine.running:
            admitted.setdefault(r.request_id, t)
            if r.output_token_ids:
                first.setdefault(r.request_id, clock.now)
        for res in results:
            rid = res.request_id
            if res.output_token_ids:
                first.setdefault(rid, clock.now)
            out.append(Timed(res, admitted.get(rid, t), first.get(rid), clock.now))
        clock.now += host.prefill_s if engine.last_step_prefill else host.decode_s
    clock.advance_to(clock.end_s())
    return out
