"""Prometheus metrics of a running job (issue 52): the metrics endpoint of a local Ray head is
scraped during and after two CPU jobs on a tiny checkpoint, and every `k3batch.metrics` name is
found with a plausible value. The first job's replica exits once mid-job (a restart to count),
its prompts repeat (prefix-cache hits) and one row is bad (a failed row); its counters end
equal to the report's. The second is a disaggregated replica (one prefill stage, one decode
rank) whose handoffs are counted.

This module starts its own Ray (metrics reported every second instead of Ray's 10): it skips
when Ray is already connected in this process.
"""

import re
import threading
import time
import urllib.request
from collections import defaultdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from k3batch.driver import run_job
from k3batch.driver.fake import FaultyReplica
from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaSpec
from k3batch.engine.request import SamplingParams
from k3batch.metrics import STATES

SETTLE_S = 30  # for the last values to reach the endpoint after a job


@pytest.fixture(scope="module")
def endpoint():
    if ray.is_initialized():
        pytest.skip("Ray is already connected in this process (run this module on its own)")
    ray.init(address="local", num_cpus=6, include_dashboard=False,
             _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    try:
        yield f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
    finally:
        ray.shutdown()


_LINE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


def scrape(url: str, job: str) -> dict:
    """{metric name: {frozenset of (label, value) but the process's own: value summed}} of the
    ray_k3batch_* series of `job`."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict = defaultdict(lambda: defaultdict(float))
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or not m[1].startswith("ray_k3batch_"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
        if labels.get("job") != job:
            continue
        own = {k: v for k, v in labels.items()
               if k in ("replica", "reason", "state", "kind", "verdict", "le")}  # fmt: skip
        out[m[1]][frozenset(own.items())] += float(m[3])
    return out


def total(series: dict, **labels) -> float:
    return sum(v for k, v in series.items() if set(labels.items()) <= set(k))


def _spec(model_dir, tmp, name, prompts, new_tokens=4, **replicas) -> JobSpec:
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts}),
                   tmp / f"{name}.parquet")  # fmt: skip
    return JobSpec(
        model=model_dir,
        name=name,
        input=InputSpec(path=str(tmp / f"{name}.parquet"), batch_rows=2),
        output=OutputSpec(path=str(tmp / name)),
        sampling=SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True),
        replicas=ReplicaSpec(device="cpu", max_inflight_rows=4, **replicas),
        engine=EngineConfig(max_seq_len=64, chunk_size=16, max_num_seqs=2),
    )


def _run_scraping(url, spec, **kw):
    """Run the job while scraping every half second; (report, scrapes during, settled scrape)."""
    seen, result = [], {}
    thread = threading.Thread(target=lambda: result.update(report=run_job(spec, **kw)))
    thread.start()
    while thread.is_alive():
        seen.append(scrape(url, spec.name))
        time.sleep(0.5)
    thread.join()
    report = result["report"]
    deadline = time.monotonic() + SETTLE_S
    while True:
        last = scrape(url, spec.name)
        done = total(last["ray_k3batch_rows_committed_total"]) == report.rows_written
        if done or time.monotonic() > deadline:
            return report, seen, last
        time.sleep(1)


def test_a_jobs_metrics_are_scraped_with_plausible_values(endpoint, mini_model_dir, tmp_path):
    prompts = ["kimi linear attention batch"] * 6 + ["", "kimi linear attention"] * 2
    spec = _spec(mini_model_dir, tmp_path, "metrics-job", prompts, new_tokens=32)  # seconds
    # of decoding with requests in the engine, over several of the replica's samples
    report, seen, m = _run_scraping(
        endpoint, spec, replica_cls=FaultyReplica,
        replica_kw={"fault": "exit_once", "at_step": 3, "marker": str(tmp_path / "exited")},
    )  # fmt: skip
    assert report.is_complete and report.rows_written == 10 and report.rows_with_error == 2
    assert total(m["ray_k3batch_rows_committed_total"]) == report.rows_written
    assert total(m["ray_k3batch_rows_failed_total"], reason="input") == 2
    assert total(m["ray_k3batch_rows_done_total"], replica="0") == 8  # the bad rows never ran
    assert total(m["ray_k3batch_rows_retried_total"]) == report.rows_retried >= 1
    assert total(m["ray_k3batch_prompt_tokens_total"]) == report.prompt_tokens
    assert total(m["ray_k3batch_output_tokens_total"]) == report.output_tokens == 8 * 32
    assert total(m["ray_k3batch_replica_failures_total"], replica="0") == 1
    steps = m["ray_k3batch_step_seconds_count"]
    assert total(steps, kind="prefill") >= 1 and total(steps, kind="decode") >= 3
    assert total(m["ray_k3batch_step_seconds_sum"]) > 0
    assert total(m["ray_k3batch_prefix_cache_hits_total"]) >= 1
    assert total(m["ray_k3batch_prefill_tokens_saved_total"]) >= 1
    during = [s for s in seen if s.get("ray_k3batch_replicas")]
    assert any(total(s["ray_k3batch_replicas"], state="up") == 1 for s in during)
    assert {dict(k)["state"] for k in during[-1]["ray_k3batch_replicas"]} == set(STATES)
    assert any(total(s.get("ray_k3batch_units_open", {})) >= 1 for s in seen)
    assert any(total(s.get("ray_k3batch_arena_bytes", {}), kind="kda") > 0 for s in seen)
    assert any(total(s.get("ray_k3batch_arena_bytes", {}), kind="mla") > 0 for s in seen)
    assert any(total(s.get("ray_k3batch_requests_running", {})) >= 1 for s in seen)
    assert all(0 <= total(s.get("ray_k3batch_requests_running", {})) <= 2 for s in seen)
    assert any("ray_k3batch_requests_waiting" in s for s in seen)


def test_a_disaggregated_replica_counts_its_handoffs(endpoint, mini_model_dir, tmp_path):
    spec = _spec(mini_model_dir, tmp_path, "metrics-pd", ["kimi linear", "attention batch"] * 3,
                 new_tokens=32, disaggregate=True)  # fmt: skip  # seconds after the first handoff
    report, _, m = _run_scraping(endpoint, spec)
    assert report.is_complete and report.rows_with_error == 0
    deadline = time.monotonic() + SETTLE_S  # the sampler reads the group once a second
    while not m.get("ray_k3batch_handoff_bytes_total") and time.monotonic() < deadline:
        time.sleep(1)
        m = scrape(endpoint, spec.name)
    assert total(m["ray_k3batch_handoff_bytes_total"]) > 1000
    assert total(m["ray_k3batch_handoff_seconds_total"]) > 0
