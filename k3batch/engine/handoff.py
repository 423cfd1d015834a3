"""The disaggregated engine's handoff: prefilled requests move to the decode group in two
halves, so that neither side waits for the other.

Export: the request gets its decode memory, every prefill stage is asked to send its layers
(`runner.export_request`), and its prefill block and pages are freed at once (a stage copies
the request into its send buffers when the export runs, before any later forward or move that
could reuse them). The export runs on each stage after the prefill batches already queued there
(up to `depth` of them), so the request stays in HANDOFF, in `Handoff.exports`. Import: once
every stage has run it (`runner.exported`, checked without waiting), the decode group receives
it (`decode_runner.import_request`) and it decodes from the next step. Imports go in export
order: a stage's sends to one rank match the rank's receives in the order posted. Importing at
once instead had each rank block in the import until the stages reached the export, and every
decode step queued behind it (in a K3 PP16 -> TP16/DCP16 simulation, up to 11 s per handoff).

No deadlock: stage s's isend to a rank stays unmatched until the rank posts its irecv, which it
does only for an import, after every stage's export of that request has run, as when the import
was queued at once (the rank then waited for all the manifests before posting any irecv); the
stages never wait for a handoff send to complete before their next call, and a rank's import
waits only for manifests that exist.
Failures: a stage that died counts as `exported` (its manifest is an error), the ranks' import
fails and marks them broken, so the next decode step raises; a hung one leaves the export
pending until the engine has nothing else to do and `wait_exported` times out. Either way the
replica goes down with its requests, as before. A request leaves `exports` only by its import
(the engine's `_drop` checks it), so it stays running and the engine has work until it decodes.
"""

from collections import deque
from typing import NamedTuple

from k3batch.engine.request import Phase, Request


class _Export(NamedTuple):
    """A request whose export is queued on the prefill stages, not yet imported."""

    req: Request
    sent: object  # what `runner.export_request` returned
    after: int  # prefill batches submitted before it (the stages run it after those)


class Handoff:
    """The handoff state of an `Engine` (`engine.handoff`), which it reads and acts on: its
    running requests, both memory accounts and both runners. Empty on an engine without a
    decode group."""

    def __init__(self, engine):
        self.engine = engine
        self.exports: deque[_Export] = deque()  # exports in flight, oldest first
        self.num_prefills = 0  # prefill batches submitted so far (the engine counts them)

    def exporting(self, req: Request) -> bool:
        return any(e.req is req for e in self.exports)

    def num_decoding(self) -> int:
        """Requests that hold decode memory: decoding, or with an import pending."""
        return sum(r.phase is Phase.DECODE for r in self.engine.running) + len(self.exports)

    def move(self) -> None:
        """Export prefilled requests, in order, while they fit in the decode group (its arena,
        and max_num_seqs requests decoding or with an import pending: its batch bound), then
        import those that every stage has run."""
        e = self.engine
        decoding = self.num_decoding()
        exporting = {x.req for x in self.exports}
        for req in [r for r in e.running if r.phase is Phase.HANDOFF and r not in exporting]:
            if decoding >= e.config.max_num_seqs:
                break
            rid = req.request_id
            if e.decode_pool.admit(rid, [], req.num_computed + 1) is None:
                if e.decode_pool.num_requests > 1:
                    break  # wait for room
                n = req.num_computed + 1  # only the scratch is there: it can never fit
                e._abort(req, f"request of {n} tokens does not fit in the decode group's pool")
                continue
            e.runner.apply(e.pool.drain())
            sent = e.runner.export_request(
                e.pool.block_of(rid), e.pool.pages_of(rid), req.num_computed
            )
            e.pool.release(rid)
            self.exports.append(_Export(req, sent, self.num_prefills))
            decoding += 1
        self.import_ready()

    def import_ready(self, flush: bool = False) -> None:
        """Import the exports that every stage has run, oldest first (all of them, waiting
        for each: `flush`), each into its decode block and pages as they are now (moves
        queued before it are applied first)."""
        e = self.engine
        while self.exports:
            if flush:
                e.runner.wait_exported(self.exports[0].sent)
            elif not e.runner.exported(self.exports[0].sent):
                return
            req, sent, _ = self.exports.popleft()
            rid = req.request_id
            e.decode_runner.apply(e.decode_pool.drain())
            e.decode_runner.import_request(
                e.decode_pool.block_of(rid), e.decode_pool.pages_of(rid), sent
            )
            req.phase = Phase.DECODE

    def wait(self) -> None:
        """With no decode step to run: block on what the pipeline finishes first, its oldest
        prefill batch or its oldest export. A stage runs its calls in the order issued, so
        that is the one issued first (`done`: the prefill batches taken, oldest first)."""
        e = self.engine
        done = self.num_prefills - len(e._prefilling)
        if self.exports and self.exports[0].after <= done:
            e.runner.wait_exported(self.exports[0].sent)
        else:
            e._finish_prefills([e._prefilling.popleft()])
