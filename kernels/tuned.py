"""Tuned launch tables: per GPU model, the fastest launch config a sweep measured, by shape.

One JSON file per op and GPU model, beside the op's kernels: `kernels/<op>/tuned/<GPU>.json`,
<GPU> being `torch.cuda.get_device_name()` with spaces as underscores (NVIDIA_H200.json). It
holds one table per kernel, each a map from a key to a launch config (the kernel's launch
keyword arguments: block sizes, num_warps, num_stages):

    {"<table>": {"<shape> <size>=<n>": {config}, ..., "<fallback>": {config}}}

- table: the MoE's "bf16" and "mxfp4" grouped GEMMs (moe/tuned/), MLA's "decode" and "prefill"
  (mla/tuned/), KDA's "decode" (kda/tuned/).
- shape: the widths that fix the best launch, as name=value words after the regime where the
  kernel has one: MoE "prefill N=2048 K=2304" (one GEMM: N outputs, K inputs), MLA decode
  "H=32 L=512 R=64 page=16", MLA prefill "H=32 Dn=128 R=64 Dv=128", KDA decode "H=32 K=128
  V=128".
- size: the extent that varies from call to call, rounded up to a power of two (`size_class`):
  MoE "rows/expert", MLA and KDA decode "batch", MLA prefill "tokens".
- fallback: a key any shape may use; the MoE's "prefill" and "decode" (its tables before
  shapes were keys).

`lookup`: the entry of the key's shape whose size is nearest (in powers of two; a tie goes to
the larger), else that of a GPU with the same SMs (`SAME_SMS`), else the first fallback present,
else {}: the kernel's built-in defaults then apply. `save` (what `k3batch bench ... --sweep
--save-tuned` calls) writes one entry and keeps the others. Tables hold launches timed on bf16
inputs, and only CUDA runs read them (`gpu_path`): under TRITON_INTERPRET=1 (the CPU suite) the
kernels launch their defaults.
"""

import functools
import json
from pathlib import Path

import torch

from k3kernels import INTERPRETED


# GPU models whose SMs (count, clocks, shared memory) are another's: where a model's table has
# no entry of a shape, the other's entries of that shape apply before any fallback key. The
# H200 is the H100 SXM's 132 SMs with faster memory, so a tile tuned on one is the other's best
# or near it (a sweep on this GPU writes its own entry, which comes first).
SAME_SMS = {"NVIDIA_H200.json": "NVIDIA_H100_80GB_HBM3.json"}


def file_name(device_name: str) -> str:
    """The table file of a GPU model: "NVIDIA H200" -> "NVIDIA_H200.json"."""
    return device_name.replace(" ", "_") + ".json"


def gpu_path(directory: Path) -> Path | None:
    """The current GPU's table file in directory; None where tables are not read (no CUDA, or
    the interpreter)."""
    if INTERPRETED or not torch.cuda.is_available():
        return None
    return directory / file_name(torch.cuda.get_device_name())


@functools.cache
def load(path: Path) -> dict:
    """The tables of a file ({} if there is none); cached until `save`."""
    return json.loads(path.read_text()) if path.exists() else {}


def size_class(n: int) -> int:
    """n rounded up to a power of two (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def make_key(shape: str, size_name: str, size: int) -> str:
    """The key of shape at this size: "H=32 K=128 V=128 batch=16"."""
    return f"{shape} {size_name}={size_class(size)}"


def lookup(path: Path | None, table: str, key: str | None,
           fallback: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """The config for `key` (from `make_key`; None: fallbacks only) in this table of the file at
    path: the entry of its shape whose size is nearest, else that of the file of a GPU with the
    same SMs beside it (`SAME_SMS`), else the first fallback key present (this GPU's file
    first), else {} (and {} for path None)."""
    if path is None:
        return {}
    files = [path] + ([path.with_name(SAME_SMS[path.name])] if path.name in SAME_SMS else [])
    tables = [load(f).get(table, {}) for f in files]
    if key is not None:
        prefix = key.rpartition("=")[0] + "="  # "<shape> <size name>="
        for entries in tables:
            sizes = {int(k[len(prefix):]): k for k in entries
                     if k.startswith(prefix) and k[len(prefix):].isdigit()}  # fmt: skip
            if sizes:
                want = int(key[len(prefix):]).bit_length()
                near = min(sizes, key=lambda n: (abs(n.bit_length() - want), -n))
                return dict(entries[sizes[near]])
    return next((dict(e[k]) for e in tables for k in fallback if k in e), {})


def save(path: Path, table: str, key: str, config: dict) -> None:
    """Write config under key in this table of the file at path (created if missing), keeping
    every other entry; keys sorted, so the file diffs cleanly."""
    tables = json.loads(path.read_text()) if path.exists() else {}
    entries = tables.setdefault(table, {}) | {key: config}
    tables[table] = dict(sorted(entries.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tables, indent=2) + "\n")
    load.cache_clear()
