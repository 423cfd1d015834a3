"""ReplicaActor: one model replica as a Ray actor, behind the interface the driver uses.

`submit(items)` hands rows of work to the replica and returns at once; `await take_results(
max_wait_s)` returns the rows finished since the last call (one result dict per row, each
carrying the row's key), waiting up to `max_wait_s` for at least one. One engine thread steps
continuously over every submitted row (continuous batching), so a long row never holds back the
others, and the driver refills the replica as rows come back (a bounded in-flight window). The
replica keeps no state the driver needs: a restarted actor starts empty and the driver resubmits
the rows it had in flight. The single-device replica wraps `Engine`; the disaggregated replica
(pipeline prefill, a decode group) keeps the same interface. Rows with bad values come back with
an error. The engine thread only queues each finished request (one wake of the caller per
burst); `take_results` makes the rows (the text decoded), off the steps' critical path: up to
max_num_seqs requests finish in one step, and their decoding there kept the device waiting.
`stats()` carries the engine thread's account (`serve.StepAccount`).

Failures (`actors.failure`): a replica that cannot be built raises from its constructor (Ray
ends the actor with that error and its traceback; the driver builds a new one or, after
`replicas.max_consecutive_failures` in a row, stops the job with the cause). If the engine
fails, or a prefill stage or decode rank dies, the replica keeps its process and raises
`ReplicaFailed` (the cause, the nodes of its members) from every call after that; the driver
restarts the process (`ray.kill(no_restart=False)`), which rebuilds every stage and rank in the
replica's placement group, and resubmits the rows. A hard crash (a signal, the OOM killer)
prints its Python stack to the actor's log (`faulthandler`).

Health (disaggregated replicas): the replica owns its prefill stage and decode rank actors, so
they die with it. A member that dies fails the replica: the engine's next wait on it raises at
once, and a watchdog thread pings every member each `WATCH_INTERVAL_S` so that a death is
noticed within seconds even while the replica is idle. A rebuild that fails (resources that
never come, a member dying while loading) raises after `placement.SPAWN_TIMEOUT_S` at most:
nothing waits without a bound.
"""

import asyncio
import collections
import faulthandler
import logging
import os
import threading
import time
import uuid

import ray

from k3batch.actors.failure import ReplicaFailed, describe
from k3batch.actors.placement import CALL_TIMEOUT_S, freeze_start_up, get_within
from k3batch.actors.serve import EngineServer
from k3batch.engine.config import EngineConfig
from k3batch.engine.request import GenerationResult, SamplingParams
from k3batch.actors.result import result_row

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0  # how often the watchdog pings each prefill stage and decode rank


class ReplicaActor:
    def __init__(
        self,
        model_dir: str,
        engine_config: EngineConfig,
        device: str,
        *,
        pp: int = 1,
        pp_layers=None,
        tp: int = 1,
        dcp: int = 1,
        disaggregate: bool = False,
        placement_group=None,
        metrics: dict | None = None,
    ):
        """metrics: {"job", "replica"}: record the engine's metrics under these labels
        (`k3batch.metrics`); None: none."""
        faulthandler.enable()  # a hard crash prints the Python stack of every thread
        t0 = time.perf_counter()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.failure: ReplicaFailed | None = None  # set once, by whatever fails first
        # (key, GenerationResult) finished, engine thread -> caller, which makes their rows
        self._outbox: collections.deque = collections.deque()
        self._wake = self._wake_loop = None  # take_results' event, set by the engine thread
        self._wake_sent = False  # a wake is scheduled on the caller's loop and has not run yet
        # An error here ends the actor with its traceback (Ray does not restart an actor whose
        # constructor raised): the driver sees the cause and builds a new one, or stops the job.
        self.engine, self.tokenizer = self._build(
            model_dir,
            engine_config,
            device=device,
            pp=pp,
            pp_layers=pp_layers,
            tp=tp,
            dcp=dcp,
            disaggregate=disaggregate,
            placement_group=placement_group,
        )
        self.load_s = time.perf_counter() - t0
        members = self._members(self.engine)
        self.member_nodes = []  # where the stages and ranks run: a failure's nodes
        if members:
            answers = get_within([m.ping.remote() for _, m in members], CALL_TIMEOUT_S,
                                 [label for label, _ in members])  # fmt: skip
            self.member_nodes = [a["node_id"] for a in answers]
            threading.Thread(
                target=self._watch, args=(members,), daemon=True, name="watchdog"
            ).start()
        self.instance = uuid.uuid4().hex  # new at every (re)start of the actor
        on_step = None
        if metrics:
            from k3batch.metrics import ReplicaMetrics

            on_step = ReplicaMetrics(self.engine, **metrics).step
        freeze_start_up()
        self.server = EngineServer(self.engine, self._finished, self._engine_failed, on_step)

    @staticmethod
    def _build(model_dir: str, engine_config: EngineConfig, **kw):
        """(engine, tokenizer) of this replica (`actors.build.build_engine`; the benchmark's
        replica on a simulated device builds another)."""
        from k3batch.actors.build import build_engine

        return build_engine(model_dir, engine_config, **kw)

    # ---- failure ----------------------------------------------------------------------------
    def _fail(self, where: str, error: BaseException) -> None:
        """Record the replica's first failure (any thread): every call raises it from now on."""
        if self.failure is not None:
            return
        log.error("%s failed; the replica stops serving until the driver restarts it", where,
                  exc_info=error)  # fmt: skip
        self.failure = ReplicaFailed(describe(error) | {"where": where},
                                     [self.node_id, *self.member_nodes])  # fmt: skip
        self._wake_caller()

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ---- construction and health (the members of a disaggregated replica) -------------------
    @staticmethod
    def _members(engine) -> list[tuple[str, object]]:
        out = []
        for runner in (engine.runner, engine.decode_runner):
            if hasattr(runner, "members"):
                out += runner.members()
        return out

    def _watch(self, members: list[tuple[str, object]]) -> None:
        """One ping in flight per member; a member that died (its ping raises) fails the
        replica. A ping that waits is a busy member: the engine's bounded waits catch one that
        hangs."""
        pings = {m.ping.remote(): (label, m) for label, m in members}
        while self.failure is None:
            ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=WATCH_INTERVAL_S)
            for ref in ready:
                label, m = pings.pop(ref)
                try:
                    ray.get(ref)
                except BaseException as e:
                    self._fail(label, e)
                    return
                pings[m.ping.remote()] = (label, m)
            if ready:
                time.sleep(WATCH_INTERVAL_S)

    def members(self) -> list[dict]:
        """Every prefill stage and decode rank, then this coordinator: role, rank, pid and node
        id of each (tests and operators use it to find a process)."""
        members = self._members(self.engine)
        labels = [label for label, _ in members]
        return get_within([m.ping.remote() for _, m in members], CALL_TIMEOUT_S, labels) + [
            {"role": "replica", "rank": 0, "pid": os.getpid(),
             "node_id": ray.get_runtime_context().get_node_id()}  # fmt: skip
        ]

    def ready(self) -> dict:
        """Load time, pid and node id; raises `ReplicaFailed` once the replica failed."""
        self._check()
        return {"load_s": self.load_s, "pid": os.getpid(), "node_id": self.node_id}

    def stats(self) -> dict:
        out = {"load_s": self.load_s, "busy_s": self.server.busy_s, "rows": self.server.rows}
        out["engine"] = self.server.account.to_dict()
        out["cache"] = self.engine.cache_stats()
        out["sizing"] = self.engine.sizing()
        if hasattr(self.engine.runner, "bubble"):
            out["pipeline"] = self.engine.runner.bubble(reset=False)
        if self.engine.decode_runner is not None:
            out["decode_group"] = self.engine.decode_runner.stats()
        return out

    def submit(self, items: list[tuple[object, list[int], SamplingParams]]) -> str:
        """items: (key, prompt token ids, sampling). Queues them for the engine thread and
        returns this process's instance id; their results come back through `take_results`.
        Raises `ReplicaFailed` once the replica failed."""
        self._check()
        self.server.submit(items)
        return self.instance

    async def take_results(self, max_wait_s: float = 1.0) -> tuple[str, list[dict]]:
        """(instance id, the rows finished since the last call), waiting up to `max_wait_s`
        for at least one row: dicts with key, generated_text, output_token_ids, finish_reason,
        num_prompt_tokens, num_output_tokens, error, and output_logprobs / prompt_logprobs and
        prompt_greedy when asked for. A new instance id means the actor restarted: rows
        submitted to an earlier instance are lost, and the caller resubmits them. Raises
        `ReplicaFailed` once the replica failed (rows in it are lost: the caller resubmits them
        elsewhere)."""
        self._check()
        if self._wake_loop is not asyncio.get_running_loop():
            self._wake, self._wake_loop = asyncio.Event(), asyncio.get_running_loop()
            self._wake_sent = False  # a wake sent to an earlier loop may never run
        self._wake.clear()  # before looking: a row appended after the look sets it again
        if not self._outbox:
            try:
                await asyncio.wait_for(self._wake.wait(), max_wait_s)
            except asyncio.TimeoutError:
                pass
        self._check()
        out = []
        try:  # the rows are made here: decoding text is no work for the engine thread
            while self._outbox:
                key, res = self._outbox.popleft()
                out.append({"key": key} | result_row(res, self.tokenizer))
        except Exception as e:  # as when the engine thread made them: the replica fails
            self._fail("results", e)
            raise self.failure from e
        return self.instance, out

    # ---- called on the engine thread (`serve.EngineServer`) -------------------------------
    def _finished(self, key, res: GenerationResult) -> None:
        self._outbox.append((key, res))
        if not self._wake_sent:  # one wake per burst: a step finishes up to max_num_seqs rows
            self._wake_caller()

    def _engine_failed(self, error: BaseException) -> None:
        self._fail("engine", error)

    def _wake_caller(self) -> None:
        loop, wake = self._wake_loop, self._wake
        if loop is not None:
            self._wake_sent = True
            try:
                loop.call_soon_threadsafe(self._woken, wake)
            except RuntimeError:  # that loop is closed; the next take_results makes a new one
                self._wake_sent = False

    def _woken(self, wake: asyncio.Event) -> None:
        """On the caller's loop. The flag drops before the event is set: a row appended while
        the flag still stood is in the outbox before take_results can wake and drain it."""
        self._wake_sent = False
        wake.set()
