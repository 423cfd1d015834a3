"""Elastic job on a simulated autoscaling cluster: replicas and nodes over time.

    python -m k3batch.bench.elastic --rows 600 --png benchmarks/elastic_timeline.png

Starts a `SimulatedCluster` with no worker nodes and one node type that declares one `GPU` and
`accelerator_type:SIM` (the devices are fake, the autoscaler is Ray's), then runs a job with
`num_replicas = {min = 1, max = N}` and `accelerator_type = "SIM"` (so `device = "auto"` asks for
GPUs) on fake replicas (each row takes `--token-s` x 8 tokens, the last row `--tail-tokens`:
a tail that one replica serves while the others drain and their nodes go). A thread samples
the cluster's live worker nodes every `SAMPLE_S`; the job's report gives the replicas up over
time. Prints both timelines, writes them as JSON beside the PNG, and, with `--png`, draws them
(matplotlib, the `bench` extra: not needed by the package). `run_elastic` is also what the
test runs; its nodes go after `IDLE_TIMEOUT_S` idle (the timeline PNG was drawn with 3 s).
"""

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

SAMPLE_S = 0.5
IDLE_TIMEOUT_S = 10.0
NODE_TYPE = "gpu_sim"


def run_elastic(work: Path, *, rows: int, max_replicas: int, token_s: float, tail_tokens: int,
                settle_s: float = 60.0) -> dict:  # fmt: skip
    """Run the job in `work` on a fresh simulated cluster; returns {"report", "nodes", "replicas",
    "rows"}: the job report (a dict), [(s, worker nodes)], [(s, replicas up)] and the output
    rows. After the job, sampling goes on until the workers are gone (at most `settle_s`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from k3batch.driver.fake import FakeReplica
    from k3batch.driver.job import run_job
    from k3batch.engine.request import SamplingParams
    from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaRange
    from k3batch.driver.jobspec import ReplicaSpec
    from k3batch.model.weights import init_checkpoint
    from k3batch.testing.simcluster import SimulatedCluster

    init_checkpoint("k3-debug", work / "model", seed=0)  # config and tokenizer; no model runs
    # Rows of 8 tokens, and a last row of `tail_tokens`: the tail, where one replica is enough.
    lens = [8] * (rows - 1) + [tail_tokens]
    (work / "in").mkdir()
    pq.write_table(pa.table({
        "id": [f"r{i}" for i in range(rows)],
        "prompt_token_ids": [[1 + (i + j) % 200 for j in range(8)] for i in range(rows)],
        "max_new_tokens": lens,
    }), work / "in" / "part-0.parquet")  # fmt: skip
    spec = JobSpec(
        model=str(work / "model"),
        name="elastic",
        input=InputSpec(path=str(work / "in"), batch_rows=8),
        output=OutputSpec(path=str(work / "out")),
        sampling=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
        replicas=ReplicaSpec(
            num_replicas=ReplicaRange(min=1, max=max_replicas),
            accelerator_type="SIM",  # device "auto": the job asks for GPUs
            max_inflight_rows=4,
            max_retries=0,
            wait_timeout_s=180,
        ),
        engine=EngineConfig(max_seq_len=128),
    )
    node = {"resources": {"CPU": 2, "GPU": 1, "accelerator_type:SIM": 1},
            "max_workers": max_replicas}  # fmt: skip
    # A node idle this long goes. Its clock starts at launch: with 3 s, on a loaded 2-core
    # machine a node could go before its replica's group was placed on it (CI: the second
    # node came and went twice and the job ended on one replica).
    cluster = SimulatedCluster({NODE_TYPE: node}, idle_timeout_s=IDLE_TIMEOUT_S)
    nodes: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        ray.init(address=cluster.start(), log_to_driver=False)
        t0 = time.monotonic()

        def sample():
            while not stop.is_set():
                n = sum(1 for x in ray.nodes() if x["Alive"] and x["Resources"].get("GPU"))
                if not nodes or nodes[-1][1] != n:
                    nodes.append((round(time.monotonic() - t0, 2), n))
                stop.wait(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        report = run_job(spec, replica_cls=FakeReplica, replica_kw={"token_s": token_s})
        t_end = time.monotonic()
        while time.monotonic() - t_end < settle_s and (not nodes or nodes[-1][1] > 0):
            time.sleep(SAMPLE_S)
        stop.set()
        sampler.join()
        out = pq.read_table(work / "out").to_pylist()
    finally:
        stop.set()
        ray.shutdown()
        cluster.stop()
    job_end_s = round(t_end - t0, 2)
    return {"report": report.to_dict(), "nodes": nodes, "replicas": report.replica_timeline,
            "job_end_s": job_end_s, "rows": out}  # fmt: skip


def format_timeline(result: dict) -> str:
    """Both timelines as text, one event per line."""
    events = [(t, f"worker nodes -> {n}") for t, n in result["nodes"]]
    events += [(t, f"replicas up  -> {n}") for t, n in result["replicas"]]
    events.append((result["job_end_s"], "job done"))
    r = result["report"]
    lines = [f"{t:7.1f} s  {what}" for t, what in sorted(events)]
    lines.append(
        f"rows written {r['rows_written']} of {r['rows_total']}, startup (first replica up) "
        f"{r['stage_s']['startup']:.1f} s, rows per replica {r['rows_per_replica']}"
    )
    return "\n".join(lines)


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(t for t, _ in result["nodes"] + result["replicas"]) + 2
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for series, label in ((result["nodes"], "GPU worker nodes"),
                          (result["replicas"], "replicas up")):  # fmt: skip
        xs = [t for t, _ in series] + [end]
        ys = [n for _, n in series] + [series[-1][1]]
        ax.step(xs, ys, where="post", label=label)
    ax.axvline(result["job_end_s"], color="gray", linestyle=":", label="job done")
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("count")
    ax.set_title("k3batch elastic job on a simulated autoscaling cluster (from zero GPU nodes)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=600)
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--token-s", type=float, default=0.02, help="fake decode time per token")
    p.add_argument("--tail-tokens", type=int, default=1000, help="tokens of the last row")
    p.add_argument("--png", default=None, help="also draw the timeline here (needs matplotlib)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="k3e") as tmp:
        result = run_elastic(Path(tmp), rows=args.rows, max_replicas=args.max_replicas,
                             token_s=args.token_s, tail_tokens=args.tail_tokens)  # fmt: skip
    print(format_timeline(result))
    if args.png:
        png = Path(args.png)
        data = {k: result[k] for k in ("nodes", "replicas", "job_end_s")}
        png.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        png.with_suffix(".txt").write_text(format_timeline(result) + "\n")
        plot(result, png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
