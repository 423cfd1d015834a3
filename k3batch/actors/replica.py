"""ReplicaActor: one model replica as a Ray actor, behind the interface the driver uses.

`await generate(items)` takes rows of work and returns one result dict per row, each carrying
the row's key. Calls may overlap: one engine thread steps continuously over the requests of all
calls in flight (continuous batching across calls). The single-device replica wraps `Engine`;
the disaggregated replica (pipeline prefill, TP/DCP decode) keeps the same interface. Rows with
bad values come back with an error; if the engine itself fails the process exits, so that Ray
restarts the actor and the driver retries its rows.
"""

import asyncio
import logging
import os
import queue
import threading
import time

from k3batch.engine.config import EngineConfig
from k3batch.engine.request import GenerationResult, SamplingParams

log = logging.getLogger(__name__)


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
        placement_group=None,
        decode_placement_group=None,
    ):
        from k3batch.actors.build import build_engine

        t0 = time.perf_counter()
        self.engine, self.tokenizer = build_engine(
            model_dir,
            engine_config,
            device=device,
            pp=pp,
            pp_layers=pp_layers,
            tp=tp,
            dcp=dcp,
            placement_group=placement_group,
            decode_placement_group=decode_placement_group,
        )
        self.load_s = time.perf_counter() - t0
        self.busy_s = 0.0
        self.rows = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next_id = 0
        threading.Thread(target=self._loop, daemon=True, name="engine").start()

    def ready(self) -> dict:
        return {"load_s": self.load_s, "pid": os.getpid()}

    def stats(self) -> dict:
        out = {"load_s": self.load_s, "busy_s": self.busy_s, "rows": self.rows}
        out["cache"] = self.engine.cache_stats()
        if hasattr(self.engine.runner, "bubble"):
            out["pipeline"] = self.engine.runner.bubble(reset=False)
        if self.engine.decode_runner is not None:
            out["decode_group"] = self.engine.decode_runner.stats()
        return out

    async def generate(self, items: list[tuple[object, list[int], SamplingParams]]) -> list[dict]:
        """items: (key, prompt token ids, sampling). Returns dicts with key, generated_text,
        output_token_ids, finish_reason, num_prompt_tokens, num_output_tokens, error, and
        output_logprobs / prompt_logprobs when the sampling asked for them."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put((items, loop, fut))
        return await fut

    # ---- engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        calls = {}  # call id -> [loop, future, remaining, rows]
        owner = {}  # request id -> (call id, key)
        try:
            while True:
                block = not self.engine.has_unfinished()
                while True:
                    try:
                        items, loop, fut = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    cid = id(fut)
                    calls[cid] = [loop, fut, len(items), []]
                    for key, ids, sp in items:
                        rid = str(self._next_id)
                        self._next_id += 1
                        owner[rid] = (cid, key)
                        self.engine.add_request(rid, ids, sp)
                    if not items:
                        loop.call_soon_threadsafe(fut.set_result, [])
                        del calls[cid]
                t0 = time.perf_counter()
                finished = self.engine.step()
                self.busy_s += time.perf_counter() - t0
                self.rows += len(finished)
                for res in finished:
                    cid, key = owner.pop(res.request_id)
                    call = calls[cid]
                    call[3].append(self._row(key, res))
                    call[2] -= 1
                    if call[2] == 0:
                        loop, fut, _, rows = calls.pop(cid)
                        loop.call_soon_threadsafe(fut.set_result, rows)
        except BaseException:  # the engine is broken: let Ray restart the actor
            log.exception("engine loop failed; exiting the replica process")
            os._exit(1)

    def _row(self, key, res: GenerationResult) -> dict:
        row = {
            "key": key,
            "generated_text": None if res.error else self.tokenizer.decode(res.output_token_ids),
            "output_token_ids": res.output_token_ids,
            "finish_reason": res.finish_reason,
            "num_prompt_tokens": len(res.prompt_token_ids),
            "num_output_tokens": len(res.output_token_ids),
            "error": res.error,
        }
        if res.output_logprobs is not None:
            row["output_logprobs"] = res.output_logprobs
        if res.prompt_logprobs is not None:
            row["prompt_logprobs"] = res.prompt_logprobs
        return row
