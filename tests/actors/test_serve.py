"""The engine thread's account (`actors.serve.StepAccount`): steps by kind, the decode batch,
steps with room and none waiting, the host's time between steps apart from the time with no
rows, the slowest steps; and `EngineServer` keeping it over a stub engine (no model, no Ray)."""

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from k3batch.actors.serve import EngineServer, StepAccount, account_line
from k3batch.engine.request import GenerationResult, SamplingParams


def test_account_splits_the_time_between_steps():
    a = StepAccount(max_num_seqs=4)
    a.idle(5.0)  # before the first step: the wait for the first rows is not the engine's
    a.step(10.0, 0.5, prefill=True, running=4, waiting=2, tokens=512, submit_s=0.1)
    a.step(10.6, 0.02, prefill=False, running=4, waiting=0)  # 0.1 s of host work before it
    a.idle(0.3)  # then no rows for 0.3 s, and 0.08 s of host work
    a.step(11.0, 0.02, prefill=False, running=2, waiting=0)  # room, none waiting
    d = a.to_dict()
    assert d["steps"] == {"prefill": 1, "decode": 2}
    assert d["busy_s"] == {"prefill": 0.5, "decode": 0.04}
    assert d["mean_decode_batch"] == 3.0 and d["room_steps"] == 1
    assert d["idle_s"] == pytest.approx(0.3) and d["between_s"] == pytest.approx(0.18)
    assert [s["s"] for s in d["slowest"]] == [0.5, 0.02, 0.02]
    assert d["slowest"][0] == {"s": 0.5, "at_s": 0.0, "kind": "prefill", "requests": 4,
                               "tokens": 512, "submit_s": 0.1}
    assert d["last_step_at"] - d["first_step_at"] == pytest.approx(1.02, abs=1e-3)
    assert "1 prefill steps 0.50 s, 2 decode steps 0.04 s (mean batch 3.0 of 4" in account_line(d)


def test_account_keeps_the_five_slowest_steps():
    a = StepAccount(max_num_seqs=1)
    for i, s in enumerate([3, 9, 1, 7, 5, 8, 2, 6]):
        a.step(float(i * 10), float(s), prefill=False, running=1, waiting=0)
    assert [s["s"] for s in a.to_dict()["slowest"]] == [9, 8, 7, 6, 5]


def _compile(name):
    """What Triton does after compiling a launch: call the post-compile hook."""
    from triton import knobs

    knobs.runtime.jit_post_compile_hook(key=None, repr=name, fn=SimpleNamespace(name=name),
                                        compile={}, is_manual_warmup=False,
                                        already_compiled=False)  # fmt: skip


def test_slowest_steps_name_the_kernels_compiled_in_them():
    """A cold job's slow step said nothing of why (one 2.9 s prefill step on an H100); the
    account now names the Triton kernels compiled since the step before, and counts them.
    Compiles before the account exists (the start-up's warm-up) belong to no step."""
    from k3batch.engine import compiles

    compiles.watch()
    _compile("warm_up_kernel")
    a = StepAccount(max_num_seqs=1)
    a.step(0.0, 0.1, prefill=True, running=1, waiting=0)
    _compile("conv_kernel")
    _compile("conv_kernel")
    _compile("gemm_kernel")
    a.step(1.0, 2.9, prefill=True, running=1, waiting=0, tokens=6016, submit_s=2.8)
    a.step(4.0, 0.2, prefill=False, running=1, waiting=0, tokens=1)
    d = a.to_dict()
    assert d["compiles"] == 3
    assert d["slowest"][0]["compiled"] == {"conv_kernel": 2, "gemm_kernel": 1}
    assert all("compiled" not in s for s in d["slowest"][1:])
    assert "3 kernels compiled; slowest: prefill 2900 ms at 1.0 s (6,016 tokens, 2800 ms in " \
        "submit; compiled: conv_kernel x2, gemm_kernel x1), decode 200 ms at 4.0 s (1 tokens, " \
        "0 ms in submit)" in account_line(d)


def test_slowest_steps_count_the_allocators_work_in_them():
    """A step whose batch shape the CUDA caching allocator has not seen makes new segments
    (cudaMalloc), and one that finds no room flushes the allocator's cache and retries (a
    device synchronization): each slowest step says how many of each it made, from the
    allocator's running totals read after every step. Without a counter (not one CUDA device
    in this process) the steps say nothing of it."""
    totals = iter([(40, 0), (40, 0), (57, 1), (57, 1)])  # at the start, then after each step
    a = StepAccount(max_num_seqs=1, alloc_counts=lambda: next(totals))
    a.step(0.0, 0.1, prefill=True, running=1, waiting=0, tokens=8192, submit_s=0.05)
    a.step(1.0, 2.9, prefill=True, running=1, waiting=0, tokens=6016, submit_s=0.06)
    a.step(4.0, 0.02, prefill=False, running=1, waiting=0, tokens=1)
    slow, first, decode = a.to_dict()["slowest"]
    assert (slow["device_allocs"], slow["alloc_retries"]) == (17, 1)
    assert (first["device_allocs"], first["alloc_retries"]) == (0, 0)
    assert (decode["device_allocs"], decode["alloc_retries"]) == (0, 0)
    assert "prefill 2900 ms at 1.0 s (6,016 tokens, 60 ms in submit; 17 device allocations, " \
        "1 allocator retries)" in account_line(a.to_dict())
    none = StepAccount.of(_Engine())  # a runner with no CUDA device
    none.step(0.0, 0.1, prefill=True, running=1, waiting=0, tokens=8192)
    assert "device_allocs" not in none.to_dict()["slowest"][0]


def test_compile_watch_keeps_a_hook_already_there(monkeypatch):
    from triton import knobs

    from k3batch.engine import compiles

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw))
    monkeypatch.setattr(compiles, "_watching", False)
    assert compiles.watch() and compiles.watch()  # a second watch adds no second count
    compiles.take()
    _compile("k")
    assert compiles.take() == {"k": 1} and len(seen) == 1 and compiles.take() == {}


class _Engine:
    """A request finishes after `max_new_tokens` steps of 2 ms; every step a decode step."""

    config = SimpleNamespace(max_num_seqs=2)
    runner = None  # no device: the account has no allocator counts
    last_step_prefill, last_step_tokens, last_step_submit_s = False, 0, 0.0

    def __init__(self):
        self.running, self.waiting = [], []

    def add_request(self, rid, ids, sp):
        self.waiting.append([rid, sp.max_new_tokens, ids])

    def has_unfinished(self):
        return bool(self.running or self.waiting)

    def step(self):
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        threading.Event().wait(0.002)
        done = []
        for req in list(self.running):
            req[1] -= 1
            if req[1] == 0:
                self.running.remove(req)
                done.append(GenerationResult(req[0], req[2], [7], "length"))
        return done


def test_server_accounts_for_every_step_and_the_wait_for_rows():
    finished = []
    server = EngineServer(_Engine(), lambda key, res: finished.append(key), None)
    sp = SamplingParams(max_new_tokens=3)
    server.submit([(k, [1], sp) for k in "abc"])  # 2 at once, then the third alone
    deadline = time.monotonic() + 10
    while len(finished) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # no rows: the engine thread waits
    server.submit([("d", [1], SamplingParams(max_new_tokens=1))])
    while len(finished) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    d = server.account.to_dict()
    assert finished == ["a", "b", "c", "d"]
    assert d["steps"] == {"prefill": 0, "decode": 7} and server.rows == 4
    assert d["room_steps"] == 4  # the third row's steps (alone) and the fourth's
    assert d["idle_s"] >= 0.04 and d["between_s"] < d["idle_s"]
    assert d["busy_s"]["decode"] == pytest.approx(server.busy_s, abs=1e-3)


def test_an_actors_start_up_is_kept_out_of_garbage_collections():
    """What an actor holds at the end of its start-up is never walked by a collection again
    (in a process of its own here: freezing is for processes that only serve)."""
    code = ("import gc, torch; from k3batch.actors.placement import freeze_start_up; "
            "freeze_start_up(); print(gc.get_freeze_count(), len(gc.get_objects()))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    frozen, tracked = map(int, out.stdout.split())
    assert frozen > 10_000 and tracked < 100
