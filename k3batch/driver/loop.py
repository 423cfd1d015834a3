"""The driver's event loop: intake, dispatch, replicas and commit joined by one bounded wait.

Each turn: open units while their unfinished rows fall short of `rows_wanted` and fewer than
`max_open` are open (intake), top up the replicas (dispatch), let the pool add placed replicas,
drain the ones the tail no longer needs and probe those that are down (replicas), then wait at
most `WAIT_S` for any call or task to finish and hand each to its owner; a unit whose rows are
all finished is committed. The loop ends when the input is exhausted and no unit is open.

Rows, not units, decide when the next unit opens: `rows_wanted` fills every replica's window
and holds one unit more (the next refill, tokenized before the queue runs dry). A unit commits
only once its last row is done, so a few long rows keep units open whose other rows are
finished; counting units instead starved the replicas then (long-tail output lengths: the
engine ran below max_num_seqs with none waiting while the input still had rows). `max_open`
bounds driver memory all the same: such units wait beyond it.
"""

import ray

from k3batch.driver.commit import Committer
from k3batch.driver.dispatch import Dispatcher
from k3batch.driver.intake import Intake, OpenUnit
from k3batch.driver.replicas import ReplicaPool

WAIT_S = 1.0


class Loop:
    def __init__(self, intake: Intake, dispatch: Dispatcher, pool: ReplicaPool, commit: Committer,
                 *, rows_wanted: int, max_open: int, progress, report,
                 metrics=None):  # fmt: skip
        """rows_wanted: unfinished rows to hold in open units; max_open: units open at most;
        metrics: the job's `k3batch.metrics.JobMetrics`, or None."""
        self.intake, self.dispatch, self.pool, self.commit = intake, dispatch, pool, commit
        self.rows_wanted, self.max_open = rows_wanted, max_open
        self.progress, self.report = progress, report
        self.metrics = metrics
        self.open: dict[tuple[int, int], OpenUnit] = {}

    def run(self) -> None:
        while True:
            self.fill()
            self.dispatch.pump()
            self._finish(self.dispatch.take_done())
            if self.intake.exhausted and not self.open:
                break
            tail = self.intake.exhausted and not self.intake.tok_refs  # every row is known
            self.pool.step(self.dispatch, tail)
            refs = [*self.intake.tok_refs, *self.dispatch.refs(), *self.pool.refs()]
            ready, _ = ray.wait(refs, num_returns=1, timeout=WAIT_S) if refs else ([], [])
            if ready:  # and whatever else is ready by now
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                if ref in self.intake.tok_refs:
                    state = self.open[self.intake.tok_refs[ref]]
                    self.dispatch.add(state.key, self.intake.on_tokenized(ref, state))
                    self._maybe_commit(state)
                elif self.pool.owns(ref):
                    self.pool.on_ready(ref)
                else:
                    self.dispatch.on_ready(ref)
            self._finish(self.dispatch.take_done())
            self.report.replica_failures = self.pool.health.failures
            self.progress.update(self._done_rows(), self.report.output_tokens)
            if self.metrics is not None:
                self.metrics.loop(len(self.open), self.pool.health.state)
        self.progress.update(self._done_rows(), self.report.output_tokens, final=True)

    def fill(self) -> None:
        """Open units (their tokenize tasks started) while their unfinished rows (queued, in
        flight or still tokenizing) are fewer than `rows_wanted` and fewer than `max_open`
        units are open."""
        while (not self.intake.exhausted and len(self.open) < self.max_open
               and sum(u.remaining for u in self.open.values()) < self.rows_wanted):  # fmt: skip
            state = self.intake.open_next()
            if state is not None:
                self.open[state.key] = state
                self.report.peak_open_units = max(self.report.peak_open_units, len(self.open))
                self._maybe_commit(state)  # every row failed at intake (ids)

    def _finish(self, done) -> None:
        touched = {}
        for (f, b, i), row in done:
            state = self.open[(f, b)]
            state.finish(i, row)
            touched[(f, b)] = state
        for state in touched.values():
            self._maybe_commit(state)

    def _maybe_commit(self, state: OpenUnit) -> None:
        if state.key in self.intake.tok_refs.values():
            return  # still tokenizing: rows not known yet
        if self.commit.maybe_commit(state):
            del self.open[state.key]
            if self.metrics is not None:
                self.metrics.commit(state.results)

    def _done_rows(self) -> int:
        return self.report.rows_skipped_resumed + self.report.rows_written
