"""Every kernel launch the interpreted CPU tests made compiles for sm_90 (`sm90.py`): the
interpreter never builds a kernel's IR, so this is the CPU suite's only view of what the
compiler accepts. Runs last (`conftest.py`); 9-15 s for the ~60 launches of tests/kernels with
an empty Triton cache on the 2-core CI machine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _compile(specs, tmp_path, *flags):
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(specs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90.py")
    out = subprocess.run([sys.executable, str(script), str(path), *flags], env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    return out.stdout


def test_kernels_compile_for_sm90(sm90_recorder, tmp_path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels run compiled here; the GPU tests compile them")
    specs = list(sm90_recorder.specs.values())
    if not specs:
        pytest.skip("no kernel ran interpreted in this session")
    _compile(specs, tmp_path)
    # the --sass report of one bf16 W4A16 launch: its main loop unpacks (PTX) and multiplies
    w4 = [s for s in specs if s["kernel"] == "w4a16_grouped_kernel"
          and s["signature"]["x_ptr"] == "*bf16"]  # fmt: skip
    if w4:
        report = _compile(w4[:1], tmp_path, "--sass")
        assert "main loop" in report and "HMMA" in report and "PRMT" in report, report


def test_sass_report_compiles_as_the_launcher_would(tmp_path):
    """The decode tile of the W4A16 kernel, with the alignment Triton's launcher tells the
    compiler at K3 widths: 16-byte loads and no local memory. Without the hints the same
    spec compiles to byte loads and spills (255 registers), which `--sass` once reported."""
    sig = {"x_ptr": "*bf16", "tok_ptr": "*i32", "q_ptr": "*u8", "s_ptr": "*u8",
           "out_ptr": "*bf16", "offs_ptr": "*i32", "N": "i32", "K": "i32", "stride_x": "i32",
           "stride_qe": "i32", "stride_qn": "i32", "stride_se": "i32", "stride_sn": "i32",
           "stride_out": "i32", "E": "i32", "beta": "fp32", "linear_beta": "fp32"}  # fmt: skip
    spec = {"module": "k3kernels.moe.w4a16", "kernel": "w4a16_grouped_kernel",
            "signature": sig, "aligned": [n for n in sig if sig[n] != "fp32" and n != "E"],
            "constexprs": {"GROUP": 32, "BLOCK_M": 16, "BLOCK_T": 0, "BLOCK_N": 128,
                           "BLOCK_K": 256, "BLOCK_E": 128, "GATHER": False, "ACT": 0, "UPCAST": False,
                           "PTX": True, "EVEN": True, "SMALL_SCALES": True},
            "num_warps": 4, "num_stages": 3}  # fmt: skip
    report = _compile([spec], tmp_path, "--sass")
    regs = int(report.split(" registers")[0].split()[-1])
    assert regs < 255 and "LDL" not in report and "LDGSTS" in report, report


def test_w4a16_decode_kernel_compiles_without_shared_memory(tmp_path):
    """The Gluon W4A16 decode kernel (`k3kernels.moe.w4a16_decode`; Gluon has no interpreter,
    so this compile is the CPU suite's only check of it): its loop feeds the MMAs from
    registers (no shared-memory loads) and it fits 3 programs an SM (<= 168 registers), whole
    and with K split (fp32 parts)."""
    from k3kernels.moe import w4a16_decode

    if w4a16_decode.gluon is None:
        pytest.skip("this Triton has no Gluon")
    sig = {"x_ptr": "*i32", "q_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*bf16",
           "offs_ptr": "*i32", "N": "i32", "K": "i32", "M": "i32", "E": "i32",
           "stride_xw": "i32", "stride_qe": "i32", "stride_qn": "i32", "stride_se": "i32",
           "stride_sn": "i32", "stride_out": "i32"}  # fmt: skip
    specs = [{"module": "k3kernels.moe.w4a16_decode", "kernel": "_w4a16_decode_kernel",
              "signature": sig | {"out_ptr": out}, "aligned": [n for n in sig if n not in ("M", "E")],
              "constexprs": {"PARTS": parts, "PDL": True}, "num_warps": 4, "num_stages": 1}
             for out, parts in (("*bf16", 1), ("*fp32", 7))]  # fmt: skip
    report = _compile(specs, tmp_path, "--sass")
    launches = [line for line in report.splitlines() if "main loop" in line]
    assert len(launches) == 2, report
    for line in launches:
        regs = int(line.split(" registers")[0].split()[-1])
        loop = line.split("main loop")[1]
        assert regs <= 168 and "HMMA" in loop and "LDS" not in loop, line
    assert "LDL" not in report, report
