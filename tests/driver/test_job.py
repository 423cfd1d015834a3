"""The batch job end to end on the shared local Ray head (token auth) with a tiny checkpoint
(k3batch.testing.K3_MINI): columns, every bad input of the job contract, resume after SIGKILL of
the driver and after a replica death, two replicas on one stream, bounded memory, pp > 1, Ray
Jobs."""

import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from k3batch.driver import run_job
from k3batch.engine.request import SamplingParams
from k3batch.driver.jobspec import (
    EngineConfig,
    InputSpec,
    JobSpec,
    OutputSpec,
    ReplicaSpec,
    load_job_spec,
)


def _spec(model_dir, inp, out, **kw) -> JobSpec:
    return JobSpec(
        model=model_dir,
        name=kw.pop("name", "test"),
        input=InputSpec(path=str(inp), batch_rows=kw.pop("batch_rows", 4)),
        output=OutputSpec(path=str(out), logprobs=kw.pop("logprobs", False)),
        sampling=SamplingParams(temperature=0, max_new_tokens=kw.pop("max_new_tokens", 4)),
        replicas=ReplicaSpec(
            num_replicas=kw.pop("replicas", 1),
            device="cpu",
            max_inflight_rows=kw.pop("inflight", 8),
            pp=kw.pop("pp", 1),
            tp=kw.pop("tp", 1),
            dcp=kw.pop("dcp", 1),
            disaggregate=kw.pop("disaggregate", False),
        ),
        engine=EngineConfig(max_num_seqs=kw.pop("max_num_seqs", 8), max_seq_len=128, chunk_size=64),
    )


def _prompts(n, seed=0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kimi", "linear", "attention", "batch"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _by_id(table):
    return {r["id"]: r for r in table.to_pylist()}


def test_text_job_columns_passthrough_and_row_errors(cluster, mini_model_dir, tmp_path):
    good = _prompts(5)
    prompts = good + [None, "", "word " * 200]
    n = len(prompts)
    table = pa.table(
        {
            "id": [f"r{i}" for i in range(n)],
            "prompt": prompts,
            "nested": pa.array([{"a": i, "b": [i, i]} for i in range(n)]),
            "blob": pa.array([bytes([i, 0, 255]) for i in range(n)], pa.binary()),
            "temperature": [None, 0.0, -1.0, None, None, None, None, None],
            "max_new_tokens": [None, 2, None, 0, None, None, None, None],
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    spec = _spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out", logprobs=True)
    report = run_job(spec)
    out = pq.read_table(tmp_path / "out")
    assert out.num_rows == n and report.rows_written == n
    rows = _by_id(out)
    for i in range(n):  # odd extra columns come back untouched
        assert rows[f"r{i}"]["nested"] == {"a": i, "b": [i, i]}
        assert rows[f"r{i}"]["blob"] == bytes([i, 0, 255])
    ok = rows["r0"]
    assert ok["error"] is None and ok["finish_reason"] in ("stop", "length")
    assert ok["num_output_tokens"] == len(ok["output_token_ids"]) == len(ok["output_logprobs"])
    assert isinstance(ok["generated_text"], str) and ok["num_prompt_tokens"] > 1
    assert rows["r1"]["num_output_tokens"] <= 2  # per-row max_new_tokens
    assert "temperature" in rows["r2"]["error"]
    assert "max_new_tokens" in rows["r3"]["error"]
    assert "null" in rows["r5"]["error"] and "empty" in rows["r6"]["error"]
    assert "context limit" in rows["r7"]["error"]
    assert report.rows_with_error == 5
    saved = (tmp_path / "out" / "_k3batch_report.json").read_text()
    assert '"rows_written": 8' in saved and '"stage_s"' in saved


def _run_at_once(*specs: JobSpec) -> list:
    """run_job of each spec, all at once from threads of this driver (each job starts its own
    replicas, most of a small job's time); their reports in the same order."""
    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(run_job, specs))


def test_messages_and_token_id_jobs(cluster, mini_model_dir, tmp_path):
    msgs = [[{"role": "user", "content": p}] for p in _prompts(3)] + [
        [{"role": "user", "content": None}]
    ]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    ids = [[5, 6, 7], [-1, 3], [3, 512], [], None, [1] * 200]
    pq.write_table(
        pa.table({"prompt_token_ids": pa.array(ids, pa.list_(pa.int64()))}),
        tmp_path / "ids.parquet",
    )
    _run_at_once(
        _spec(mini_model_dir, tmp_path / "chat.parquet", tmp_path / "out_chat", name="chat"),
        _spec(mini_model_dir, tmp_path / "ids.parquet", tmp_path / "out_ids", name="ids"),
    )
    rows = pq.read_table(tmp_path / "out_chat").to_pylist()
    assert [r["error"] is None for r in rows] == [True, True, True, False]
    rows = pq.read_table(tmp_path / "out_ids").to_pylist()
    assert rows[0]["error"] is None and rows[0]["num_prompt_tokens"] == 3
    assert "-1" in rows[1]["error"] and "512" in rows[2]["error"]
    assert "empty" in rows[3]["error"] and "null" in rows[4]["error"]
    assert "context limit" in rows[5]["error"]


def test_duplicate_ids_corrupt_file_and_resume(cluster, mini_model_dir, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": ["a", "b", "a"], "prompt": _prompts(3)}), inp / "1.parquet")
    (inp / "2.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(pa.table({"id": ["c", "b"], "prompt": _prompts(2, 1)}), inp / "3.parquet")
    spec = _spec(mini_model_dir, inp, tmp_path / "out")
    report = run_job(spec)
    assert len(report.unreadable_inputs) == 1 and "2.parquet" in report.unreadable_inputs[0]
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert len(rows) == 5
    dup = [r for r in rows if r["error"] and "duplicate" in r["error"]]
    assert len(dup) == 2 and {r["id"] for r in dup} == {"a", "b"}
    again = run_job(spec)  # resume: nothing left but the corrupt file
    assert again.rows_written == 0 and again.rows_skipped_resumed == 5
    assert pq.read_table(tmp_path / "out").num_rows == 5


def _write_in(t, table):
    pq.write_table(table, t / "in.parquet")


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda s, t: _write_in(t, pa.table({"text": ["x"]})) or s, "no prompt column"),
        (
            lambda s, t: _write_in(t, pa.table({"prompt": pa.array([], pa.string())})) or s,
            "no rows",
        ),
        (lambda s, t: _write_in(t, pa.table({"prompt": ["x"], "error": ["y"]})) or s, "clash"),
        (lambda s, t: (t / "out").write_text("a file") and s, "out"),
        (lambda s, t: replace(s, sampling=SamplingParams(top_p=1.5)), "sampling.top_p"),
        (lambda s, t: replace(s, sampling=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (lambda s, t: replace(s, sampling=SamplingParams(temperature=-1)), "temperature"),
        (lambda s, t: replace(s, model=str(t)), "config.json"),
        (lambda s, t: replace(s, replicas=ReplicaSpec(pp=10)), "pp = 10 must be in .* = 9"),
        (lambda s, t: replace(s, replicas=ReplicaSpec(pp=2, pp_layers=(4, 4))), "summing to 9"),
        (lambda s, t: replace(s, replicas=ReplicaSpec(tp=3)), "tp_size = 3"),
        (lambda s, t: replace(s, replicas=ReplicaSpec(tp=2, dcp=4)), "dcp"),
        (lambda s, t: replace(s, input=InputSpec(path=str(t / "nothing*.parquet"))), "nothing"),
    ],
    ids=[
        "no-prompt-column",
        "empty-dataset",
        "column-clash",
        "output-not-writable",
        "top-p",
        "max-new-tokens",
        "temperature",
        "no-model",
        "pp-too-large",
        "pp-layers",
        "tp",
        "dcp",
        "no-input-files",
    ],
)
def test_bad_jobs_fail_before_any_replica_starts(mini_model_dir, tmp_path, edit, match):
    _write_in(tmp_path, pa.table({"prompt": ["hi"]}))
    spec = edit(_spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out"), tmp_path)
    with pytest.raises(ValueError, match=match):
        run_job(spec)


def test_other_jobs_output_is_refused(cluster, mini_model_dir, tmp_path):
    pq.write_table(pa.table({"prompt": _prompts(2)}), tmp_path / "in.parquet")
    run_job(_spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out"))
    other = _spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out", max_new_tokens=9)
    with pytest.raises(ValueError, match="different job"):
        run_job(other)


def test_two_replicas_share_the_stream_with_bounded_memory(cluster, mini_model_dir, tmp_path):
    pq.write_table(pa.table({"prompt": _prompts(40, 3)}), tmp_path / "in.parquet", row_group_size=7)
    spec = _spec(
        mini_model_dir,
        tmp_path / "in.parquet",
        tmp_path / "out",
        replicas=2,
        inflight=4,
        batch_rows=4,
        max_new_tokens=2,
    )
    report = run_job(spec)
    assert report.rows_written == 40 and sorted(_by_id(pq.read_table(tmp_path / "out"))) == sorted(
        f"{tmp_path / 'in.parquet'}:{i}" for i in range(40)
    )
    assert all(n > 0 for n in report.rows_per_replica), report.rows_per_replica
    assert report.peak_inflight_rows <= 4  # the units held open: tests/driver/test_loop_fill.py


# Greedy tokens are compared bit for bit across runs whose batches are composed differently
# (timing, retries, kills). Batched fp32 math is not batch-invariant (a GEMM's summation order
# depends on its row count) and the random model has near-ties, so these runs decode one
# sequence at a time (max_num_seqs = 1), which makes every row's arithmetic identical: a row's
# tokens depend on its prompt alone, so one reference run serves every test below.
NUM_REF_ROWS = 24


def _write_rows(path, num_rows):
    """The first num_rows rows (ids r0, r1, ...) of the input the reference run reads."""
    ids = [f"r{i}" for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "prompt": _prompts(NUM_REF_ROWS, 5)[:num_rows]}), path)


@pytest.fixture(scope="module")
def reference(cluster, mini_model_dir, tmp_path_factory):
    """A Future of id -> greedy tokens of an uninterrupted pp = tp = 1 run over NUM_REF_ROWS
    rows: the run goes on beside the first test's own job, which reads it afterwards."""
    tmp = tmp_path_factory.mktemp("ref")
    _write_rows(tmp / "in.parquet", NUM_REF_ROWS)
    spec = _spec(mini_model_dir, tmp / "in.parquet", tmp / "ref", name="ref", batch_rows=3,
                 max_new_tokens=6, max_num_seqs=1)  # fmt: skip

    def run():
        run_job(spec)
        return {r["id"]: r["output_token_ids"] for r in pq.read_table(tmp / "ref").to_pylist()}

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run)


def _shards(out) -> int:
    return len(list(out.glob("*.parquet"))) if out.is_dir() else 0


def test_replica_death_is_retried(cluster, mini_model_dir, reference, tmp_path):
    inp = tmp_path / "in.parquet"
    _write_rows(inp, NUM_REF_ROWS)
    spec = _spec(
        mini_model_dir,
        inp,
        tmp_path / "out",
        name="killme",
        batch_rows=3,
        max_new_tokens=6,
        replicas=2,
        inflight=3,
        max_num_seqs=1,
    )

    def killer():  # once replica 0 is up and the job has committed a unit: rows are in flight
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor("killme/replica-0")
                ray.get(actor.ready.remote())
                while _shards(tmp_path / "out") == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                ray.kill(actor, no_restart=False)
                return
            except ValueError:
                time.sleep(0.2)

    t = threading.Thread(target=killer)
    t.start()
    report = run_job(spec)
    t.join()
    assert report.replica_failures >= 1
    rows = pq.read_table(tmp_path / "out").to_pylist()
    reference = reference.result()
    assert sorted(r["id"] for r in rows) == sorted(reference)
    assert all(r["output_token_ids"] == reference[r["id"]] for r in rows)


def test_resume_after_driver_sigkill(cluster, mini_model_dir, reference, tmp_path):
    inp, out = tmp_path / "in.parquet", tmp_path / "out"
    _write_rows(inp, NUM_REF_ROWS)
    job = tmp_path / "job.toml"
    job.write_text(f"""
name = "sigkill"
model = "{mini_model_dir}"
[input]
path = "{inp}"
batch_rows = 3
[output]
path = "{out}"
[sampling]
temperature = 0.0
max_new_tokens = 6
[replicas]
device = "cpu"
max_inflight_rows = 3
[engine]
max_num_seqs = 1
max_seq_len = 128
chunk_size = 64
""")
    cmd = [sys.executable, "-m", "k3batch.cli", "run", str(job), "--address", cluster.gcs_address]
    # The run is killed as soon as it has committed a unit (8 units in all), while the rows of
    # its next units are in flight: they are lost and must be generated again. (Several kills
    # in a row, at every kind of process: tests/faults/test_kill_points.py, `slow`.)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while _shards(out) == 0:
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before committing"
        assert time.monotonic() < deadline, "the run committed nothing in 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _shards(out) < NUM_REF_ROWS // 3
    assert run_job(load_job_spec(job)).is_complete  # the last run here: no new driver process
    rows = pq.read_table(out).to_pylist()
    reference = reference.result()
    assert sorted(r["id"] for r in rows) == sorted(reference)  # every id exactly once
    assert all(r["output_token_ids"] == reference[r["id"]] for r in rows)


def test_job_submitted_through_ray_jobs_completes(cluster, mini_model_dir, tmp_path):
    from k3batch.cli.submit import job_logs, job_status, submit_job

    pq.write_table(pa.table({"prompt": _prompts(5, 9)}), tmp_path / "in.parquet")
    (tmp_path / "job.yaml").write_text(
        f"name: submitted\nmodel: {mini_model_dir}\n"
        f"input: {{path: {tmp_path / 'in.parquet'}, batch_rows: 2}}\n"
        f"output: {{path: {tmp_path / 'out'}}}\n"
        "sampling: {temperature: 0.0, max_new_tokens: 3}\n"
        "replicas: {device: cpu}\nengine: {max_seq_len: 128}\n"
    )
    kw = {"address": cluster.address, "token": cluster.token}
    sid = submit_job(
        str(tmp_path / "job.yaml"), working_dir=str(tmp_path), wait=True, timeout_s=240, **kw
    )
    logs = "".join(job_logs(sid, **kw))
    assert job_status(sid, **kw) == "SUCCEEDED", logs[-3000:]
    assert "5 rows written" in logs
    assert pq.read_table(tmp_path / "out").num_rows == 5


@pytest.mark.parametrize(
    "pp,tp,dcp,disaggregate",
    [
        pytest.param(4, 1, 1, False, id="pp4"),
        # the decode group's exactness is tests/parallel/test_decode_group.py's (pp2-tp2-dcp2)
        pytest.param(4, 2, 2, False, id="pp4-tp2-dcp2", marks=pytest.mark.slow),
        pytest.param(1, 1, 1, True, id="pp1-tp1-disaggregated"),
    ],
)
def test_parallel_job_writes_the_same_tokens(
    cluster, mini_model_dir, reference, tmp_path, pp, tp, dcp, disaggregate
):
    inp = tmp_path / "in.parquet"
    _write_rows(inp, 8)
    spec = _spec(
        mini_model_dir,
        inp,
        tmp_path / "out",
        name=f"pp{pp}-tp{tp}",
        batch_rows=3,
        max_new_tokens=6,
        max_num_seqs=1,
        pp=pp,
        tp=tp,
        dcp=dcp,
        disaggregate=disaggregate,
    )
    report = run_job(spec)
    rows = pq.read_table(tmp_path / "out").to_pylist()
    want = {f"r{i}": reference.result()[f"r{i}"] for i in range(8)}
    assert {r["id"]: r["output_token_ids"] for r in rows} == want
    (pipe,) = report.pipeline
    assert len(pipe["busy"]) == pp and 0 <= pipe["bubble"] < 1
    if tp > 1 or disaggregate:
        (group,) = report.decode_groups
        assert group["handoffs"] == 8 and len(group["handoff_bytes_per_rank"]) == tp
        assert min(group["handoff_bytes_per_rank"]) > 0 and min(group["handoff_s_per_rank"]) > 0
        assert "replica 0 handoff: 8 requests" in report.summary() and "GB/s" in report.summary()
    else:
        assert not report.decode_groups


def test_shared_system_prompt_job_reports_prefix_hits(cluster, mini_model_dir, tmp_path):
    system = {"role": "system", "content": " ".join(["kimi linear attention batch"] * 4)}
    msgs = [[system, {"role": "user", "content": p}] for p in _prompts(10, 12)]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "in.parquet")
    spec = _spec(mini_model_dir, tmp_path / "in.parquet", tmp_path / "out", name="sys")
    # room for about 70 KDA blocks: no eviction, so the counts do not depend on timing
    engine = EngineConfig(max_num_seqs=2, max_seq_len=256, chunk_size=32, page_size=8,
                          cache_bytes=16 << 20)  # fmt: skip
    report, off = _run_at_once(
        replace(spec, engine=engine),
        replace(spec, name="sys-off", output=replace(spec.output, path=str(tmp_path / "off")),
                engine=replace(engine, prefix_cache=False)),
    )  # fmt: skip
    (stats,) = report.cache
    cache = stats["cache"]
    # The first chunk of the first request checkpoints the system prompt's first 32 tokens;
    # only the (at most 2) requests admitted in that same step miss.
    print(report.summary())
    assert cache["prefix_hits"] >= 8 and cache["prefix_hit_tokens"] >= 8 * 32
    assert cache["evicted_nodes"] == 0
    assert "prefix hits" in report.summary() and "prefill tokens saved" in report.summary()
    assert off.cache[0]["cache"]["prefix_hits"] == 0
    assert pq.read_table(tmp_path / "off").num_rows == 10
