"""EngineServer: one engine stepped continuously by its own thread, fed rows from any thread.

`submit(items)` queues (key, prompt token ids, sampling) triples and returns at once; the
thread adds them to the engine between steps and steps while anything is unfinished
(continuous batching over everything submitted, whoever submitted it), calling
`on_finished(key, result)` for each finished request and `on_step(prefill, seconds)` (optional)
after each step (`Engine.last_step_prefill`). If the engine raises, the thread
calls `on_failure(exception)` once and stops. Used by the job's replica actor (`replica.py`) and by
the Ray Data replica (`k3batch.data`); what a caller does with results and failures is its own.
"""

import queue
import threading
import time


class EngineServer:
    def __init__(self, engine, on_finished, on_failure, on_step=None):
        self.engine = engine
        self._on_step = on_step
        self.busy_s = 0.0  # time inside engine steps
        self.rows = 0  # requests finished
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
        try:
            while True:
                block = not self.engine.has_unfinished()
                while True:
                    try:
                        items = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    for key, ids, sampling in items:
                        rid = str(self._next_id)
                        self._next_id += 1
                        owner[rid] = key
                        self.engine.add_request(rid, ids, sampling)
                if not self.engine.has_unfinished():
                    continue
                t0 = time.perf_counter()
                finished = self.engine.step()
                dt = time.perf_counter() - t0
                self.busy_s += dt
                if self._on_step is not None:
                    self._on_step(self.engine.last_step_prefill, dt)
                self.rows += len(finished)
                for res in finished:
                    self._on_finished(owner.pop(res.request_id), res)
        except BaseException as e:
            self._on_failure(e)
