"""Dispatch: rows to replicas within a bounded in-flight window, results back row by row.

Each replica that is up holds at most `window` rows. `pump()` tops every window up from the row
queue (`submit`) and keeps one `take_results` call outstanding per replica that has rows; each
answer frees the rows it returns, so the next `pump()` refills the replica at once: a slow row
holds its own slot only. A row's key is (file index, batch index, row index, attempt): a
result whose key is not in flight any more (an earlier attempt's, after a retry) is dropped.
Every answer names the replica process (an instance id, new at each restart): an answer from
another instance than the one holding the rows means the actor restarted and lost them. When a
replica fails (a call raises, it restarted, or a `take_results` is not answered within
`reply_timeout_s`), its in-flight rows go back to the front of the queue with attempt + 1,
or are finished with an error after `max_retries` retries charged to them; calls of its earlier
epochs are ignored. Whether a failure is charged is `health`'s verdict: rows lost with the
replica's node (drained, preempted, lost) go back uncharged; rows of a failure whose verdict
waits for the node table go back uncharged too, and are charged if the verdict is the
replica's own. A replica that finishes a row is making progress (`Health.progress`: its
failures are no longer in a row). A draining replica gets no new rows; its own still come back.
"""

import logging
import time
from collections import deque

import ray

from k3batch.driver.health import Failure, Health
from k3batch.driver.intake import GET_TIMEOUT_S
from k3batch.driver.prompts import RowWork
from k3batch.actors.result import error_row

log = logging.getLogger(__name__)

TAKE_MAX_WAIT_S = 0.5  # how long a take_results call waits on the replica for a first row


class Dispatcher:
    def __init__(self, replicas, health: Health, *, window: int, max_retries: int, report,
                 reply_timeout_s: float = 300.0, metrics=None):  # fmt: skip
        """metrics: the job's `k3batch.metrics.JobMetrics`, or None."""
        self.replicas, self.health, self.report = replicas, health, report
        self.metrics = metrics
        self.window, self.max_retries, self.reply_timeout_s = window, max_retries, reply_timeout_s
        self.queue: deque = deque()  # (file, batch, row, attempt), RowWork
        self.inflight: list[dict] = [{} for _ in replicas]  # (file, batch, row) -> attempt, work
        self.epoch = [0] * len(replicas)
        self.instance: list[str | None] = [None] * len(replicas)  # process holding the rows
        self.calls: dict = {}  # ref -> (replica, epoch, kind "submit" | "take", sent at)
        self.done: list = []  # ((file, batch, row), output row) finished, for the caller to take
        self.moved: dict = {}  # (file, batch, row) -> attempts not charged (node loss, pending)
        health.on_verdict = self._verdict

    def add(self, key: tuple[int, int], works: list[RowWork]) -> None:
        self.queue.extend(((*key, w.row_idx, 0), w) for w in works)

    def refs(self) -> list:
        return list(self.calls)

    def pump(self) -> None:
        """Top up every up replica's window; keep one take_results call per busy replica."""
        busy = {(r, e) for r, e, kind, _ in self.calls.values() if kind == "take"}
        up = set(self.health.up())
        for r in self.health.serving():  # a draining replica gets no rows; its own come back
            room = self.window - len(self.inflight[r])
            if r in up and room > 0 and self.queue:
                batch = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
                for (f, b, i, attempt), w in batch:
                    self.inflight[r][(f, b, i)] = (attempt, w)
                items = [(key, w.prompt_token_ids, w.sampling) for key, w in batch]
                self._call(r, "submit", self.replicas[r].submit.remote(items))
                peak = max(self.report.peak_inflight_rows, len(self.inflight[r]))
                self.report.peak_inflight_rows = peak
            if self.inflight[r] and (r, self.epoch[r]) not in busy:
                self._call(r, "take", self.replicas[r].take_results.remote(TAKE_MAX_WAIT_S))
        now = time.monotonic()
        for ref, (r, e, kind, sent) in list(self.calls.items()):
            if now - sent <= self.reply_timeout_s:
                continue
            del self.calls[ref]
            if e == self.epoch[r]:
                log.error("replica %d: no answer to %s in %.0f s; restarting it", r, kind,
                          self.reply_timeout_s)  # fmt: skip
                ray.kill(self.replicas[r], no_restart=False)  # a hung engine must not come back
                self._failed(r, TimeoutError(f"no answer to {kind} in {self.reply_timeout_s} s"))

    def take_done(self) -> list[tuple[tuple[int, int, int], dict]]:
        """((file, batch, row), output row) of the rows finished since the last call."""
        done, self.done = self.done, []
        return done

    def _call(self, r: int, kind: str, ref) -> None:
        self.calls[ref] = (r, self.epoch[r], kind, time.monotonic())

    def on_ready(self, ref) -> None:
        """Handle a finished call (its rows go to `take_done`)."""
        r, e, kind, _ = self.calls.pop(ref)
        try:
            answer = ray.get(ref, timeout=GET_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as err:
            if e == self.epoch[r]:
                self._failed(r, err)
            return
        instance, rows = (answer, []) if kind == "submit" else answer
        if e == self.epoch[r]:
            if self.instance[r] is None:
                self.instance[r] = instance
            elif instance != self.instance[r]:
                self._failed(r, RuntimeError("the replica restarted; its rows in flight are lost"))
                return
        done = len(self.done)
        for row in rows:
            f, b, i, attempt = row.pop("key")
            held = self.inflight[r].get((f, b, i))
            if held is not None and held[0] == attempt:  # else: a stale attempt's result
                del self.inflight[r][(f, b, i)]
                self.moved.pop((f, b, i), None)
                self.done.append(((f, b, i), row))
                if e == self.epoch[r]:
                    self.health.progress(r)
        if self.metrics is not None and len(self.done) > done:
            self.metrics.rows_done(r, len(self.done) - done)

    def _failed(self, r: int, err: Exception) -> None:
        """Replica r failed: its rows are retried, or failed for good after max_retries."""
        self.epoch[r] += 1
        self.instance[r] = None
        lost, self.inflight[r] = self.inflight[r], {}
        if lost:
            log.warning("replica %d failed (%s: %s); %d rows in flight",
                        r, type(err).__name__, err, len(lost))  # fmt: skip
        # the rows first: a crash loop (raised by `failed`) leaves none of them unaccounted
        retry = []
        for (f, b, i), (attempt, w) in sorted(lost.items()):
            retry.append(((f, b, i, attempt + 1), w))
        self.queue.extendleft(reversed(retry))
        self.report.rows_retried += len(retry)
        if self.metrics is not None:
            self.metrics.rows_retried(len(retry))
        failure = self.health.failed(r, err)
        failure.keys = [(f, b, i) for (f, b, i, _), _ in retry]
        if failure.verdict == "own":
            self._charge(failure)
        else:  # node loss, or not known yet: uncharged for now
            for key in failure.keys:
                self.moved[key] = self.moved.get(key, 0) + 1
            self.report.rows_moved += len(failure.keys)
            if failure.verdict == "node":
                self._count_move(failure)

    def _verdict(self, failure: Failure) -> None:
        """A waiting verdict came: node loss keeps its rows uncharged; the replica's own
        charges those still waiting to run."""
        if failure.verdict == "node":
            self._count_move(failure)
            return
        self.report.rows_moved -= len(failure.keys)
        for key in failure.keys:
            if key in self.moved:
                self.moved[key] -= 1
        self._charge(failure)

    def _count_move(self, failure: Failure) -> None:
        moves = self.report.replica_moves
        moves[failure.lost] = moves.get(failure.lost, 0) + 1

    def _charge(self, failure: Failure) -> None:
        """Rows of an own failure that are out of retries are finished with its error."""
        why = f"{failure.cause['type']}: {failure.cause['message']}".strip()
        queued = {(f, b, i): n for n, ((f, b, i, _), _) in enumerate(self.queue)}
        drop = []
        for key in failure.keys:
            n = queued.get(key)
            if n is None:
                continue  # running again elsewhere, or done: judged at its next failure
            (_, _, _, attempt), _ = self.queue[n]
            charged = attempt - self.moved.get(key, 0)
            if charged > self.max_retries:
                drop.append(n)
                self.moved.pop(key, None)
                msg = f"replica failed {charged} times while running this row; last: {why}"
                self.done.append((key, error_row(msg)))
        for n in sorted(drop, reverse=True):
            del self.queue[n]
        self.report.rows_retried -= len(drop)
