"""`k3batch bench layouts` runs end to end on two CPU processes (gloo, k3-debug): every layout
gives a row with positive throughput, and the computed communication volumes follow the
layouts' formulas. The numbers themselves mean nothing on CPU."""

import pytest

from k3batch.bench.layouts import LayoutBench, format_rows, run_layout_bench


@pytest.mark.slow  # 18 s of the default suite's 15 minutes; the GPU runs use the benchmark
def test_layout_bench_runs_on_two_cpu_processes():
    bench = LayoutBench(
        flavor="k3-debug", num_devices=2, device="cpu", prompt_len=24, chunk_sizes=(8, 24),
        decode_batch=2, context_len=12, decode_steps=2, repeats=1,
    )  # fmt: skip
    rows = run_layout_bench(bench)
    layouts = [(r["phase"], r["layout"], r.get("chunk_size")) for r in rows]
    assert layouts == [
        ("prefill", "pp2", 8), ("prefill", "pp2", 24), ("prefill", "tp2", 8),
        ("prefill", "tp2", 24), ("decode", "tp2", None), ("decode", "tp2-dcp2", None),
    ]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 for r in rows)
    D, L, Din = 64, 93, 32  # k3-debug hidden size, layers, expert width; fp32 on CPU
    tp = next(r for r in rows if r["layout"] == "tp2")
    # per layer: attention [T, D]; FFN: layer 0 dense [T, D], MoE [T, Din + D] fp32; 2(N-1)/N = 1
    assert tp["comm_bytes_per_1k"] == 1000 * (L * D + D + (L - 1) * (Din + D)) * 4
    pp = next(r for r in rows if r["layout"] == "pp2")
    stage2_first = 48  # split_layers(93, 2, 12): (0, 48), (48, 93): bank of 4 blocks + partial
    assert pp["comm_bytes_per_1k"] == (stage2_first // 12 + 1) * 1000 * D * 4
    assert tp["exposed_comm_ms_per_1k"] > 0 and pp["exposed_comm_ms_per_1k"] > 0
    assert "pp2" in format_rows(rows)


def test_comm_volumes_for_k3_on_8_devices():
    from click.testing import CliRunner

    from k3batch.bench.layouts import comm_bytes_per_1k
    from k3batch.cli import main
    from k3batch.model import get_flavor

    vol = comm_bytes_per_1k(get_flavor("k3"), 8)
    # 93 attention [T, D] bf16, 1 dense FFN [T, D] bf16, 92 MoE [T, 3584 + D] fp32; ring 2 * 7/8
    assert vol["tp"] == 1000 * (94 * 7168 * 2 + 92 * (3584 + 7168) * 4) * 7 // 4
    assert vol["pp"] == 8 * 1000 * 7168 * 2  # stage 8 receives 7 block summaries + partial
    out = CliRunner().invoke(main, ["bench", "comm", "--p2p-gbps", "100", "--busbw-gbps", "100"])
    assert out.exit_code == 0 and "92.83 ms" in out.output and "1.15 ms" in out.output
