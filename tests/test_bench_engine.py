"""`k3batch bench engine` on CPU at tiny shapes: on a checkpoint (`--model`), its experts as
stored (MXFP4 packed) or dequantized, with a chosen grouped GEMM for bf16 experts, or two
alternating in one process; the row names what ran; the numbers are positive."""

import pytest

from k3batch.bench import engine_throughput


@pytest.mark.parametrize("expert_dtype,held,gemm", [(None, "mxfp4", "auto"),
                                                   ("bf16", "float32", "torch"),
                                                   ("bf16", "float32", "torch,auto")])  # fmt: skip
def test_bench_engine_on_a_checkpoint(mini_model_dir, expert_dtype, held, gemm):
    row = engine_throughput("ignored", device="cpu", batch=2, prompt_len=12, new_tokens=3,
                            chunk_size=16, expert_dtype=expert_dtype, model_dir=mini_model_dir,
                            moe_gemm=gemm)  # fmt: skip
    assert row["model"] == mini_model_dir and row["flavor"] is None
    assert row["expert_dtype"] == held and row["moe_gemm"] == gemm
    assert row["prefill_tokens_per_s"] > 0 and row["decode_step_ms"] > 0
    if "," in gemm:  # an A/B: a median per GEMM, the first one's is the row's
        by = row["prefill_by_moe_gemm"]
        assert list(by) == gemm.split(",") and all(t > 0 and m >= 0 for t, m in by.values())
        assert by["torch"][0] == row["prefill_tokens_per_s"]
    else:
        assert "prefill_by_moe_gemm" not in row


def test_bench_engine_names_an_unknown_gemm():
    from click.testing import CliRunner

    from k3batch.cli import main

    out = CliRunner().invoke(main, ["bench", "engine", "--moe-gemm", "torch,cutlass"])
    assert out.exit_code == 2 and "'cutlass' is not one of auto, torch, triton" in out.output
