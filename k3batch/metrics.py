"""The job's Prometheus metrics: every name, label and meaning in one place.

They go through Ray's metrics (`ray.util.metrics`): each process records its own, and the
metrics agent of every Ray node serves them to Prometheus on the node's metrics export port
(`ray.nodes()[i]["MetricsExportPort"]`; KubeRay's pods carry the scrape annotations,
`cluster/`). Ray prefixes the names with `ray_` and counters end in `_total`: the driver's
`k3batch_rows_committed` is scraped as `ray_k3batch_rows_committed_total`. Every metric has
the label `job` (the job's name); the replica's also `replica` (its slot). `cluster/
grafana_k3batch.json` is a dashboard built on these names.

Driver (`JobMetrics`, updated on the driver's loop, never waited on by a replica):
- k3batch_rows_committed: rows written to the output (the report's rows_written);
- k3batch_rows_failed{reason}: committed rows with an error, by reason: "input" (the row
  itself: no prompt, too long, bad sampling values, unreadable messages), "duplicate_id",
  "request" (the engine failed that request), "replica" (its replica failed `max_retries`
  times while running it);
- k3batch_rows_done{replica}: rows a replica finished and returned;
- k3batch_rows_retried: rows sent again after their replica failed;
- k3batch_prompt_tokens, k3batch_output_tokens: tokens of committed rows;
- k3batch_units_open: units of rows held by the driver (read, not yet committed);
- k3batch_replicas{state}: replicas in each state (up, down, rebuild, moved, pending,
  draining, dead, released: `driver.health`);
- k3batch_replica_failures{replica, verdict}: failures of a replica ("own", "node": judged
  from facts, `driver.health`; "unknown" while the verdict waits), each one a restart or move.

Replica (`ReplicaMetrics`, recorded in the replica's process; the engine's step only queues its
time, and a sampling thread observes those and reads the rest once a second: a Ray metric call
costs 5-30 us, which the step never waits on):
- k3batch_step_seconds{kind}: engine step time, kind "prefill" (a step that ran prompt
  chunks) or "decode";
- k3batch_requests_running, k3batch_requests_waiting: requests in the engine;
- k3batch_arena_bytes{kind}: the memory pool's bytes in use, "kda" (fixed KDA state blocks)
  and "mla" (MLA latent pages), summed over the replica's devices;
- k3batch_prefix_cache_hits, k3batch_prefill_tokens_saved: prompts that hit the prefix cache and
  the prompt tokens it spared;
- k3batch_handoff_bytes, k3batch_handoff_seconds: what prefill handed to the decode group
  (disaggregated replicas; bytes received summed over ranks, seconds of the slowest rank).
"""

import collections
import threading
import time

from ray.util.metrics import Counter, Gauge, Histogram

STATES = ("pending", "up", "down", "rebuild", "moved", "draining", "dead", "released")
STEP_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
SAMPLE_EVERY_S = 1.0


def failure_reason(row: dict) -> str:
    """Why a committed row has an error (see k3batch_rows_failed)."""
    error = row["error"]
    if error.startswith("replica failed"):
        return "replica"
    if error.startswith("duplicate id"):
        return "duplicate_id"
    return "request" if row.get("num_prompt_tokens") is not None else "input"


class JobMetrics:
    """The driver's metrics of job `job`."""

    def __init__(self, job: str):
        self.tags = {"job": job}
        job_only = ("job",)
        self.committed = Counter("k3batch_rows_committed", "rows written to the output", job_only)
        self.failed = Counter("k3batch_rows_failed", "committed rows with an error, by reason",
                              ("job", "reason"))  # fmt: skip
        self.done = Counter("k3batch_rows_done", "rows finished by a replica", ("job", "replica"))
        self.retried = Counter("k3batch_rows_retried", "rows sent again after a failure", job_only)
        self.prompt_tokens = Counter("k3batch_prompt_tokens", "prompt tokens of committed rows",
                                     job_only)  # fmt: skip
        self.output_tokens = Counter("k3batch_output_tokens", "output tokens of committed rows",
                                     job_only)  # fmt: skip
        self.units_open = Gauge("k3batch_units_open", "units held by the driver", job_only)
        self.replicas = Gauge("k3batch_replicas", "replicas in each state", ("job", "state"))
        self.failures = Counter("k3batch_replica_failures", "replica failures, by verdict",
                                ("job", "replica", "verdict"))  # fmt: skip
        self.gauges_at = 0.0  # when `loop` last set the gauges

    def commit(self, results: list[dict]) -> None:
        """A unit's rows were written."""
        self.committed.inc(len(results), self.tags)
        for row in results:
            if row["error"] is not None:
                self.failed.inc(1, self.tags | {"reason": failure_reason(row)})
        prompt = sum(r.get("num_prompt_tokens") or 0 for r in results)
        output = sum(r.get("num_output_tokens") or 0 for r in results)
        if prompt:
            self.prompt_tokens.inc(prompt, self.tags)
        if output:
            self.output_tokens.inc(output, self.tags)

    def rows_done(self, replica: int, n: int) -> None:
        self.done.inc(n, self.tags | {"replica": str(replica)})

    def rows_retried(self, n: int) -> None:
        if n:
            self.retried.inc(n, self.tags)

    def failure(self, replica: int, verdict: str) -> None:
        self.failures.inc(1, self.tags | {"replica": str(replica), "verdict": verdict})

    def loop(self, units_open: int, states: list[str]) -> None:
        """Each turn of the driver's loop: the gauges, set at most every SAMPLE_EVERY_S (a Ray
        metric call costs microseconds; a busy loop turns far more often)."""
        now = time.monotonic()
        if now - self.gauges_at < SAMPLE_EVERY_S:
            return
        self.gauges_at = now
        self.units_open.set(units_open, self.tags)
        for state in STATES:
            self.replicas.set(states.count(state), self.tags | {"state": state})


class ReplicaMetrics:
    """The metrics of one replica's engine, recorded in the replica's process: `step` from the
    engine thread, the rest by a daemon thread reading the engine every SAMPLE_EVERY_S."""

    def __init__(self, engine, *, job: str, replica: str):
        self.engine, self.tags = engine, {"job": job, "replica": replica}
        tag_keys = ("job", "replica")
        self.step_s = Histogram("k3batch_step_seconds", "engine step time", STEP_BUCKETS_S,
                                tag_keys + ("kind",))  # fmt: skip
        self.running = Gauge("k3batch_requests_running", "requests in the engine", tag_keys)
        self.waiting = Gauge("k3batch_requests_waiting", "requests not admitted yet", tag_keys)
        self.arena = Gauge("k3batch_arena_bytes", "memory pool bytes in use",
                           tag_keys + ("kind",))  # fmt: skip
        self.hits = Counter("k3batch_prefix_cache_hits", "prompts that hit the prefix cache",
                            tag_keys)  # fmt: skip
        self.saved = Counter("k3batch_prefill_tokens_saved", "prompt tokens the cache spared",
                             tag_keys)  # fmt: skip
        self.handoff_bytes = Counter("k3batch_handoff_bytes", "bytes handed to decode ranks",
                                     tag_keys)  # fmt: skip
        self.handoff_s = Counter("k3batch_handoff_seconds", "handoff time (slowest rank)",
                                 tag_keys)  # fmt: skip
        self.seen = {"hits": 0, "saved": 0, "bytes": 0, "seconds": 0.0}
        self.steps: collections.deque = collections.deque()  # (prefill, seconds) to observe
        self.kinds = {True: self.tags | {"kind": "prefill"}, False: self.tags | {"kind": "decode"}}
        threading.Thread(target=self._sample_forever, daemon=True, name="metrics").start()

    def step(self, prefill: bool, seconds: float) -> None:
        """One engine step (the engine thread): queued, observed by the sampling thread."""
        self.steps.append((prefill, seconds))

    def _sample_forever(self) -> None:
        while True:
            time.sleep(SAMPLE_EVERY_S)
            try:
                self.sample()
            except Exception:  # the engine changed under the read: the next sample will do
                continue

    def sample(self) -> None:
        while self.steps:
            prefill, seconds = self.steps.popleft()
            self.step_s.observe(seconds, self.kinds[prefill])
        e = self.engine
        self.running.set(len(e.running), self.tags)
        self.waiting.set(len(e.waiting), self.tags)
        pools = [p for p in (e.pool, e.decode_pool) if p is not None]
        kda = sum(len(p.arena.blocks) * s.block_bytes for p in pools for s in p.arena.specs)
        mla = sum(len(p.arena.pages) * s.page_bytes for p in pools for s in p.arena.specs)
        self.arena.set(kda, self.tags | {"kind": "kda"})
        self.arena.set(mla, self.tags | {"kind": "mla"})
        self._add(self.hits, "hits", e.pool.stats.prefix_hits)
        self._add(self.saved, "saved", e.pool.stats.prefix_hit_tokens)
        if e.decode_runner is not None:
            group = e.decode_runner.stats()
            self._add(self.handoff_bytes, "bytes", sum(group["handoff_bytes_per_rank"]))
            self._add(self.handoff_s, "seconds", max(group["handoff_s_per_rank"]))

    def _add(self, counter: Counter, key: str, total: float) -> None:
        """Counters from the engine's running totals: add what is new since the last sample."""
        if total > self.seen[key]:
            counter.inc(total - self.seen[key], self.tags)
            self.seen[key] = total
