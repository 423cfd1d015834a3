"""FakeReplica: the replica interface (`ready`, `stats`, `submit`, `take_results`) with no model,
for driver tests and the driver benchmark.

A row "generates" its first `max_new_tokens` prompt tokens, reversed, and finishes
`token_s * max_new_tokens` seconds after it was submitted (rows run concurrently, as under
continuous batching), so `token_s = 0` is an instant replica and a per-row `max_new_tokens`
makes a slow row. `stats_delay_s` makes `stats` answer late (a hung replica).
"""

import asyncio
import os
import time
import uuid


class FakeReplica:
    def __init__(self, model_dir, engine_config, device, *, token_s: float = 0.0,
                 stats_delay_s: float = 0.0, **_):  # fmt: skip
        self.token_s, self.stats_delay_s = token_s, stats_delay_s
        self.pending: list = []  # (due at, row)
        self.rows = 0
        self.instance = uuid.uuid4().hex

    def ready(self) -> dict:
        return {"load_s": 0.0, "pid": os.getpid()}

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
