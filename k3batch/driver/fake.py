"""Replicas for driver tests and the driver benchmark: `FakeReplica`, the replica interface
(`ready`, `stats`, `submit`, `take_results`) with no model, and `FaultyReplica`, the real replica
with one planted fault.

A row "generates" its first `max_new_tokens` prompt tokens, reversed, and finishes
`token_s * max_new_tokens` seconds after it was submitted (rows run concurrently, as under
continuous batching), so `token_s = 0` is an instant replica and a per-row `max_new_tokens`
makes a slow row; a row asking for log-probabilities gets -1.0 per output token.
`stats_delay_s` makes `stats` answer late (a hung replica).
"""

import asyncio
import itertools
import os
import time
import uuid

import ray

from k3batch.actors.replica import ReplicaActor


class FakeReplica:
    def __init__(self, model_dir, engine_config, device, *, token_s: float = 0.0,
                 stats_delay_s: float = 0.0, **_):  # fmt: skip
        self.token_s, self.stats_delay_s = token_s, stats_delay_s
        self.pending: list = []  # (due at, row)
        self.rows = 0
        self.instance = uuid.uuid4().hex

    def ready(self) -> dict:
        return {"load_s": 0.0, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}  # fmt: skip

    async def stats(self) -> dict:
        await asyncio.sleep(self.stats_delay_s)  # > the driver's timeout: a replica that hangs
        return {"load_s": 0.0, "busy_s": 0.0, "rows": self.rows}

    def submit(self, items) -> str:
        now = time.monotonic()
        for key, ids, sp in items:
            out = list(reversed(ids[: sp.max_new_tokens]))
            row = {
                "key": key,
                "generated_text": None,
                "output_token_ids": out,
                "finish_reason": "length",
                "num_prompt_tokens": len(ids),
                "num_output_tokens": len(out),
                "error": None,
            }
            if sp.logprobs:
                row["output_logprobs"] = [-1.0] * len(out)
            self.pending.append((now + self.token_s * sp.max_new_tokens, row))
        return self.instance

    async def take_results(self, max_wait_s: float = 1.0) -> tuple[str, list[dict]]:
        deadline = time.monotonic() + max_wait_s
        while True:
            now = time.monotonic()
            done = [row for due, row in self.pending if due <= now]
            if done or now >= deadline:
                self.pending = [(due, row) for due, row in self.pending if due > now]
                self.rows += len(done)
                return self.instance, done
            await asyncio.sleep(min(0.005, max(deadline - now, 0)))


class FaultyReplica(ReplicaActor):
    """The real replica with one planted fault. fault: "build" (the constructor raises),
    "forward" (every engine step raises, as a CUDA error would), "exit" (the process exits at
    its `at_step`-th engine step, every time it starts), "exit_once" (the same, only in the first
    process: the file `marker` records that it happened)."""

    def __init__(self, *args, fault: str, at_step: int = 1, marker: str | None = None, **kw):
        if fault == "build":
            raise RuntimeError("planted: this replica cannot be built")
        super().__init__(*args, **kw)
        step, steps = self.engine.step, itertools.count(1)

        def faulty_step():
            n = next(steps)
            if fault == "forward":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (planted)")
            if fault in ("exit", "exit_once") and n == at_step:
                if fault == "exit" or not os.path.exists(marker):
                    if marker:
                        open(marker, "w").close()
                    os._exit(1)
            return step()

        self.engine.step = faulty_step
