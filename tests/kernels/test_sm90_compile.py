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
