"""Slow rows do not stall the input (issue 11, defect 11): a replica hands back each row as it
finishes and takes new rows while others run. No Ray: the replica class runs in-process over a
stub engine whose rows take as many steps as they ask for output tokens.

Fails on the old code: `ReplicaActor.generate(items)` returned only when its whole call was done
(and there was no `submit`/`take_results`)."""

import asyncio
import collections
import threading
from types import SimpleNamespace

from k3batch.actors.replica import ReplicaActor
from k3batch.actors.serve import EngineServer
from k3batch.engine.request import GenerationResult, SamplingParams


class _StubEngine:
    """A request finishes after `max_new_tokens` steps; each step takes a few milliseconds."""

    runner = decode_runner = None  # no device
    config = SimpleNamespace(max_num_seqs=8)
    last_step_prefill, last_step_tokens, last_step_submit_s = False, 0, 0.0
    waiting = ()

    def __init__(self):
        self.live = {}  # request id -> [steps left, prompt]

    @property
    def running(self):
        return self.live

    def add_request(self, rid, ids, sp):
        self.live[rid] = [sp.max_new_tokens, ids]

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        threading.Event().wait(0.002)
        done = []
        for rid, entry in list(self.live.items()):
            entry[0] -= 1
            if entry[0] == 0:
                del self.live[rid]
                done.append(GenerationResult(rid, entry[1], [7], "length"))
        return done


class _StubTokenizer:
    def __init__(self):
        self.threads = set()  # where decode ran

    def decode(self, ids):
        self.threads.add(threading.current_thread().name)
        return "x" * len(ids)


def _replica() -> ReplicaActor:
    actor = ReplicaActor.__new__(ReplicaActor)  # no model: the engine is the stub
    actor.engine, actor.tokenizer = _StubEngine(), _StubTokenizer()
    actor.load_s, actor._outbox = 0.0, collections.deque()
    actor._wake = actor._wake_loop = None
    actor._wake_sent = False
    actor.failure, actor.node_id, actor.member_nodes = None, "n0", []
    actor.instance = "one"
    actor.server = EngineServer(actor.engine, actor._finished, actor._engine_failed)
    return actor


def test_replica_streams_rows_as_they_finish_and_takes_more_meanwhile():
    actor = _replica()
    slow, fast = SamplingParams(max_new_tokens=100_000), SamplingParams(max_new_tokens=2)
    actor.submit([("slow", [1, 2], slow)] + [(f"f{i}", [3], fast) for i in range(3)])

    async def take_until(n: int) -> list[dict]:
        rows = []
        for _ in range(200):
            rows += (await actor.take_results(0.05))[1]
            if len(rows) >= n:
                return rows
        raise AssertionError(f"only {len(rows)} of {n} rows came back")

    first = asyncio.run(take_until(3))
    assert sorted(r["key"] for r in first) == ["f0", "f1", "f2"]  # the slow row holds nobody
    actor.submit([("late", [4], fast)])  # refilled while the slow row still runs
    (late,) = asyncio.run(take_until(1))
    assert late["key"] == "late" and late["output_token_ids"] == [7]
    assert len(actor.engine.live) == 1  # the slow row is still running


def test_rows_are_made_by_the_caller_not_the_engine_thread():
    """Decoding a row's text is per-row host work: on the engine thread it ran between two steps
    while the device waited (a whole batch's rows at once when a wave of requests ends)."""
    actor = _replica()
    sp = SamplingParams(max_new_tokens=3)
    actor.submit([(f"r{i}", [i], sp) for i in range(50)])  # all finish at the same step

    async def take() -> list[dict]:
        rows = []
        while len(rows) < 50:
            rows += (await actor.take_results(5.0))[1]
        return rows

    rows = asyncio.run(take())
    assert sorted(r["key"] for r in rows) == sorted(f"r{i}" for i in range(50))
    assert all(r["generated_text"] == "x" for r in rows)
    assert actor.tokenizer.threads and "engine" not in actor.tokenizer.threads
    assert not actor._wake_sent  # the burst's one wake has run
