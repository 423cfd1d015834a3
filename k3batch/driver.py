"""run_job(spec): Parquet in, Parquet out, through N replica actors on a Ray cluster.

Flow: resolve the input files -> cut them into units of `batch_rows` rows (numbered by file and
batch, fixed by the manifest) -> tokenize each unit in a Ray CPU task -> dispatch its rows in
micro-batches to the replicas, at most `max_inflight_rows` rows per replica -> when every row of
a unit is back, write the unit's shard (atomic rename = commit).
Guarantees: each input row is written exactly once, even across SIGKILLs of the driver (a rerun
skips committed units and redoes the rest) and replica deaths (Ray restarts the actor, the
driver resubmits its rows, at most `max_retries` times, then marks them failed). Memory is
bounded by the open units: at most enough to fill every replica's in-flight budget, plus one.
Everything that can be checked is checked before a model is loaded.
"""

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3batch.actors.replica import ReplicaActor
from k3batch.io import ShardSink, count_rows, iter_units, open_manifest, resolve_input, shard_name
from k3batch.jobspec import JobSpec
from k3batch.model.config import K3Config
from k3batch.prompts import RowWork, prepare_rows, prompt_source
from k3batch.report import REPORT_NAME, JobReport, Progress

log = logging.getLogger(__name__)

RESULT_TYPES = {
    "generated_text": pa.string(),
    "output_token_ids": pa.list_(pa.int32()),
    "finish_reason": pa.string(),
    "num_prompt_tokens": pa.int32(),
    "num_output_tokens": pa.int32(),
    "error": pa.string(),
    "output_logprobs": pa.list_(pa.float32()),
    "prompt_logprobs": pa.list_(pa.float32()),
}


@ray.remote(num_cpus=1)
def _tokenize(table: pa.Table, **kw) -> tuple[list[RowWork], float]:
    t0 = time.perf_counter()
    return prepare_rows(table, **kw), time.perf_counter() - t0


@dataclass
class _Unit:
    file_index: int
    batch_idx: int
    table: pa.Table
    ids: list[str]
    results: list[dict | None]
    remaining: int


def run_job(spec: JobSpec, *, progress_stream=None) -> JobReport:
    t_start = time.monotonic()
    spec = spec.validate()
    sink = ShardSink(spec.output.path)
    if sink.cleanup_temp():
        log.info("removed leftover temp files of an interrupted run")
    fs, files = resolve_input(spec.input.path)
    schema = _check_schema(fs, files, spec)
    fingerprint, desc = spec.fingerprint()
    manifest, files = open_manifest(
        sink,
        fingerprint=fingerprint,
        description=desc,
        files=files,
        batch_rows=spec.input.batch_rows,
    )
    batch_rows = manifest.batch_rows
    counts = count_rows(fs, files)
    if all(c == 0 for c in counts):
        raise ValueError(f"input {spec.input.path!r} holds no rows")
    done = sink.committed()
    report = JobReport(
        job=spec.name, output=spec.output.path, rows_total=None if None in counts else sum(counts)
    )
    report.rows_skipped_resumed = sum(
        min(batch_rows, counts[f] - b * batch_rows) for f, b in done if counts[f] is not None
    )
    config = K3Config.from_hf(spec.model)
    seen_ids = _committed_ids(sink, done, spec) if spec.input.id_column in schema.names else set()

    started_ray = not ray.is_initialized()
    if started_ray:
        r = spec.replicas
        local_cpus = r.num_replicas * (r.pp + r.tp + 1) + 2  # logical CPUs
        ray.init(
            address=spec.address,
            num_cpus=None if spec.address else local_cpus,
            include_dashboard=False,
        )
    replicas, groups = [], []
    try:
        device = spec.replicas.device
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        replicas, groups = _start_replicas(spec, device)
        report.stage_s["startup"] = time.monotonic() - t_start
        units = iter_units(fs, files, batch_rows, skip=lambda f, b: (f, b) in done)
        _Loop(
            spec,
            config,
            replicas,
            report,
            seen_ids,
            schema,
            sink,
            Progress(report.rows_total, report.rows_skipped_resumed, progress_stream),
        ).run(units)
        busy = ray.get([r.stats.remote() for r in replicas])
        report.stage_s["generate"] = max(s["busy_s"] for s in busy)
        report.rows_per_replica = [s["rows"] for s in busy]
        report.pipeline = [s["pipeline"] for s in busy if "pipeline" in s]
        report.decode_groups = [s["decode_group"] for s in busy if "decode_group" in s]
        report.cache = [s["cache"] for s in busy]
    finally:
        for actor in replicas:
            ray.kill(actor)
        for pg in groups:
            remove_placement_group(pg)
        if started_ray:
            ray.shutdown()
    report.wall_s = time.monotonic() - t_start
    sink.write_json(REPORT_NAME, report.to_dict())
    return report


def _check_schema(fs, files, spec: JobSpec) -> pa.Schema:
    """Schema of the first readable file; it must hold a prompt column and no result column."""
    for f in files:
        try:
            schema = pq.read_schema(f.path, filesystem=fs)
        except (OSError, pa.ArrowInvalid):
            continue
        prompt_source(schema, spec.input)
        clash = [c for c in RESULT_TYPES if c in schema.names]
        if clash:
            raise ValueError(f"input column(s) {clash} clash with output columns; rename them")
        return schema
    raise ValueError(f"input {spec.input.path!r}: no readable Parquet file")


def _committed_ids(sink: ShardSink, done, spec: JobSpec) -> set[str]:
    """Ids already written by earlier runs, so duplicates are caught across resumes."""
    ids = set()
    for f, b in sorted(done):
        path = f"{sink.path}/{shard_name(f, b)}"
        col = pq.read_table(path, columns=[spec.input.id_column], filesystem=sink.fs).column(0)
        ids.update(str(v) for v in col.to_pylist() if v is not None)
    return ids


def _start_replicas(spec: JobSpec, device: str):
    """Placement groups per replica, and one replica actor in the first bundle of the first.
    pp = tp = 1: one bundle with the replica's device(s) (STRICT_PACK). Otherwise the replica is
    a light coordinator followed by one bundle (one device) per pipeline stage (PACK: stages may
    span nodes), and with tp > 1 a second group with one bundle per decode rank (STRICT_PACK: a
    decode group shares a node). GPU and accelerator-type requests let an autoscaler see the
    demand."""
    r = spec.replicas
    cuda = device == "cuda"
    accel = {f"accelerator_type:{r.accelerator_type}": 0.001} if r.accelerator_type and cuda else {}
    single = r.pp == 1 and r.tp == 1
    if single:
        gpus = (r.num_gpus if r.num_gpus is not None else 1) if cuda else 0
        bundles, strategy = [{"CPU": 1, "GPU": gpus, **accel}], "STRICT_PACK"
    else:
        gpus = 0
        worker = {"CPU": 1, "GPU": 1 if cuda else 0, **accel}
        bundles, strategy = [{"CPU": 1}] + [worker] * r.pp, "PACK"
    drop_zeros = lambda bs: [{k: v for k, v in b.items() if v} for b in bs]  # noqa: E731
    groups = [
        placement_group(drop_zeros(bundles), strategy=strategy) for _ in range(r.num_replicas)
    ]
    decode_groups = [None] * r.num_replicas
    if r.tp > 1:
        ranks = drop_zeros([worker] * r.tp)
        decode_groups = [placement_group(ranks, strategy="STRICT_PACK") for _ in groups]
    for pg in [*groups, *filter(None, decode_groups)]:
        while not _wait_ready(pg, 30):
            log.warning("waiting for resources for a replica: %s", pg.bundle_specs)
    actor_cls = ray.remote(ReplicaActor)
    actors = [
        actor_cls.options(
            num_cpus=1,
            num_gpus=gpus,
            max_restarts=r.max_retries,
            max_task_retries=0,
            max_concurrency=64,
            name=f"{spec.name}/replica-{i}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0
            ),
        ).remote(
            spec.model,
            spec.engine,
            device,
            pp=r.pp,
            pp_layers=r.pp_layers,
            tp=r.tp,
            dcp=r.dcp,
            placement_group=None if single else pg,
            decode_placement_group=dpg,
        )
        for i, (pg, dpg) in enumerate(zip(groups, decode_groups))
    ]
    ray.get([a.ready.remote() for a in actors])
    return actors, groups + list(filter(None, decode_groups))


def _wait_ready(pg, timeout_s: float) -> bool:
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    return bool(ready)


class _Loop:
    """The dispatch loop; one instance per run."""

    def __init__(self, spec, config, replicas, report, seen_ids, schema, sink, progress):
        self.spec, self.config, self.replicas, self.report = spec, config, replicas, report
        self.seen_ids, self.sink, self.progress = seen_ids, sink, progress
        self.add_id = spec.input.id_column not in schema.names
        r = spec.replicas
        self.micro = max(1, r.max_inflight_rows // 4)
        self.max_open = 1 + -(-r.num_replicas * r.max_inflight_rows // spec.input.batch_rows)
        self.defaults = replace(
            spec.sampling,
            logprobs=spec.output.logprobs,
            prompt_logprobs=spec.output.prompt_logprobs,
        )
        self.open: dict[tuple[int, int], _Unit] = {}
        self.tok_refs: dict = {}
        self.gen_refs: dict = {}
        self.queue: deque = deque()  # (unit key, [(row_idx, RowWork)], attempt)
        self.inflight = [0] * len(replicas)
        # Replica health: "up", "down" (restarting: probed with ready() until it answers) or
        # "dead" (out of restarts). Rows go only to replicas that are up.
        self.health = ["up"] * len(replicas)
        self.probes: dict = {}  # ready() ref -> replica index
        self.probe_at: dict[int, float] = {}  # replica index -> when to probe next
        self.no_replica_since: float | None = None  # see _wait_for_a_replica
        self.wait_logged_at = 0.0

    def run(self, units) -> None:
        exhausted = False
        while True:
            while not exhausted and len(self.open) < self.max_open:
                t0 = time.perf_counter()
                unit = next(units, None)
                self.report.stage_s["read"] += time.perf_counter() - t0
                if unit is None:
                    exhausted = True
                elif unit.table is None:
                    self.report.unreadable_inputs.append(unit.error)
                    log.error("unreadable input: %s", unit.error)
                else:
                    self._open_unit(unit)
                    self.report.peak_open_units = max(self.report.peak_open_units, len(self.open))
            self._dispatch()
            if exhausted and not self.open:
                break
            self._send_probes()
            self._wait_for_a_replica()
            refs = [*self.tok_refs, *self.gen_refs, *self.probes]
            ready, _ = ray.wait(refs, num_returns=1, timeout=1.0)
            for ref in ready:
                if ref in self.tok_refs:
                    self._on_tokenized(self.tok_refs.pop(ref), ref)
                elif ref in self.probes:
                    self._on_probe(self.probes.pop(ref), ref)
                else:
                    self._on_generated(*self.gen_refs.pop(ref), ref)
            self.progress.update(self._done_rows(), self.report.output_tokens)
        self.progress.update(self._done_rows(), self.report.output_tokens, final=True)

    def _done_rows(self) -> int:
        return self.report.rows_skipped_resumed + self.report.rows_written

    def _open_unit(self, unit) -> None:
        n, col = unit.table.num_rows, self.spec.input.id_column
        if self.add_id:
            ids = [f"{unit.file.uri}:{unit.row_offset + i}" for i in range(n)]
        else:
            ids = [None if v is None else str(v) for v in unit.table.column(col).to_pylist()]
        state = _Unit(unit.file.index, unit.batch_idx, unit.table, ids, [None] * n, n)
        key = (unit.file.index, unit.batch_idx)
        self.open[key] = state
        for i, rid in enumerate(ids):  # duplicates are decided in input order: deterministic
            if rid is None:
                self._finish_row(state, i, _error_row(f"{col} is null"))
            elif rid in self.seen_ids:
                self._finish_row(state, i, _error_row(f"duplicate id {rid!r}"))
            else:
                self.seen_ids.add(rid)
        cols = [c for c in unit.table.schema.names if c != col or not self.add_id]
        kw = dict(
            spec=self.spec.input,
            model_dir=self.spec.model,
            defaults=self.defaults,
            max_seq_len=self.spec.engine.max_seq_len,
            vocab_size=self.config.vocab_size,
        )
        self.tok_refs[_tokenize.remote(unit.table.select(cols), **kw)] = key
        self._maybe_commit(key)

    def _on_tokenized(self, key, ref) -> None:
        works, dt = ray.get(ref)
        self.report.stage_s["tokenize"] += dt
        state = self.open[key]
        todo = []
        for w in works:
            if state.results[w.row_idx] is not None:
                continue  # already failed (null or duplicate id)
            if w.error:
                self._finish_row(state, w.row_idx, _error_row(w.error))
            else:
                todo.append((w.row_idx, w))
        for s in range(0, len(todo), self.micro):
            self.queue.append((key, todo[s : s + self.micro], 0))
        self._maybe_commit(key)

    def _dispatch(self) -> None:
        cap = self.spec.replicas.max_inflight_rows
        up = [i for i, h in enumerate(self.health) if h == "up"]
        while self.queue and up:
            r = min(up, key=lambda i: self.inflight[i])
            key, rows, attempt = self.queue[0]
            if self.inflight[r] + len(rows) > cap and self.inflight[r] > 0:
                return
            self.queue.popleft()
            items = [((key, i), w.prompt_token_ids, w.sampling) for i, w in rows]
            self.gen_refs[self.replicas[r].generate.remote(items)] = (r, key, rows, attempt)
            self.inflight[r] += len(rows)
            self.report.peak_inflight_rows = max(self.report.peak_inflight_rows, self.inflight[r])

    def _on_generated(self, r, key, rows, attempt, ref) -> None:
        self.inflight[r] -= len(rows)
        try:
            results = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            self._mark_failed(r, e)
            if attempt < self.spec.replicas.max_retries:
                log.warning(
                    "replica %d failed (%s); retrying %d rows", r, type(e).__name__, len(rows)
                )
                self.report.rows_retried += len(rows)
                self.queue.appendleft((key, rows, attempt + 1))
            else:
                for i, _ in rows:
                    self._finish_row(
                        self.open[key], i, _error_row(f"replica failed {attempt + 1} times: {e}")
                    )
                self._maybe_commit(key)
            return
        state = self.open[key]
        for res in results:
            self._finish_row(state, res.pop("key")[1], res)
        self._maybe_commit(key)

    def _mark_failed(self, r: int, err: Exception) -> None:
        if self.health[r] == "up":
            self.report.replica_failures += 1
        if isinstance(err, ray.exceptions.ActorDiedError):
            self.health[r] = "dead"
            if all(h == "dead" for h in self.health):
                raise RuntimeError(f"every replica died; last error: {err}") from err
        elif self.health[r] == "up":
            self.health[r] = "down"
            self.probe_at[r] = time.monotonic()

    def _wait_for_a_replica(self) -> None:
        """With no replica up (nodes lost, replicas restarting where Ray can re-place their
        placement groups), say so every 30 s, and fail after replicas.wait_timeout_s."""
        if "up" in self.health:
            self.no_replica_since = None
            return
        now, r = time.monotonic(), self.spec.replicas
        if self.no_replica_since is None:
            self.no_replica_since = now
        waited = now - self.no_replica_since
        need = f"each replica needs pp = {r.pp} stage and tp = {r.tp} rank device(s) ({r.device})"
        if waited > r.wait_timeout_s:
            raise RuntimeError(
                f"no replica up for {waited:.0f} s (replicas.wait_timeout_s = "
                f"{r.wait_timeout_s:g}); gave up waiting for resources: {need}"
            )
        if waited >= 10 and now - self.wait_logged_at >= 30:  # not for a quick restart
            self.wait_logged_at = now
            log.warning(
                "no replica is up (%s); waiting for one to be rebuilt or for resources, "
                "%.0f of %g s (replicas.wait_timeout_s): %s",
                ", ".join(self.health), waited, r.wait_timeout_s, need,
            )

    def _send_probes(self) -> None:
        now = time.monotonic()
        for r, at in list(self.probe_at.items()):
            if at <= now:
                del self.probe_at[r]
                self.probes[self.replicas[r].ready.remote()] = r

    def _on_probe(self, r: int, ref) -> None:
        try:
            ray.get(ref)
        except ray.exceptions.ActorDiedError as e:
            self._mark_failed(r, e)
        except ray.exceptions.RayActorError:
            self.probe_at[r] = time.monotonic() + 1.0  # still restarting
        else:
            self.health[r] = "up"

    def _finish_row(self, state: _Unit, i: int, row: dict) -> None:
        assert state.results[i] is None, "a row finished twice"
        state.results[i] = row
        state.remaining -= 1

    def _maybe_commit(self, key) -> None:
        state = self.open[key]
        if state.remaining:
            return
        t0 = time.perf_counter()
        table = self._output_table(state)
        self.sink.write(state.file_index, state.batch_idx, table)
        self.report.stage_s["write"] += time.perf_counter() - t0
        del self.open[key]
        rep = self.report
        rep.rows_written += table.num_rows
        rep.rows_with_error += sum(r["error"] is not None for r in state.results)
        rep.prompt_tokens += sum(r.get("num_prompt_tokens") or 0 for r in state.results)
        rep.output_tokens += sum(r.get("num_output_tokens") or 0 for r in state.results)

    def _output_table(self, state: _Unit) -> pa.Table:
        table = state.table
        if self.add_id:
            table = table.append_column(self.spec.input.id_column, pa.array(state.ids, pa.string()))
        names = list(RESULT_TYPES)
        if not self.spec.output.logprobs:
            names.remove("output_logprobs")
        if not self.spec.output.prompt_logprobs:
            names.remove("prompt_logprobs")
        for name in names:
            values = [r.get(name) for r in state.results]
            table = table.append_column(name, pa.array(values, RESULT_TYPES[name]))
        return table


def _error_row(message: str) -> dict:
    return {
        "generated_text": None,
        "output_token_ids": None,
        "finish_reason": "error",
        "num_prompt_tokens": None,
        "num_output_tokens": 0,
        "error": message,
    }
