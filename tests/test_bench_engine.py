"""`k3batch bench engine` on CPU at tiny shapes: on a checkpoint (`--model`), its experts as
stored (MXFP4 packed) or dequantized, with a chosen grouped GEMM for bf16 experts; the row names
what ran; the numbers are positive."""

import pytest

from k3batch.bench import engine_throughput


@pytest.mark.parametrize("expert_dtype,held,gemm", [(None, "mxfp4", "auto"),
                                                   ("bf16", "float32", "torch")])  # fmt: skip
def test_bench_engine_on_a_checkpoint(mini_model_dir, expert_dtype, held, gemm):
    row = engine_throughput("ignored", device="cpu", batch=2, prompt_len=12, new_tokens=3,
                            chunk_size=16, expert_dtype=expert_dtype, model_dir=mini_model_dir,
                            moe_gemm=gemm)  # fmt: skip
    assert row["model"] == mini_model_dir and row["flavor"] is None
    assert row["expert_dtype"] == held and row["moe_gemm"] == gemm
    assert row["prefill_tokens_per_s"] > 0 and row["decode_step_ms"] > 0
