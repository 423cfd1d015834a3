"""Which Triton kernels this process compiled, counted by name: Triton calls
`knobs.runtime.jit_post_compile_hook` after each launch that missed its in-memory cache (a new
specialization of a kernel: built from source, or read from Triton's disk cache). `watch`
installs a hook that counts them (once per process, chained to a hook already there); `take`
returns the counts since the last take and clears them. The replica's step account names the
kernels compiled in its slowest steps (`actors.serve.StepAccount`), so a slow step says whether
a compile made it slow (a cold Kimi Linear job on one H100: a 3.85 s prefill step, the MoE's
block_rows_kernel compiling for a pattern of its size arguments that no warm-up batch had).
"""

import threading
from collections import Counter

_counts: Counter = Counter()
_lock = threading.Lock()  # the engine thread compiles; another thread may take
_watching = False


def watch() -> bool:
    """Count this process's compiles from now on; False where Triton has no such hook."""
    global _watching
    if _watching:
        return True
    try:
        from triton import knobs

        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def counted(*, fn, **kwargs):
        with _lock:
            _counts[fn.name] += 1
        return previous(fn=fn, **kwargs) if previous else None

    runtime.jit_post_compile_hook = counted
    _watching = True
    return True


def take() -> dict[str, int]:
    """{kernel name: compiles} since the last take (or since `watch`), then cleared."""
    with _lock:
        taken = dict(_counts)
        _counts.clear()
    return taken
