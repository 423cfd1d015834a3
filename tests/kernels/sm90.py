"""The kernels' other CPU check: what the interpreter ran must also compile for the H200.

Triton's interpreter runs a kernel's Python body; it never builds its IR, so an error that only
the compiler sees (a type mismatch between two returns of a helper, a layout it cannot lower,
a bad inline-asm operand) passes the CPU suite and fails on the first GPU run. `Recorder`
notes every launch of a `k3kernels` kernel during the session (argument types, constexprs,
warps, stages); `compile_specs` compiles each distinct one for sm_90 with the pip Triton's own
ptxas, no GPU needed (run as a script: the kernels must be imported without the interpreter).
Constexprs the launchers set only because they run interpreted are given their GPU values
(`GPU_VALUES`): the interpreter's fp32 upcast off, the PTX unpacking on for bf16 activations,
programmatic dependent launch on.

Also a kernel engineer's tool without a GPU: `K3_SM90_SPECS=specs.json pytest tests/kernels -k
moe` writes the launches, then `python tests/kernels/sm90.py specs.json --sass` prints, per
launch, registers, shared memory and the instruction mix of the main loop (how the W4A16 and
MLA decode kernels were found to be bound by instruction issue: `benchmarks/kernels_h200.txt`).
Each spec carries the arguments Triton's launcher would mark divisible by 16 (`aligned`): the
compiler vectorizes loads only with them. They are those of the recorded launch, the tests' tiny
shapes; for a report at K3's shapes, list every pointer and width there (all are multiples of
16 at K3's widths): without them the W4A16 decode tile compiles to byte loads and spills.
"""

import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
           torch.uint8: "u8", torch.bool: "i1"}  # fmt: skip
# constexpr -> its value on a GPU, given the launch's signature (name -> type)
GPU_VALUES = {
    "UPCAST": lambda sig: False,
    "PTX": lambda sig: sig.get("x_ptr", "*bf16") == "*bf16",  # W4A16: bf16 activations only
    "PDL": lambda sig: True,  # `k3kernels.pdl`: off in the interpreter, on on an H200
}


def _aligned(value) -> bool:
    """Whether Triton's launcher would mark the argument divisible by 16 (it specializes on
    that: vector loads of aligned rows; without it the SASS is not the GPU run's)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _type(value) -> str:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, TensorDescriptor):  # a host-side TMA descriptor
        return f"tensordesc<{_DTYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if not -(2**31) <= value < 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


class Recorder:
    """Patches the interpreter's launch to note each `k3kernels` launch as a spec
    {module, kernel, signature, constexprs, aligned, num_warps, num_stages}; aligned: the
    arguments divisible by 16, which the compiler is told as the launcher would (`_aligned`),
    save those the kernel does not specialize. Two launches that Triton would compile apart
    give two specs."""

    def __init__(self):
        self.specs: dict[str, dict] = {}

    def install(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        run, recorder = InterpretedFunction.run, self

        def recording_run(fn, *args, grid, warmup, **kwargs):
            recorder.note(fn.fn, args, kwargs, fn.kwargs.get("do_not_specialize") or ())
            return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run

    def note(self, fn, args, kwargs, unspecialized=()) -> None:
        """unspecialized: the kernel's `do_not_specialize` names, never marked aligned."""
        if not fn.__module__.startswith("k3kernels."):
            return
        params = inspect.signature(fn).parameters
        bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
        signature, constexprs, aligned = {}, {}, []
        for name, p in params.items():
            value = bound.get(name, p.default)
            if "constexpr" in str(p.annotation):
                constexprs[name] = value
            else:
                signature[name] = _type(value)
                if _aligned(value) and name not in unspecialized:
                    aligned.append(name)
        spec = {"module": fn.__module__, "kernel": fn.__name__, "signature": signature,
                "aligned": aligned,
                "constexprs": constexprs, "num_warps": kwargs.get("num_warps", 4),
                "num_stages": kwargs.get("num_stages", 3)}  # fmt: skip
        self.specs.setdefault(json.dumps(spec, sort_keys=True), spec)


def compile_specs(specs: list[dict], sass: bool = False) -> list[str]:
    """Compile each spec for sm_90 (GPU values of interpreter-only constexprs), one process
    per CPU (ptxas runs single-threaded; ~60 launches took ~40 s one by one on 2 cores);
    returns one line per failure: kernel, constexprs and the compiler's message. sass: also
    print each kernel's registers, shared memory and the instruction mix of its main loop
    (`loop_mix`)."""
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(len(specs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        done = list(pool.map(_compile_one, specs, [sass] * len(specs)))
    for _, line in done:
        if line:
            print(line)
    return [failure for failure, _ in done if failure]


def _compile_one(spec: dict, sass: bool) -> tuple[str | None, str | None]:
    """(failure line or None, SASS summary line or None) of one spec."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    sig = spec["signature"]
    consts = {k: GPU_VALUES[k](sig) if k in GPU_VALUES else v
              for k, v in spec["constexprs"].items()}  # fmt: skip
    names = kernel.arg_names
    full = {n: sig.get(n, "constexpr") for n in names}
    # what the launcher tells the compiler: pointers and integers divisible by 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.get("aligned", ())}
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel (its own IR source)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(kernel, full, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)  # fmt: skip
    try:
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": spec["num_warps"],
                                      "num_stages": spec["num_stages"]})  # fmt: skip
    except Exception as e:  # the message is the test's output
        return (f"{spec['module']}.{spec['kernel']} {consts}: "
                f"{type(e).__name__}: {str(e)[-1500:]}"), None  # fmt: skip
    if not sass:
        return None, None
    regs, total, mix = loop_mix(out.asm["cubin"])
    loop = f"main loop {total} instructions: {mix}" if total else "no loop"
    return None, (f"{spec['kernel']} {consts} warps {spec['num_warps']} stages "
                  f"{spec['num_stages']}: {regs} registers, {out.metadata.shared} B shared; "
                  f"{loop}")  # fmt: skip


def loop_mix(cubin: bytes, top: int = 12) -> tuple[int, int, str]:
    """(registers, instructions of the longest loop, its most frequent opcodes) of a compiled
    kernel, read from its SASS (cuobjdump from the pip Triton's own tools)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", res.stdout).group(1))
    line = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
    code = [(int(m.group(1), 16), m.group(2)) for m in map(line.match, sass.splitlines()) if m]
    loop = (0, -1)  # the longest backward branch: the main loop's body
    for addr, ins in code:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", ins)
        start = int(target.group(1), 16) if target else addr
        if start < addr and addr - start > loop[1] - loop[0]:
            loop = (start, addr)
    ops = collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
        for addr, ins in code if loop[0] <= addr <= loop[1]
    )  # fmt: skip
    return regs, sum(ops.values()), ", ".join(f"{op} {n}" for op, n in ops.most_common(top))


if __name__ == "__main__":  # python sm90.py SPECS.json [--sass] (without TRITON_INTERPRET)
    assert os.environ.get("TRITON_INTERPRET") != "1", "compile without the interpreter"
    t0 = time.perf_counter()
    specs = json.loads(open(sys.argv[1]).read())
    failed = compile_specs(specs, sass="--sass" in sys.argv[2:])
    print(f"{len(specs)} launches compiled for sm_90 in {time.perf_counter() - t0:.1f} s, "
          f"{len(failed)} failed")  # fmt: skip
    print("\n\n".join(failed))
    sys.exit(1 if failed else 0)
