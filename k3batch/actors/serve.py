"""EngineServer: one engine stepped continuously by its own thread, fed rows from any thread.

`submit(items)` queues (key, prompt token ids, sampling) triples and returns at once; the
thread adds them to the engine between steps and steps while anything is unfinished
(continuous batching over everything submitted, whoever submitted it), calling
`on_finished(key, result)` for each finished request and `on_step(prefill, seconds)` (optional)
after each step (`Engine.last_step_prefill`). If the engine raises, the thread
calls `on_failure(exception)` once and stops. Used by the job's replica actor (`replica.py`) and by
the Ray Data replica (`k3batch.data`); what a caller does with results and failures is its own.
The callbacks run on the engine thread, between two steps, while the device may wait: they
should only hand the result on (per-row work such as decoding text belongs to the caller).

`StepAccount` says where the engine thread's time went (`EngineServer.account`; `bench job`
keeps one for the engine alone too): steps and their seconds by kind, the decode batch, steps
run with room for more requests and none waiting, time between steps with work to do (adding
requests, callbacks: the host's, while the device idles once its queued step is done), time
with nothing to run (no rows), and the slowest steps (a compile or an autotune in a step
shows there), each with the Triton kernels compiled since the step before
(`engine.compiles`) and, on one CUDA device, the caching allocator's device allocations and
retries in it (`cuda_alloc_counts`).
"""

import heapq
import queue
import threading
import time

import torch

from k3batch.engine import compiles


def cuda_alloc_counts(device):
    """A callable giving the CUDA caching allocator's running totals on `device`: (device
    allocations, retries). An allocation is a cudaMalloc of a new segment, made where no cached
    block fits (a batch shape the allocator has not seen); a retry is an allocation that found
    no room, so the allocator synchronized the device, freed its cached blocks and tried again,
    and the allocations after it pay cudaMalloc again. None for a device that is not CUDA (or
    None: a runner of actors, whose devices are in other processes)."""
    if device is None or torch.device(device).type != "cuda":
        return None

    def counts() -> tuple[int, int]:
        stats = torch.cuda.memory_stats_as_nested_dict(device)  # no flattening: one C++ call
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    return counts


class StepAccount:
    """The engine's time, step by step (see the module doc). `step` after each step, `idle`
    for each wait for work with nothing to run. Unix times (`first_step_at`, `last_step_at`)
    let a caller on another clock place the steps in its own window."""

    SLOWEST = 5  # steps kept in `slowest`

    def __init__(self, max_num_seqs: int, alloc_counts=None):
        """alloc_counts: a callable giving the allocator's running totals (device allocations,
        retries), as `cuda_alloc_counts` makes; None: the steps have no such counts."""
        self.max_num_seqs = max_num_seqs
        self.steps = {"prefill": 0, "decode": 0}
        self.busy_s = {"prefill": 0.0, "decode": 0.0}
        self.decode_rows = 0  # requests in the engine, summed over decode steps
        self.room_steps = 0  # steps with fewer than max_num_seqs requests and none waiting
        self.between_s = 0.0  # between two steps with requests unfinished: the host's time
        self.idle_s = 0.0  # after the first step: nothing to run, waiting for requests
        self.first_step_at: float | None = None  # Unix time the first step started
        self.last_step_at: float | None = None  # Unix time the last step ended
        # min-heap of (seconds, since the first step, kind, requests, tokens, submit seconds,
        # {kernel: compiles}, (device allocations, retries) or None)
        self._slowest: list = []
        self._start = self._end = None  # perf_counter: the first step's start, the last's end
        self._idle = 0.0  # idle time since the last step
        self.compiles = 0  # Triton kernels compiled during or between steps
        compiles.watch()
        compiles.take()  # the start-up's (warm-up, graph capture) are not a step's
        self._alloc_counts = alloc_counts
        self._allocs = alloc_counts() if alloc_counts else None  # the totals after the last step

    @classmethod
    def of(cls, engine) -> "StepAccount":
        """The account of an engine's steps, with allocator counts where its runner holds one
        CUDA device in this process."""
        device = getattr(engine.runner, "device", None)
        return cls(engine.config.max_num_seqs, cuda_alloc_counts(device))

    def idle(self, seconds: float) -> None:
        """The engine waited `seconds` for requests with nothing to run."""
        if self._end is not None:
            self._idle += seconds

    def engine_step(self, engine, start: float, seconds: float, finished: list) -> None:
        """`step` for the engine's step that began at `start` and returned `finished`."""
        self.step(start, seconds, prefill=engine.last_step_prefill,
                  running=len(engine.running) + len(finished), waiting=len(engine.waiting),
                  tokens=engine.last_step_tokens, submit_s=engine.last_step_submit_s)  # fmt: skip

    def step(self, start: float, seconds: float, *, prefill: bool, running: int,
             waiting: int, tokens: int = 0, submit_s: float = 0.0) -> None:  # fmt: skip
        """A step that began at `start` (perf_counter) and took `seconds` with `running`
        requests in the engine (those it finished included) and `waiting` still queued;
        tokens: what it submitted; submit_s: its time in the runner's submit (on one device
        the host's enqueue of the forward, compiles included; the rest of a slow step is the
        wait for the device or the host's own work)."""
        kind = "prefill" if prefill else "decode"
        if self._start is None:
            self._start, self.first_step_at = start, time.time() - (time.perf_counter() - start)
        else:
            gap = start - self._end
            self.idle_s += min(self._idle, gap)
            self.between_s += max(gap - self._idle, 0.0)
        self._idle = 0.0
        self._end = start + seconds
        self.last_step_at = time.time() - (time.perf_counter() - self._end)
        self.steps[kind] += 1
        self.busy_s[kind] += seconds
        if not prefill:
            self.decode_rows += running
        if running < self.max_num_seqs and not waiting:
            self.room_steps += 1
        compiled = compiles.take()
        self.compiles += sum(compiled.values())
        allocs = None
        if self._alloc_counts is not None:
            now = self._alloc_counts()
            allocs = (now[0] - self._allocs[0], now[1] - self._allocs[1])
            self._allocs = now
        entry = (seconds, start - self._start, kind, running, tokens, submit_s, compiled, allocs)
        if len(self._slowest) < self.SLOWEST:
            heapq.heappush(self._slowest, entry)
        elif seconds > self._slowest[0][0]:
            heapq.heapreplace(self._slowest, entry)

    def to_dict(self) -> dict:
        decode = self.steps["decode"]
        slowest = sorted(self._slowest, reverse=True)
        return {
            "max_num_seqs": self.max_num_seqs,
            "steps": dict(self.steps),
            "busy_s": {k: round(v, 4) for k, v in self.busy_s.items()},
            "mean_decode_batch": round(self.decode_rows / decode, 1) if decode else 0.0,
            "room_steps": self.room_steps,
            "between_s": round(self.between_s, 4),
            "idle_s": round(self.idle_s, 4),
            "first_step_at": self.first_step_at,
            "last_step_at": self.last_step_at,
            "compiles": self.compiles,
            "slowest": [
                {"s": round(s, 4), "at_s": round(at, 3), "kind": kind, "requests": n,
                 "tokens": tokens, "submit_s": round(sub, 4)}
                | ({"compiled": compiled} if compiled else {})
                | ({"device_allocs": allocs[0], "alloc_retries": allocs[1]} if allocs else {})
                for s, at, kind, n, tokens, sub, compiled, allocs in slowest
            ],
        }


def account_line(acct: dict) -> str:
    """A `StepAccount.to_dict()` in a line: steps and seconds by kind, the mean decode batch,
    the host's time between steps, the time with nothing to run, the three slowest steps
    (seconds since the first step)."""
    steps, busy = acct["steps"], acct["busy_s"]
    line = (
        f"{steps['prefill']} prefill steps {busy['prefill']:.2f} s, {steps['decode']} decode "
        f"steps {busy['decode']:.2f} s (mean batch {acct['mean_decode_batch']:.1f} of "
        f"{acct['max_num_seqs']}; {acct['room_steps']} steps with room and none waiting), "
        f"between steps {acct['between_s']:.2f} s, no rows {acct['idle_s']:.2f} s"
    )
    if acct.get("compiles"):
        line += f", {acct['compiles']} kernels compiled"
    if acct["slowest"]:
        line += "; slowest: " + ", ".join(
            f"{s['kind']} {s['s'] * 1e3:.0f} ms at {s['at_s']:.1f} s" + _detail(s)
            for s in acct["slowest"][:3]
        )
    return line


def _detail(step: dict) -> str:
    """" (N tokens, S ms in submit; A device allocations, R allocator retries; compiled: name
    xN, ...)" of a slowest step: what it submitted, its time in the runner's submit, the CUDA
    allocator's work in it and the kernels compiled in it."""
    parts = []
    if step.get("tokens"):
        parts.append(f"{step['tokens']:,} tokens, {step['submit_s'] * 1e3:.0f} ms in submit")
    if "device_allocs" in step:
        parts.append(f"{step['device_allocs']} device allocations, "
                     f"{step['alloc_retries']} allocator retries")  # fmt: skip
    if names := step.get("compiled"):
        parts.append("compiled: " + ", ".join(f"{k} x{n}" for k, n in sorted(names.items())))
    return f" ({'; '.join(parts)})" if parts else ""


class EngineServer:
    def __init__(self, engine, on_finished, on_failure, on_step=None):
        self.engine = engine
        self._on_step = on_step
        self.busy_s = 0.0  # time inside engine steps
        self.rows = 0  # requests finished
        self.account = StepAccount.of(engine)
        self._on_finished, self._on_failure = on_finished, on_failure
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next_id = 0
        threading.Thread(target=self._loop, daemon=True, name="engine").start()

    def submit(self, items) -> None:
        """items: (key, prompt token ids, SamplingParams) triples; the key comes back with
        the request's result."""
        self._inbox.put(list(items))

    def _loop(self) -> None:
        owner = {}  # request id -> key
        engine, account = self.engine, self.account
        try:
            while True:
                block = not engine.has_unfinished()
                while True:
                    t0 = time.perf_counter()
                    try:
                        items = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    if block:
                        account.idle(time.perf_counter() - t0)
                    block = False
                    for key, ids, sampling in items:
                        rid = str(self._next_id)
                        self._next_id += 1
                        owner[rid] = key
                        engine.add_request(rid, ids, sampling)
                if not engine.has_unfinished():
                    continue
                t0 = time.perf_counter()
                finished = engine.step()
                dt = time.perf_counter() - t0
                self.busy_s += dt
                account.engine_step(engine, t0, dt, finished)
                if self._on_step is not None:
                    self._on_step(engine.last_step_prefill, dt)
                self.rows += len(finished)
                for res in finished:
                    self._on_finished(owner.pop(res.request_id), res)
        except BaseException as e:
            self._on_failure(e)
