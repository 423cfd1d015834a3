"""Replay a decode workload against one decode rank's cache pool: static split vs unified arena.

Models one decode rank (a TP group, optionally with DCP) whose pool holds one KDA block per
running request and the MLA pages of its context, placed by the real `CacheManager` and
`Arena` (no prefix cache). Requests arrive at given steps with their prompt already prefilled
(the handoff brings the block and the prompt's pages). Each step admits queued requests FIFO
while they fit (and while fewer than max_num_seqs run), then every running request decodes one
token, taking a page at page boundaries; when no page is left the youngest running request is
retracted: released and put back at the head of the queue, to start over (its decoded tokens
are counted as lost). Runs of steps where nothing happens are skipped in one stride, exactly.

Does not model: the time a step takes (a step is one decode iteration, whatever the batch),
prefill or its queue, prefix sharing, admission watermarks, activation memory, or the cost of
compaction moves. Pure Python (no torch of its own): `python -m k3batch.cache.simulate`.
"""

import heapq
import random
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from k3batch.cache.arena import ArenaSpec
from k3batch.cache.layout import CacheLayout
from k3batch.cache.manager import CacheManager

GiB = 1 << 30


class Request(NamedTuple):
    arrival_step: int  # the step at which it joins the queue
    prompt_len: int  # tokens already prefilled when it arrives
    output_len: int  # tokens to decode


class SimResult(NamedTuple):
    steps: int  # decode steps until the last request finished
    admission_failures: int  # steps on which the queue's head waited for room while others ran
    retractions: int
    lost_tokens: int  # decoded tokens thrown away by retractions (decoded again later)
    peak_used_bytes: int
    pool_bytes: int
    peak_concurrency: int
    mean_concurrency: float  # running requests per step
    mean_use: float  # used bytes / pool bytes, per step
    tokens_per_step: float  # output tokens / steps (lost tokens not counted): the throughput
    output_lens: tuple[int, ...]  # tokens each request finished with, in workload order


# name: (fraction of long requests, requests per burst, steps between bursts)
WORKLOADS = {
    "short-heavy": (0.02, (2, 8), (1, 2)),
    "long-heavy": (0.35, (1, 4), (5, 20)),
    "mixed-bursts": (0.10, (100, 400), (500, 2000)),
}


def make_workload(
    name: str,
    *,
    num_requests: int,
    seed: int,
    short_prompt: tuple[int, int] = (1024, 4096),
    long_prompt: tuple[int, int] = (65536, 524288),
    output: tuple[int, int] = (128, 2048),
) -> list[Request]:
    """A seeded workload of WORKLOADS[name]: uniform short prompts, log-uniform long prompts,
    uniform output lengths, arriving in bursts. Sorted by arrival step."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    long_fraction, burst, gap = WORKLOADS[name]
    rng = random.Random(seed)
    out, step = [], 0
    while len(out) < num_requests:
        for _ in range(min(rng.randint(*burst), num_requests - len(out))):
            if rng.random() < long_fraction:
                lo, hi = long_prompt
                prompt = int(lo * (hi / lo) ** rng.random())
            else:
                prompt = rng.randint(*short_prompt)
            out.append(Request(step, prompt, rng.randint(*output)))
        step += rng.randint(*gap)
    return out


def static_split(pool_bytes: int, layout: CacheLayout, *, context_len: int, dcp_size: int = 1):
    """KDA blocks that a two-region pool reserves when it is sized for requests of
    context_len tokens: pool / (one block + the pages of context_len tokens)."""
    return pool_bytes // layout.request_bytes(context_len, dcp_size)


@dataclass(slots=True, eq=False)
class _Run:
    idx: int  # position in the workload
    start: int  # the step of its admission, its first decode step
    cap: int  # tokens its pages cover
    seq: int  # admission order (youngest = largest)


def simulate(
    workload: list[Request],
    *,
    layout: CacheLayout,
    pool_bytes: int,
    mode: str,
    static_blocks: int | None = None,
    max_num_seqs: int = 256,
    dcp_size: int = 1,
) -> SimResult:
    """Replay `workload` on one rank's pool of pool_bytes (module docstring). mode "static":
    `static_blocks` KDA blocks reserved on the left, pages in the rest; mode "unified": blocks
    and pages share the free middle. dcp_size: ranks a sequence's tokens are striped over
    (layout's pages then hold page_size local tokens). Raises ValueError if a request cannot
    fit even an empty pool, and on an empty workload."""
    if mode not in ("static", "unified"):
        raise ValueError(f"mode = {mode!r}; expected 'static' or 'unified'")
    if (mode == "static") != (static_blocks is not None):
        raise ValueError(f"mode = {mode!r} with static_blocks = {static_blocks}")
    if not workload or min(min(r.output_len, r.prompt_len + 1) for r in workload) < 1:
        raise ValueError("the workload needs requests with output_len >= 1, prompt_len >= 0")
    spec = ArenaSpec(
        total_bytes=pool_bytes, block_bytes=layout.block_bytes, page_bytes=layout.page_bytes
    )
    mgr = CacheManager(
        [spec], page_size=layout.page_size, static_blocks=static_blocks, dcp_size=dcp_size
    )
    page_tokens = layout.page_size * dcp_size  # sequence tokens per page of this rank
    num = len(workload)
    order = sorted(range(num), key=lambda i: (workload[i].arrival_step, i))
    queue: deque[int] = deque()
    running: dict[int, _Run] = {}  # insertion order = admission order
    events: list[tuple[int, int, int]] = []  # (step, seq, idx): a page is due or it finishes
    output_lens = [0] * num
    step = arrived = done = seq = 0
    failures = retractions = lost = peak_conc = 0
    conc_sum = use_sum = 0

    def push(r: _Run) -> None:
        req = workload[r.idx]
        page_step = r.start + r.cap - req.prompt_len  # decodes position cap: needs a page
        heapq.heappush(events, (min(page_step, r.start + req.output_len - 1), r.seq, r.idx))

    def retract_youngest(now: int) -> _Run:
        nonlocal retractions, lost
        victim = running.pop(next(reversed(running)))
        mgr.release(str(victim.idx))
        queue.appendleft(victim.idx)
        retractions, lost = retractions + 1, lost + now - victim.start
        return victim

    while done < num:
        while arrived < num and workload[order[arrived]].arrival_step <= step:
            queue.append(order[arrived])
            arrived += 1
        blocked = False  # the head waits for memory (not for max_num_seqs)
        while queue and len(running) < max_num_seqs:
            i, req = queue[0], workload[queue[0]]
            if mgr.admit(str(i), (), req.prompt_len) is None:
                if not running:
                    raise ValueError(
                        f"request {i} (prompt_len = {req.prompt_len}) does not fit an empty "
                        f"pool of {pool_bytes} bytes (mode {mode!r})"
                    )
                blocked = True
                break
            queue.popleft()
            seq += 1
            running[i] = r = _Run(i, step, mgr.pages_for(req.prompt_len) * page_tokens, seq)
            push(r)
        failures += blocked

        due = []  # running requests with an event now, oldest first (heap order)
        while events and events[0][0] == step:
            _, s, i = heapq.heappop(events)
            if i in running and running[i].seq == s:
                due.append(running[i])
        freed = False
        for r in due:
            position = workload[r.idx].prompt_len + step - r.start
            if running.get(r.idx) is not r or position < r.cap:
                continue
            while not mgr.grow(str(r.idx), position + 1):
                freed = True
                if retract_youngest(step) is r:
                    break
            else:
                r.cap += page_tokens

        conc_sum += len(running)
        use_sum += mgr.arena.used_bytes()[0]
        peak_conc = max(peak_conc, len(running))
        for r in due:
            if running.get(r.idx) is not r:
                continue
            if step == r.start + workload[r.idx].output_len - 1:
                del running[r.idx]
                mgr.release(str(r.idx))
                output_lens[r.idx] = step - r.start + 1
                done, freed = done + 1, True
            else:
                push(r)

        # Nothing changes until the next event, arrival, or (after a free) admission.
        nxt = [events[0][0]] if events else []
        if arrived < num:
            nxt.append(workload[order[arrived]].arrival_step)
        if freed and queue:
            nxt.append(step + 1)
        quiet = min(nxt, default=step + 1) - step - 1
        assert quiet >= 0, "the simulation went back in time"
        conc_sum += quiet * len(running)
        use_sum += quiet * mgr.arena.used_bytes()[0]
        failures += quiet * blocked
        step += quiet + 1

    steps = step
    return SimResult(
        steps=steps,
        admission_failures=failures,
        retractions=retractions,
        lost_tokens=lost,
        peak_used_bytes=mgr.stats.peak_used_bytes[0],
        pool_bytes=pool_bytes,
        peak_concurrency=peak_conc,
        mean_concurrency=conc_sum / steps,
        mean_use=use_sum / steps / pool_bytes,
        tokens_per_step=(conc_sum - lost) / steps,
        output_lens=tuple(output_lens),
    )


def main() -> None:
    from k3batch.model.config import get_flavor

    config = get_flavor("k3")
    layers = range(len(config.layer_types))
    layout = CacheLayout.build(config, layers, page_size=64, dtype_bytes=2, tp_size=8)
    pool, context_len, num_requests = 40 * GiB, 32768, 1000
    print(
        f"k3, one decode rank of TP8 (all {len(layers)} layers): KDA block "
        f"{layout.block_bytes / 2**20:.1f} MiB, page of {layout.page_size} tokens "
        f"{layout.page_bytes / 2**10:.0f} KiB, pool {pool / GiB:.0f} GiB, max_num_seqs 256; "
        f"static split sized for {context_len}-token contexts; {num_requests} requests each\n"
        "adm_fail: steps the queue's head waited for memory while others ran; retract: youngest "
        "requests released for a page (lost_tok decoded again); use%: mean used / pool; "
        "tok/step: output tokens per decode step"
    )
    row = "{:>8} {:>12} {:>7} {:>6} {:>8} {:>7} {:>8} {:>8} {:>5} {:>4} {:>9} {:>9} {:>8} {:>6}"
    print(row.format("rank", "workload", "mode", "blocks", "adm_fail", "retract", "lost_tok",
                     "peak_GiB", "peak%", "use%", "mean_conc", "peak_conc", "tok/step", "steps"))  # fmt: skip
    for dcp in (1, 8):
        static = static_split(pool, layout, context_len=context_len, dcp_size=dcp)
        for name in WORKLOADS:
            workload = make_workload(name, num_requests=num_requests, seed=0)
            for mode, blocks in (("static", static), ("unified", None)):
                r = simulate(workload, layout=layout, pool_bytes=pool, mode=mode,
                             static_blocks=blocks, dcp_size=dcp)  # fmt: skip
                print(row.format(
                    "tp8" if dcp == 1 else f"tp8+dcp{dcp}", name, mode, blocks or "-",
                    r.admission_failures, r.retractions, r.lost_tokens,
                    f"{r.peak_used_bytes / GiB:.1f}", f"{100 * r.peak_used_bytes / pool:.0f}",
                    f"{100 * r.mean_use:.0f}", f"{r.mean_concurrency:.1f}", r.peak_concurrency,
                    f"{r.tokens_per_step:.1f}", r.steps,
                ))  # fmt: skip


if __name__ == "__main__":
    main()
