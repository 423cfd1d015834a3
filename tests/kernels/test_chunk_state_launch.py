"""The chunk-state kernel's V block: narrower where 64-wide blocks would leave most SMs idle."""

import torch

from k3kernels.kda import chunk_state


def test_pick_block_v_fills_the_gpu(monkeypatch):
    monkeypatch.setattr(chunk_state, "_num_sms", lambda device: 132)  # an H100 / H200
    cuda = torch.device("cuda")
    pick = chunk_state.pick_block_v
    assert pick(1, 96, 128, cuda) == 64  # k3-slice, one 8K prompt: 192 programs
    assert pick(1, 32, 128, cuda) == 32  # Kimi Linear, one prompt: 128 programs, not 64
    assert pick(64, 32, 128, cuda) == 64  # Kimi Linear, 64 prompts
    assert pick(1, 4, 128, cuda) == 16  # never under 16 (tl.dot's least tile)
    assert pick(1, 32, 128, torch.device("cpu")) == chunk_state.BLOCK_V
