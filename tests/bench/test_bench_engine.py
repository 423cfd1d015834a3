"""`k3batch bench engine` on CPU at tiny shapes: on a checkpoint (`--model`), its experts as
stored (MXFP4 packed) or dequantized, with a chosen grouped GEMM for bf16 experts, or two
alternating in one process; on random kimi-linear-debug weights; the row names what ran; the
numbers are positive."""

import pytest

from k3batch.bench.engine import engine_throughput


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


@pytest.mark.parametrize("expert_dtype,held", [("bf16", "float32"), ("mxfp4", "mxfp4")])
def test_bench_engine_kimi_linear_flavor_on_cpu(expert_dtype, held):
    """`bench engine --flavor kimi-linear-debug` (the kimi-linear shape at tiny widths: no
    AttnRes, q_proj, 7 MLA of 27 layers, one shared expert) on random weights, experts bf16 or
    packed: the row's roofline counts this flavor's layers (26 MoE layers of top-2 experts of
    64 x 24, 20 KDA layers of 2 x 16 x 16 fp32 state, 7 MLA layers of 40 latents)."""
    batch, prompt_len, new_tokens = 2, 12, 3
    row = engine_throughput("kimi-linear-debug", device="cpu", batch=batch,
                            prompt_len=prompt_len, new_tokens=new_tokens, chunk_size=16,
                            expert_dtype=expert_dtype)  # fmt: skip
    assert row["flavor"] == "kimi-linear-debug" and row["expert_dtype"] == held
    assert row["prefill_tokens_per_s"] > 0 and row["decode_step_ms"] > 0
    assert row["decode_flops"]["experts"] == 26 * 2 * batch * 2 * 3 * 64 * 24
    assert row["decode_bytes"]["kda"] == 2 * batch * 20 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 4)
    context = prompt_len + new_tokens // 2  # the floor's context per sequence
    assert row["decode_bytes"]["mla"] == batch * (context + 1) * 7 * 40 * 4
