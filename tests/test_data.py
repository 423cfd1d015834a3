"""The Ray Data interface (`k3batch.data.generate`) on the shared local Ray head with a tiny
checkpoint (k3batch.testing.K3_MINI): a Dataset in, a Dataset out with every input column and
the same output columns, row for row, as `k3batch run` writes for the same rows, bad rows
included (as error values), and settings refused before anything runs."""

import random
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from k3batch.data import generate
from k3batch.driver import run_job
from k3batch.engine.request import SamplingParams
from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaSpec
from k3batch.actors.result import result_names

GREEDY = SamplingParams(temperature=0, max_new_tokens=4)
# One request at a time: every row's arithmetic is that of a run alone, however the job and the
# Dataset cut the rows into batches, so both give the same tokens.
ENGINE = EngineConfig(max_num_seqs=1, max_seq_len=128, chunk_size=64)


def _table() -> pa.Table:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kimi", "linear", "attention", "batch"]
    good = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(5)]
    prompts = good + ["", "word " * 200, "alpha beta"]  # empty, too long, bad sampling value
    n = len(prompts)
    return pa.table(
        {
            "id": [f"r{i}" for i in range(n)],
            "prompt": prompts,
            "extra": pa.array([{"a": i} for i in range(n)]),
            "max_new_tokens": [None, 2, None, None, 3, None, None, None],
            "temperature": [None] * (n - 1) + [-1.0],
        }
    )


def test_generate_dataset_matches_job_row_for_row(cluster, mini_model_dir, tmp_path):
    table = _table()
    pq.write_table(table, tmp_path / "in.parquet")
    job = JobSpec(
        model=mini_model_dir,
        input=InputSpec(path=str(tmp_path / "in.parquet"), batch_rows=4),
        output=OutputSpec(path=str(tmp_path / "out"), logprobs=True),
        sampling=GREEDY,
        replicas=ReplicaSpec(device="cpu"),
        engine=ENGINE,
    )
    with ThreadPoolExecutor(1) as pool:  # the job goes on beside the Dataset (own replicas)
        report = pool.submit(run_job, job)
        ds = generate(ray.data.from_arrow(table), model=mini_model_dir, sampling=GREEDY,
                      engine=ENGINE, batch_size=3, device="cpu", logprobs=True)  # fmt: skip
        out = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    assert report.result().is_complete
    expected = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    names = result_names(logprobs=True, prompt_logprobs=False)
    assert out.schema.names == table.schema.names + names
    got = {r["id"]: r for r in out.to_pylist()}
    assert got.keys() == expected.keys()
    for rid, row in got.items():
        assert row == expected[rid], rid  # input columns, tokens, text, errors, log-probs
    assert [got[f"r{i}"]["error"] is None for i in range(8)] == [True] * 5 + [False] * 3
    assert "empty" in got["r5"]["error"] and "context limit" in got["r6"]["error"]
    assert "temperature" in got["r7"]["error"]
    assert got["r1"]["num_output_tokens"] <= 2  # a per-row override


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"concurrency": 0}, "replicas.min_replicas = 0"),
        ({"concurrency": (2, 1)}, "min = 2 > max = 1"),
        ({"batch_size": 0}, "batch_size = 0"),
        ({"sampling": SamplingParams(top_p=0.0)}, "sampling.top_p"),
        ({"device": "cpu", "num_gpus": 1}, "a CPU job asks for no GPUs"),
    ],
    ids=["no-replicas", "min-over-max", "batch-size-0", "bad-sampling", "cpu-with-gpus"],
)
def test_generate_refuses_bad_settings(mini_model_dir, kw, words):
    with pytest.raises(ValueError, match=words):
        generate(None, model=mini_model_dir, **kw)  # checked before the Dataset is touched


def test_replica_runs_batches_at_once_and_fails_every_call_after_an_engine_failure(
    mini_model_dir,
):
    """The actor's calls are coroutines sharing one engine: two batches in flight at once give
    each row what one batch alone gives; after the engine raises, pending and later calls
    raise instead of waiting forever."""
    import asyncio

    from k3batch.data import DataReplicaActor, _spec

    spec = _spec(mini_model_dir, GREEDY, ENGINE, 1, "cpu", None, None, False, False, None)
    actor = DataReplicaActor(spec)
    table = _table().slice(0, 5)
    alone = asyncio.run(actor(table)).to_pylist()

    async def both():
        return await asyncio.gather(actor(table.slice(0, 2)), actor(table.slice(2, 3)))

    first, second = asyncio.run(both())
    assert first.to_pylist() + second.to_pylist() == alone

    def broken():
        raise RuntimeError("device lost")

    actor.engine.step = broken
    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(actor(table))
    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(actor(table))  # the engine thread is gone: fail at once


class _CrashingReplica:
    """A Data replica whose process exits at every batch (a segfault would do the same)."""

    def __init__(self, spec):
        pass

    def __call__(self, batch):
        import os

        os._exit(1)


def _bounded(fn, seconds: float = 240):
    """fn() in a thread: its exception, or a test failure if it does not end in `seconds`."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fn)
        try:
            future.result(timeout=seconds)
        except TimeoutError:
            pytest.fail(f"the pipeline did not end within {seconds} s")
        except Exception as e:
            return e
    pytest.fail("the pipeline did not fail")


def test_pipeline_whose_replica_crashes_every_time_fails_not_hangs(cluster, mini_model_dir):
    """Issue 50: Ray Data restarts a dead actor and retries its batch without a bound by
    default; a replica that dies on every batch ends the pipeline after
    `max_consecutive_failures` retries."""
    import sys

    from k3batch.data import _map, _spec

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the class goes by value
    spec = _spec(mini_model_dir, GREEDY, ENGINE, 1, "cpu", None, None, False, False, None)
    ds = ray.data.from_arrow(_table().slice(0, 2))
    err = _bounded(lambda: _map(ds, spec, 2, {"num_cpus": 1}, _CrashingReplica).materialize())
    assert "ActorDiedError" in repr(err) or "unavailable" in str(err).lower(), repr(err)[:2000]


def test_pipeline_over_a_truncated_checkpoint_fails_with_the_shard_error(cluster, mini_model_dir,
                                                                          tmp_path):  # fmt: skip
    from k3batch.testing import truncated_checkpoint

    ckpt = truncated_checkpoint(mini_model_dir, tmp_path / "ckpt")
    ds = ray.data.from_arrow(_table().slice(0, 2))
    err = _bounded(lambda: generate(ds, model=str(ckpt), sampling=GREEDY, engine=ENGINE,
                                    device="cpu").materialize())  # fmt: skip
    assert "incomplete metadata" in str(err), str(err)[-2000:]
