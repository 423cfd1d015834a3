"""run_job(spec): set a job up, run the loop, take everything down, account for every row.

Order matters: the output lease comes first (no other driver writes there from now on, so
leftover temp files are ours to delete), then the input survey (a job with no valid input fails
before the manifest exists), the manifest (the first start fixes files, batch size, row counts
and the input contract), the id index, Ray and the replicas. Whatever happens, the replicas,
placement groups, the Ray session we started, the id index and the lease are released. At the
end of every run, committed shards are compared with the recorded row counts: `report.missing`
says per file what has no output and why (`report.is_complete` is False then).
"""

import logging
import os
import time

import ray

from k3batch.actors.failure import describe
from k3batch.actors.replica import ReplicaActor
from k3batch.driver.commit import Committer, missing_rows
from k3batch.driver.dispatch import Dispatcher
from k3batch.driver.health import CrashLoopError
from k3batch.driver.ids import IdIndex
from k3batch.driver.inputs import survey_inputs
from k3batch.driver.intake import Intake
from k3batch.driver.loop import Loop
from k3batch.driver.replicas import ReplicaPool
from k3batch.io import OutputLease, ShardSink, iter_units, open_manifest, record_inputs
from k3batch.io import resolve_input
from k3batch.driver.jobspec import JobSpec
from k3batch.metrics import JobMetrics
from k3batch.model.config import K3Config
from k3batch.driver.report import REPORT_NAME, JobReport, Progress

log = logging.getLogger(__name__)

MAX_OPEN_FACTOR = 4  # open units at most, per unit needed to fill every window (`loop.Loop`)


def run_job(spec: JobSpec, *, progress_stream=None, replica_cls=ReplicaActor,
            replica_kw: dict | None = None) -> JobReport:  # fmt: skip
    """Run the job `spec` to the end and return its report (also saved beside the output).
    replica_cls/replica_kw: the replica actor class and extra constructor arguments (tests and
    the driver benchmark use a fake replica)."""
    t_start, started_at = time.monotonic(), time.time()
    spec = spec.validate()
    sink = ShardSink(spec.output.path)
    with OutputLease(sink, job=spec.name) as lease:
        if sink.cleanup_temp():
            log.info("removed leftover temp files of an interrupted run")
        report, files, counts, batch_rows, ctx = _prepare(spec, sink)
        report.started_at = started_at
        try:
            _run(spec, sink, lease, report, ctx, progress_stream, replica_cls, replica_kw, t_start)
        except CrashLoopError as e:  # the report says why the job stopped, then the caller
            report.error = {"kind": "crash_loop", **e.to_dict()}
            raise
        except Exception as e:
            report.error = {"kind": "failed", **describe(e)}
            raise
        finally:
            if ctx["ids"] is not None:
                ctx["ids"].close()
            reasons = ctx["reasons"]
            report.missing = missing_rows(files, counts, sink.committed(), batch_rows, reasons)
            report.wall_s = time.monotonic() - t_start
            sink.write_json(REPORT_NAME, report.to_dict())
    if report.missing:
        log.error("input rows with no output: %s", report.missing)
    return report


def _prepare(spec: JobSpec, sink: ShardSink):
    """Survey, manifest, report and id index of this run."""
    fs, listed = resolve_input(spec.input.path, format=spec.input.format)
    survey = survey_inputs(fs, listed, spec.input)  # raises if no file is valid
    fingerprint, desc = spec.fingerprint()
    manifest, files = open_manifest(
        sink,
        fingerprint=fingerprint,
        description=desc,
        files=listed,
        batch_rows=spec.input.batch_rows,
    )
    recorded = manifest.input_schema
    same_files = [f.path for f in files] == [f.path for f in listed]
    if not same_files or recorded not in (None, survey.contract):
        survey = survey_inputs(fs, files, spec.input, recorded)
    manifest = record_inputs(sink, manifest, num_rows=survey.num_rows, input_schema=survey.contract)
    counts = [m if m is not None else n for m, n in zip(manifest.num_rows(), survey.num_rows)]
    if all(c == 0 for c in counts):
        raise ValueError(f"input {spec.input.path!r} holds no rows")
    batch_rows = manifest.batch_rows
    done = sink.committed()
    report = JobReport(
        job=spec.name, output=spec.output.path, rows_total=None if None in counts else sum(counts)
    )
    report.rows_skipped_resumed = sum(
        min(batch_rows, counts[f] - b * batch_rows) for f, b in done if counts[f] is not None
    )
    report.unreadable_inputs += [survey.bad[i] for i in sorted(survey.bad)]
    reasons = {i: [why] for i, why in survey.bad.items()}
    for why in report.unreadable_inputs:
        log.error("input skipped: %s", why)
    good = [f for f in files if f.index not in survey.bad]
    ids = IdIndex.build(fs, good, spec.input.id_column) if survey.has_ids else None
    units = iter_units(fs, good, batch_rows, skip=lambda f, b: (f, b) in done)
    ctx = {"ids": ids, "units": units, "reasons": reasons, "batch_rows": batch_rows}
    return report, files, counts, batch_rows, ctx


def _init_ray(spec: JobSpec) -> None:
    """Join the cluster at `spec.address` (or RAY_ADDRESS, as inside a Ray job); with neither,
    start a Ray of the job's own (address "local"), even where a cluster already runs on this
    machine: joining one by accident would also refuse the local resource counts."""
    address = spec.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False)
        return
    r = spec.replicas
    local_cpus = r.max_replicas * (r.num_workers + 1) + 2  # logical CPUs
    ray.init(address="local", num_cpus=local_cpus, include_dashboard=False)


def _run(spec, sink, lease, report, ctx, progress_stream, replica_cls, replica_kw, t_start):
    config = K3Config.from_hf(spec.model)
    r = spec.replicas
    started_ray = not ray.is_initialized()
    if started_ray:
        _init_ray(spec)
    pool = None
    try:
        pool = ReplicaPool(spec, r.resolved_device, replica_cls=replica_cls, replica_kw=replica_kw,
                           t0=t_start)  # fmt: skip
        intake = Intake(spec, config.vocab_size, ctx["units"], ctx["ids"], report)
        window = spec.inflight_rows
        metrics = JobMetrics(spec.name) if spec.metrics else None
        pool.health.metrics = metrics
        dispatch = Dispatcher(pool.actors, pool.health, window=window, max_retries=r.max_retries,
                              report=report, metrics=metrics)  # fmt: skip
        commit = Committer(spec, sink, intake.add_id, report, lease)
        progress = Progress(report.rows_total, report.rows_skipped_resumed, progress_stream)
        # every window full and one unit more; up to MAX_OPEN_FACTOR times the units that
        # takes are held while long rows keep finished ones from committing
        rows_wanted = r.max_replicas * window + ctx["batch_rows"]
        max_open = MAX_OPEN_FACTOR * -(-rows_wanted // ctx["batch_rows"])
        loop = Loop(intake, dispatch, pool, commit, rows_wanted=rows_wanted, max_open=max_open,
                    progress=progress, report=report, metrics=metrics)  # fmt: skip
        loop.fill()  # the first units read and tokenized while the replicas start
        if loop.open or not intake.exhausted:  # else every unit was committed already (a rerun)
            pool.start()
        report.stage_s["startup"] = time.monotonic() - t_start
        try:
            loop.run()
            report.stage_s["run"] = time.monotonic() - t_start - report.stage_s["startup"]
        finally:
            for i, errors in intake.errors.items():
                ctx["reasons"].setdefault(i, []).extend(errors)
            report.replica_timeline = pool.timeline
        pool.health.revisit(final=True)  # a node found dead by now is node loss
        report.failures_unjudged = len(pool.health.waiting)
        stats = pool.collect_stats()
        report.stage_s["generate"] = max((s["busy_s"] for s in stats), default=0.0)
        report.rows_per_replica = [s["rows"] for s in stats]
        report.pipeline = [s["pipeline"] for s in stats if "pipeline" in s]
        report.decode_groups = [s["decode_group"] for s in stats if "decode_group" in s]
        report.cache = [s["cache"] for s in stats if "cache" in s]
        report.sizing = [s["sizing"] for s in stats if "sizing" in s]
        report.engine_steps = [s["engine"] for s in stats if "engine" in s]
    finally:
        if pool is not None:
            pool.shutdown()
        if started_ray:
            ray.shutdown()
