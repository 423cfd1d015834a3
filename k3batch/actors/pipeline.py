"""PipelineRunner: a chunked pipeline-parallel prefill (and decode, in a replica without a decode
group) over P PrefillStageActors, behind the engine's runner protocol (`engine/runner.py`).

`submit` sends one batch to every stage (stage 0 gets the token ids) and returns immediately;
up to P batches are in flight, so all stages work at once. `export_request` queues a finished
request's handoff to the decode group on every stage, behind its batches; `exported` says
whether all have run it (then the decode ranks can receive it without waiting). `bubble()`
turns the stages' compute intervals into busy fractions and the pipeline bubble.

Every wait is bounded (`placement.get_within`): a dead stage raises at once in `wait`, a hung
one raises TimeoutError after `call_timeout_s`; the replica then goes down and is rebuilt.
"""

import ray

from k3batch.actors.placement import (
    CALL_TIMEOUT_S,
    batch_meta,
    get_within,
    shutdown_actors,
)
from k3batch.model.config import K3Config
from k3batch.model.forward_batch import ForwardBatch


class PipelineRunner:
    def __init__(self, stages: list, *, config: K3Config, layer_ranges: list[tuple[int, int]],
                 num_decode_ranks: int = 0):  # fmt: skip
        """stages: the stage actors, joined in the replica's group (`world.spawn_runners`);
        num_decode_ranks: the ranks of the decode group they hand requests to (0: none)."""
        self.stages, self.config, self.layer_ranges = stages, config, layer_ranges
        self.depth = len(stages)
        self.num_decode_ranks = num_decode_ranks
        self.labels = [f"prefill stage {r}" for r in range(len(stages))]

    dcp_size = 1
    call_timeout_s = CALL_TIMEOUT_S

    def _get(self, refs: list) -> list:
        return get_within(refs, self.call_timeout_s, self.labels)

    def members(self) -> list[tuple[str, object]]:
        """(label, actor handle) of every stage: what the replica's watchdog pings."""
        return list(zip(self.labels, self.stages))

    def cache_specs(self) -> list:
        return self._get([s.cache_spec.remote() for s in self.stages])

    def apply(self, moves) -> None:
        if moves:
            for s in self.stages:
                s.apply.remote(moves)

    def submit(self, ids: list[int], batch: ForwardBatch, all_logits: bool):
        meta = batch_meta(batch)
        return [
            s.forward.remote(ids if r == 0 else None, meta, all_logits)
            for r, s in enumerate(self.stages)
        ]

    def wait(self, refs):
        return self._get(refs)[-1]  # every stage's ref: a failing stage raises here

    def ready(self, refs) -> bool:
        """Whether every stage has finished this batch (`wait` would not block)."""
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def export_request(self, block: int, pages: list[int], num_tokens: int) -> list:
        """Every stage sends its layers of one request to the decode ranks (over the replica's
        group); per decode rank, the refs of its manifests from every stage, in stage order.
        A stage runs the export after the calls queued before it (the engine imports once
        `exported`); its sends wait for the ranks' receives (`DecodeRankActor.import_request`)."""
        n = self.num_decode_ranks
        refs = [
            s.export_request.options(num_returns=n).remote(block, pages, num_tokens)
            for s in self.stages
        ]
        refs = [r if n > 1 else [r] for r in refs]
        return [[stage_refs[r] for stage_refs in refs] for r in range(n)]

    def exported(self, sent: list) -> bool:
        """Whether every stage has run this export (`export_request`'s answer): the decode
        ranks' import would not wait. A stage that failed counts as done (its import raises).
        One ref per stage is enough: a call's returns all arrive when it ends."""
        done, _ = ray.wait(sent[0], num_returns=len(sent[0]), timeout=0)
        return len(done) == len(sent[0])

    def wait_exported(self, sent: list) -> None:
        """Block until every stage has run this export; a failed or hung stage raises."""
        get_within(sent[0], self.call_timeout_s, self.labels)

    def request_tensors(self, block: int, pages: list[int], num_tokens: int) -> dict:
        """Every stage's cache of one request, merged by layer."""
        merged = {"kda_state": {}, "kda_conv": {}, "mla_latent": {}}
        calls = [s.request_tensors.remote(block, pages, num_tokens) for s in self.stages]
        for part in self._get(calls):
            for name, layers in part.items():
                merged[name].update(layers)
        return merged

    def bubble(self, reset: bool = True) -> dict:
        """Busy fraction per stage over the span from the first compute start to the last
        compute end (all stages), and the bubble = 1 - mean busy fraction. Each stage keeps its
        last `prefill.BUSY_WINDOW` intervals only, so a long job reports its recent past."""
        stats = self._get([s.stats.remote() for s in self.stages])
        if reset:
            self._get([s.reset_stats.remote() for s in self.stages])
        intervals = [st["busy"] for st in stats]
        starts = [a for iv in intervals for a, _ in iv]
        ends = [b for iv in intervals for _, b in iv]
        if not starts:
            return {"busy": [0.0] * len(self.stages), "bubble": 1.0, "span_s": 0.0}
        span = max(ends) - min(starts)
        busy = [sum(b - a for a, b in iv) / span for iv in intervals]
        return {"busy": busy, "bubble": 1 - sum(busy) / len(busy), "span_s": span}

    def shutdown(self) -> None:
        shutdown_actors(self.stages)
