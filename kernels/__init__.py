"""Triton kernels of k3batch, each package beside its fp32 torch reference."""

import os

# Under TRITON_INTERPRET=1 (the CPU suite) launchers upcast bf16 for the interpreter and leave
# out inline PTX and programmatic dependent launch. Read at import, like triton.jit.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
