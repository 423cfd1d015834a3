"""What the engine sizes up front: the automatic fields of EngineConfig (0), the prefill
workspace (measured on a GPU) and the arena from what is left (`engine/runner.py`)."""

import pytest
import torch

from k3batch.engine.config import CPU_BATCH_TOKENS, CPU_MAX_NUM_SEQS, GPU_BATCH_TOKENS, EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import SamplingParams
from k3batch.engine.runner import GPU_GROUP_SEQS, MAX_AUTO_SEQS, sized


def test_automatic_fields_are_filled_per_device():
    auto = EngineConfig(chunk_size=512)
    cpu = sized(auto, cuda=False)
    assert (cpu.max_num_seqs, cpu.max_batch_tokens) == (CPU_MAX_NUM_SEQS, CPU_BATCH_TOKENS)
    assert sized(auto, cuda=True, seqs_fit=40).max_num_seqs == 40
    assert sized(auto, cuda=True, seqs_fit=10_000).max_num_seqs == MAX_AUTO_SEQS
    assert sized(auto, cuda=True, seqs_fit=0).max_num_seqs == 1
    group = sized(auto, cuda=True)  # actors: no single arena decides
    assert (group.max_num_seqs, group.max_batch_tokens) == (GPU_GROUP_SEQS, GPU_BATCH_TOKENS)
    assert sized(EngineConfig(chunk_size=9000), cuda=True).max_batch_tokens == 9000
    given = EngineConfig(max_num_seqs=3, max_batch_tokens=1024)
    assert sized(given, cuda=True, seqs_fit=100) == given
    with pytest.raises(ValueError, match="max_num_seqs = -1"):
        EngineConfig(max_num_seqs=-1).validate()
    with pytest.raises(ValueError, match="chunk_size = 512 > max_batch_tokens = 256"):
        EngineConfig(chunk_size=512, max_batch_tokens=256).validate()


def test_engine_runs_on_the_sized_config(model_factory):
    engine = Engine(model_factory("k3-mini"), EngineConfig(max_seq_len=64, chunk_size=16))
    assert engine.config.max_num_seqs == CPU_MAX_NUM_SEQS
    assert engine.config.max_batch_tokens == CPU_BATCH_TOKENS
    assert engine.runner.workspace_bytes is None  # measured on GPUs only
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=2))
    assert len(out[0].output_token_ids) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_workspace_bounds_the_largest_prefill():
    """The measured workspace covers what a real prefill of max_batch_tokens allocates beyond
    weights and arena; the arena fills the default fraction of the GPU; max_num_seqs comes
    from the arena."""
    from k3batch.model import K3Model, get_flavor
    from k3batch.model.init import init_random_

    model = K3Model(get_flavor("k3-debug"), dtype=torch.bfloat16, device="cuda")
    init_random_(model, seed=0).eval().set_backend("fla")
    cfg = EngineConfig(max_seq_len=1100, chunk_size=1024, max_batch_tokens=4096,
                       cuda_graphs=False)  # fmt: skip
    engine = Engine(model, cfg)
    ws = engine.runner.workspace_bytes
    assert ws > 0
    assert engine.config.max_num_seqs == MAX_AUTO_SEQS  # a tiny model: the arena holds more
    free, total = torch.cuda.mem_get_info()
    assert free < 0.15 * total  # the arena took the rest of the default 0.9
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prompts = [torch.randint(0, 256, (1024,)).tolist() for _ in range(4)]
    engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
    used = torch.cuda.max_memory_allocated() - base
    assert used <= ws * 1.05 + 2**20, (used, ws)
