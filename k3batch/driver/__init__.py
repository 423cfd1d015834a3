"""run_job(spec): Parquet in, Parquet out, through N replica actors on a Ray cluster.

Flow: survey the input files (each checked against the job's input contract) -> cut the valid
ones into units of `batch_rows` rows (numbered by file and batch, fixed by the manifest) ->
tokenize each unit in a Ray CPU task -> stream its rows to the replicas, each holding at most
`JobSpec.inflight_rows` rows (`max_inflight_rows`, or twice the engine's max_num_seqs) and
refilled as rows come back -> when every row of a unit is back,
write the unit's shard (atomic rename = commit) -> account for every input row.
Guarantees: each input row is written exactly once, even across SIGKILLs of the driver (a rerun
skips committed units and redoes the rest) and replica deaths (Ray restarts the actor, the
driver resubmits its rows, at most `max_retries` times, then marks them failed); of rows sharing
an id, the first in input order runs, always. One driver per output directory (a lease). Memory
is bounded by the open units plus a fixed cache, at any input size. Every wait is bounded.

Modules: `job` (run_job: setup and teardown), `inputs` (survey, schema contract), `ids`
(first occurrences, on disk), `intake` (units -> rows), `dispatch` (rows <-> replicas),
`health` (replica states, probes), `commit` (shards, completeness), `loop` (joins them),
`replicas` (startup, bounded waits, statistics), `fake` (an instant replica for tests and the
benchmark). The job's vocabulary, beside the driver that uses it: `jobspec` (JobSpec, the TOML
file), `prompts` (rows -> token ids), `report` (the job's report). The output columns a replica
returns are `k3batch.actors.result` (a floor down: the replicas write them too). The driver's
benchmarks are `k3batch.bench.driver` and `k3batch.bench.elastic`.
"""

from k3batch._lazy import lazy_attributes

__all__ = ["run_job"]

__getattr__ = lazy_attributes(__name__, run_job="k3batch.driver.job")  # torch on first use
