"""Driver benchmark: peak RSS and time of the driver's intake and bookkeeping at scale.

    python -m k3batch.bench.driver --rows 10000000 --files 1000

Writes a synthetic pre-tokenized input (`--files` Parquet files, string ids, a few prompt
tokens per row) and runs it through `run_job` with instant fake replicas, so what is measured
is the driver: the input survey, the id index, units in and out of memory, tokenize tasks,
dispatch and commit of every row. With `--resume`, it then deletes half of the shards and runs
again (the resume path). Prints rows, peak RSS of the driver process and wall time per run.
"""

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from k3batch.driver.fake import FakeReplica
from k3batch.driver.job import run_job
from k3batch.engine.request import SamplingParams
from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaSpec


def write_input(path: Path, num_rows: int, num_files: int, prompt_len: int = 4) -> None:
    """num_rows rows over num_files files: string ids "0", "1", ..., prompts of prompt_len ids."""
    path.mkdir(parents=True)
    per_file = -(-num_rows // num_files)
    for f in range(num_files):
        start, stop = f * per_file, min((f + 1) * per_file, num_rows)
        if start >= stop:
            break
        n = stop - start
        ids = pc.cast(pa.array(np.arange(start, stop)), pa.string())
        values = pa.array((np.arange(n * prompt_len, dtype=np.int32) % 200) + 1)
        offsets = pa.array(np.arange(0, (n + 1) * prompt_len, prompt_len, dtype=np.int32))
        tokens = pa.ListArray.from_arrays(offsets, values)
        table = pa.table({"id": ids, "prompt_token_ids": tokens})
        pq.write_table(table, path / f"part-{f:05d}.parquet", row_group_size=64 * 1024)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--files", type=int, default=1000)
    p.add_argument("--batch-rows", type=int, default=10_000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--inflight", type=int, default=8192)
    p.add_argument("--resume", action="store_true", help="also time a resume of half the job")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed)")
    args = p.parse_args(argv)

    from k3batch.model.weights import init_checkpoint

    work = Path(args.dir or tempfile.mkdtemp(prefix="k3batch-bench-driver-"))
    try:
        t0 = time.monotonic()
        init_checkpoint("k3-debug", work / "model", seed=0)  # tokenizer and config only
        write_input(work / "in", args.rows, args.files)
        print(f"input: {args.rows} rows in {args.files} files ({time.monotonic() - t0:.1f} s)")
        spec = JobSpec(
            model=str(work / "model"),
            name="bench-driver",
            input=InputSpec(path=str(work / "in"), batch_rows=args.batch_rows),
            output=OutputSpec(path=str(work / "out")),
            sampling=SamplingParams(temperature=0, max_new_tokens=2),
            replicas=ReplicaSpec(
                num_replicas=args.replicas, device="cpu", max_inflight_rows=args.inflight
            ),
            engine=EngineConfig(max_seq_len=128),
        )
        # A Ray of our own: never join another local cluster (ray.init() would).
        for attempt in range(3):  # a busy host can miss Ray's fixed 30 s node-startup wait
            try:
                ray.init(address="local", num_cpus=2 * args.replicas + 4, include_dashboard=False)
                break
            except Exception as e:
                print(f"ray.init failed ({e}); retrying", flush=True)
                ray.shutdown()
        try:
            base_rss = peak_rss_mib()
            _timed("first run", spec, base_rss)
            if args.resume:
                shards = sorted((work / "out").glob("part-*.parquet"))
                for s in shards[::2]:
                    s.unlink()
                _timed("resume (half the shards deleted)", spec, base_rss)
        finally:
            ray.shutdown()
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def _timed(what: str, spec: JobSpec, base_rss: float) -> None:
    t0 = time.monotonic()
    report = run_job(spec, replica_cls=FakeReplica)
    wall = time.monotonic() - t0
    rows = report.rows_written
    print(
        f"{what}: {rows} rows written, {report.rows_skipped_resumed} resumed, "
        f"complete={report.is_complete}; driver peak RSS {peak_rss_mib():.0f} MiB "
        f"(before the job {base_rss:.0f} MiB); {wall:.1f} s ({rows / wall:,.0f} rows/s); "
        f"peak open units {report.peak_open_units}",
        flush=True,
    )


if __name__ == "__main__":
    main()
