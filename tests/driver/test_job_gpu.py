"""The batch job on GPUs writes the single-device engine's greedy tokens (issue 15): one GPU
(pp = 1), a pipeline of two stage actors (pp = 2), and the disaggregated 1+1 replica (one
prefill stage, one decode rank, the handoff over NCCL).

bf16 rounding depends on the batch a request shares, so both sides run one request at a time
(`max_num_seqs = 1`, the composition the job's CPU tests pin too). The reference is the engine
that `k3batch bench job` compares against (`build_engine` on this process's GPU), freed before
the job starts. Prompts are token ids (`k3batch.bench.job.write_random_prompts`), so no
tokenizer sits between the two sides.
"""

import gc

import pyarrow.parquet as pq
import pytest
import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.request import SamplingParams
from k3batch.testing import K3_MINI

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
ENGINE = EngineConfig(max_num_seqs=1, max_seq_len=96, chunk_size=64)


@pytest.mark.parametrize(
    "pp,disaggregate,gpus",
    [
        pytest.param(1, False, 1, id="pp1"),
        pytest.param(2, False, 2, id="pp2", marks=pytest.mark.multigpu),
        pytest.param(1, True, 2, id="pp1-tp1-disaggregated", marks=pytest.mark.multigpu),
    ],
)
def test_gpu_job_writes_the_engines_tokens(local_ray, mini_model_dir, tmp_path, pp,
                                           disaggregate, gpus):  # fmt: skip
    from k3batch.actors.build import build_engine
    from k3batch.bench.job import write_random_prompts
    from k3batch.driver.job import run_job
    from k3batch.driver.jobspec import InputSpec, JobSpec, OutputSpec, ReplicaSpec

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, has {torch.cuda.device_count()}")
    inp = tmp_path / "prompts.parquet"
    prompts = write_random_prompts(inp, 6, 40, K3_MINI.vocab_size, seed=pp)
    engine, _ = build_engine(mini_model_dir, ENGINE, device="cuda")
    want = {str(i): r.output_token_ids for i, r in enumerate(engine.generate(prompts, GREEDY))}
    del engine
    gc.collect()
    torch.cuda.empty_cache()  # the reference held most of GPU 0 (memory_fraction)

    spec = JobSpec(
        model=mini_model_dir,
        name=f"gpu-pp{pp}" + ("-pd" if disaggregate else ""),
        input=InputSpec(path=str(inp), batch_rows=2),
        output=OutputSpec(path=str(tmp_path / "out")),
        sampling=GREEDY,
        engine=ENGINE,
        replicas=ReplicaSpec(device="cuda", pp=pp, disaggregate=disaggregate),
    )
    report = run_job(spec)
    assert report.is_complete
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert {r["id"]: r["output_token_ids"] for r in rows} == want
    if disaggregate:
        (group,) = report.decode_groups
        assert group["handoffs"] == len(prompts) and min(group["handoff_s_per_rank"]) > 0
