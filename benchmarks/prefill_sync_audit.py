"""Every place one eager prefill forward would make the host wait for a CUDA GPU, found on the
CPU (the GPU counterpart, which counts what actually synchronized, is prefill_host_gpu.py).

    TRITON_INTERPRET=1 python benchmarks/prefill_sync_audit.py --flavor kimi-linear-debug --seqs 1 4

Builds the flavor on the CPU in fp32 with random weights, takes the kernel path the GPU takes
where the CPU would take the torch one (KDA through fla-core, MLA, norms, activations, AttnRes,
routing and the MoE grouped GEMMs through our Triton kernels, all under Triton's interpreter;
fla's autotuners take their first config), and runs one prefill of `--seqs` sequences of
`--tokens` tokens each through `forward_batch` with a paged cache, as the engine does.

On the CPU every tensor lives on one device, so the tool emulates two: a tensor is a *host*
tensor if it was made by a factory without a device (`torch.tensor(list)`, `torch.arange(n)`)
or computed from host tensors only; every other tensor (weights, inputs, the cache, anything
computed from them) is a *device* tensor. A TorchDispatchMode carries the tag through every op;
`.to(device)` of a host tensor makes a device one. Recorded, with the innermost frame of
k3batch, k3kernels or fla and the k3batch/k3kernels frame that called it:
  sync      reads of a device tensor on the host (item, bool, int, float, index, tolist, cpu,
            numpy, _local_scalar_dense), ops whose output size depends on device data (nonzero,
            unique, masked_select, boolean indexing, repeat_interleave without output_size,
            bincount, equal), and blocking host-to-device copies (`torch.tensor(list,
            device=...)`, `.to(device)` / `copy_` without non_blocking): the stream drains.
  h2d       non-blocking copies of host tensors to the device: no wait for the GPU, but host
            work per copy (from pageable memory the driver stages the bytes).
Also counted per forward: Triton launches and device aten ops (kernels the host enqueues).
Frames inside Triton's interpreter are not counted (its argument copies are CPU-only).
"""

import argparse
import collections
import contextlib
import functools
import linecache
import os
import re
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST = "_k3_host"  # attribute set on host tensors
OURS = ("/k3batch/", "/kernels/", "/k3kernels/")
SEEN = OURS + ("/fla/",)
DATA_DEPENDENT = {
    "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "unique_dim_consecutive", "masked_select", "bincount", "equal", "is_nonzero",
    "_local_scalar_dense", "histc",
}  # fmt: skip
VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "as_strided", "select", "slice", "t", "transpose",
    "permute", "unsqueeze", "squeeze", "expand", "split", "split_with_sizes", "unbind",
    "alias", "detach", "view_as_real", "view_as_complex", "lift_fresh", "unfold", "narrow",
    "diagonal", "_reshape_alias", "chunk", "set_", "sym_size", "sym_stride", "sym_numel",
    "is_same_size", "_has_compatible_shallow_copy_type", "sym_storage_offset",
}  # fmt: skip


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, HOST, False)


def set_host(t, value: bool = True):
    if isinstance(t, torch.Tensor):
        try:
            setattr(t, HOST, value)
        except (AttributeError, RuntimeError):
            pass
    return t


class Recorder:
    """Counts per (site, op); `active` only inside the audited forward."""

    def __init__(self):
        self.counts = collections.Counter()
        self.totals = collections.Counter()
        self.active = False
        self.depth = 0  # > 0 inside a Python-level wrapper (no double count at dispatch)

    def site(self):
        """'fla/...:line < kernels/...:line' for the caller, None inside Triton's interpreter
        (or outside the model). Walks the frames by hand: extract_stack is too slow per op."""
        inner, ours = None, None
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if name == __file__ or "/torch/" in name:
                f = f.f_back
                continue
            if inner is None and "/triton/" in name:
                return None
            if any(s in name for s in SEEN):
                inner = inner or (name, f.f_lineno)
                if "/fla/" not in name:
                    ours = (name, f.f_lineno)
                    break
            elif inner is None and "/site-packages/" not in name:
                return None  # the audit's own setup
            f = f.f_back
        if inner is None:
            return None

        def short(frame):
            path, line = frame
            for root, short_root in (("/k3batch/", "k3batch/"), ("/k3kernels/", "kernels/"),
                                     ("/kernels/", "kernels/"), ("/fla/", "fla/")):  # fmt: skip
                if root in path:
                    path = short_root + path.split(root, 1)[1]
                    break
            return f"{path}:{line}"

        where = short(inner)
        if ours is not None and ours != inner:
            where += f" < {short(ours)}"
        return where

    def record(self, kind: str, op: str):
        if not self.active:
            return
        where = self.site()
        if where is not None:
            self.counts[(kind, where, op)] += 1


REC = Recorder()


class HostTagMode(TorchDispatchMode):
    """Carries the host tag through every aten op and records the device ops that would
    synchronize (data-dependent sizes) or launch a kernel."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = [a for a in _flatten((args, kwargs)) if isinstance(a, torch.Tensor)]
        out = func(*args, **kwargs)
        host = bool(flat) and all(is_host(a) for a in flat)
        if flat and not host and REC.active:
            self._check(name, func, args, kwargs)
        for t in _flatten(out):
            if isinstance(t, torch.Tensor):
                if host:
                    set_host(t)
                elif is_host(t) and flat:  # an in-place op on a device tensor
                    set_host(t, False)
        return out

    def _check(self, name, func, args, kwargs):
        if REC.depth == 0 and name in DATA_DEPENDENT:
            REC.record("sync", f"aten.{name}")
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in idx or ()):  # fmt: skip
                REC.record("sync", f"aten.{name} (boolean mask)")
        elif name == "repeat_interleave" and "output_size" not in kwargs:
            repeats = args[1] if len(args) > 1 else args[0]
            if (
                isinstance(repeats, torch.Tensor)
                and not is_host(repeats)
                and not _has_output_size(func, args)
            ):
                REC.record("sync", "aten.repeat_interleave (no output_size)")
        if name not in VIEW_OPS and REC.depth == 0 and REC.site() is not None:
            REC.totals["device aten ops"] += 1


def _has_output_size(func, args) -> bool:
    schema = func._schema
    names = [a.name for a in schema.arguments]
    return (
        "output_size" in names
        and len(args) > names.index("output_size")
        and args[names.index("output_size")] is not None
    )


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x


# ---- Python-level wrappers -------------------------------------------------------------------
def _wrap_method(name: str, op: str | None = None):
    orig = getattr(torch.Tensor, name)

    @functools.wraps(orig)
    def wrapper(self, *a, **k):
        if not is_host(self) and REC.active:
            REC.record("sync", op or f".{name}()")
        REC.depth += 1
        try:
            out = orig(self, *a, **k)
        finally:
            REC.depth -= 1
        if name in ("cpu", "numpy") and isinstance(out, torch.Tensor):
            set_host(out.clone() if out is self else out)
        return out

    setattr(torch.Tensor, name, wrapper)


def _names_host_device(frame) -> bool:
    """Whether the call on this frame's line passes `device=t.device` (or `.to(t.device)`) of a
    host tensor t: every device is the CPU here, so the source says which one is meant."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    for m in re.finditer(r"(?:device\s*=\s*|\.to\(\s*)([A-Za-z_][\w.]*)\.device\b", line):
        obj, *attrs = m.group(1).split(".")
        value = frame.f_locals.get(obj)
        for a in attrs:
            value = getattr(value, a, None)
        if isinstance(value, torch.Tensor):
            return is_host(value)
    return False


def _device_target(args, kwargs, frame):
    """(is a device given, is that device the host) for Tensor.to's arguments."""
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        return True, is_host(target)
    if isinstance(target, (str, torch.device, int)) and not isinstance(target, bool):
        return True, target == "cpu" or _names_host_device(frame)
    return False, False


def _wrap_to():
    orig = torch.Tensor.to

    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        given, to_host = _device_target(args, kwargs, sys._getframe(1))
        non_blocking = kwargs.get("non_blocking", False)
        out = orig(self, *args, **kwargs)
        if not given:
            return out
        if is_host(self) and not to_host:  # host -> device
            REC.record("h2d" if non_blocking else "sync",
                       ".to(device, non_blocking=True)" if non_blocking
                       else ".to(device) blocking H2D")  # fmt: skip
            if out is self:
                out = self.clone()
            return set_host(out, False)
        if not is_host(self) and to_host:  # device -> host
            REC.record("sync", '.to("cpu")')
            return set_host(out.clone() if out is self else out)
        return out

    torch.Tensor.to = to


def _wrap_copy():
    orig = torch.Tensor.copy_

    @functools.wraps(orig)
    def copy_(self, src, non_blocking=False):
        if is_host(src) and not is_host(self):
            REC.record("h2d" if non_blocking else "sync",
                       "copy_ H2D" + ("" if non_blocking else " blocking"))  # fmt: skip
        elif is_host(self) and isinstance(src, torch.Tensor) and not is_host(src):
            REC.record("sync", "copy_ D2H")
        return orig(self, src, non_blocking=non_blocking)

    torch.Tensor.copy_ = copy_


def _wrap_factory(name: str):
    orig = getattr(torch, name)

    @functools.wraps(orig)
    def factory(*args, **kwargs):
        device = kwargs.get("device")
        if not REC.active:  # the model, weights and cache are built on the (emulated) device
            return orig(*args, **kwargs)
        REC.depth += 1
        try:
            out = orig(*args, **kwargs)
        finally:
            REC.depth -= 1
        data = args[0] if args else kwargs.get("data")
        if name in ("tensor", "as_tensor") and isinstance(data, torch.Tensor):
            if device is None or device == "cpu" or _names_host_device(sys._getframe(1)):
                return set_host(out, is_host(data)) if out is not data else out
            if is_host(data):
                REC.record("sync", f"torch.{name}(host tensor, device=) blocking H2D")
                return set_host(out.clone() if out is data else out, False)
            return out
        if device is None or device == "cpu" or _names_host_device(sys._getframe(1)):
            return set_host(out)
        if name in ("tensor", "as_tensor"):
            REC.record("sync", f"torch.{name}(list, device=) blocking H2D")
        return set_host(out, False)

    setattr(torch, name, factory)


def install_hooks():
    for name, op in (("item", None), ("tolist", None), ("cpu", None), ("numpy", None),
                     ("__bool__", "bool(tensor)"), ("__int__", "int(tensor)"),
                     ("__float__", "float(tensor)"), ("__index__", "tensor as index")):  # fmt: skip
        _wrap_method(name, op)
    _wrap_to()
    _wrap_copy()
    for name in ("tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "randint",
                 "randn", "rand", "linspace"):  # fmt: skip
        _wrap_factory(name)
    from triton.runtime import autotuner, jit

    # The interpreter cannot time configs: every autotuned kernel takes its first config.
    autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles: [0.0] * 3)
    run = jit.JITFunction.run

    def counted_run(self, *a, **k):
        if REC.active:
            REC.totals["Triton launches"] += 1
        return run(self, *a, **k)

    jit.JITFunction.run = counted_run
    try:
        from triton.runtime.interpreter import InterpretedFunction

        irun = InterpretedFunction.run

        def counted_irun(self, *a, **k):
            if REC.active:
                REC.totals["Triton launches"] += 1
            return irun(self, *a, **k)

        InterpretedFunction.run = counted_irun
    except ImportError:
        pass


def use_gpu_paths(model):
    """The kernel choices the model makes on CUDA, taken on the CPU (under the interpreter)."""
    from k3kernels.attn_res.mix import attn_res_mix as fused_mix
    from k3kernels.moe.act import moe_act
    from k3kernels.moe.experts import fused_experts
    from k3kernels.moe.route import route
    from k3kernels.norm.rms_norm import rms_norm as fused_norm

    from k3batch.model import attn_res, layers, moe

    model.set_backend("fla")
    for m in model.modules():
        if isinstance(m, layers.nn.Module) and getattr(m, "backend", None) == "auto":
            m.backend = "triton"  # MLA: the Triton prefill kernel
    layers.rms_norm = lambda x, w, eps, residual=None: fused_norm(x, w, eps, residual=residual)
    layers.gated_act = lambda h, act, beta=4.0, lb=25.0: moe_act(
        h.reshape(-1, h.shape[-1]), act, beta, lb).view(*h.shape[:-1], -1)
    attn_res.attn_res_mix = lambda c, q, w, eps: fused_mix(c, q, w, eps)
    moe.fused_experts = functools.partial(fused_experts, use_triton=True)
    for m in model.modules():
        if isinstance(m, moe.Experts):
            m.gemm_impl = "triton"  # bf16 prefill on Hopper: grouped_gemm_triton

    def router_forward(self, x_TD, pinned_ids=None):
        logits = x_TD.float() @ self.weight.float().t()
        return route(logits, self.e_score_correction_bias, self.top_k, self.renormalize,
                     self.scaling)  # fmt: skip

    moe.Router.forward = router_forward


def audit(flavor: str, num_seqs: int, tokens: int, page_size: int = 16):
    from k3batch.cache.layout import CacheLayout
    from k3batch.cache.paged import PagedCache
    from k3batch.model import K3Model, get_flavor
    from k3batch.model.forward_batch import ForwardBatch
    from k3batch.model.init import init_random_

    config = get_flavor(flavor)
    model = init_random_(K3Model(config, dtype=torch.float32), 0).eval()
    use_gpu_paths(model)
    layout = CacheLayout.build(config, range(config.num_hidden_layers), page_size=page_size,
                               dtype_bytes=4)  # fmt: skip
    cache = PagedCache(layout, num_seqs * layout.request_bytes(tokens + 1) + (1 << 20),
                       device="cpu", dtype=torch.float32)  # fmt: skip
    pages = -(-(tokens + 1) // page_size)
    batch = ForwardBatch(seq_lens=[tokens] * num_seqs, cached_lens=[0] * num_seqs,
                         slot_ids=list(range(num_seqs)),
                         page_tables=[list(range(i * pages, (i + 1) * pages))
                                      for i in range(num_seqs)])  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (tokens * num_seqs,))
    REC.counts.clear()
    REC.totals.clear()
    t0 = time.perf_counter()
    with torch.inference_mode(), HostTagMode():
        REC.active = True
        try:
            logits = model.forward_batch(ids, batch, cache)
        finally:
            REC.active = False
    seconds = time.perf_counter() - t0
    assert torch.isfinite(logits).all()
    return dict(REC.counts), dict(REC.totals), seconds


def print_table(flavor, num_seqs, tokens, counts, totals, seconds, out=sys.stdout):
    layers = f"{flavor}, {num_seqs} x {tokens} tokens"
    syncs = sum(n for (kind, _, _), n in counts.items() if kind == "sync")
    h2d = sum(n for (kind, _, _), n in counts.items() if kind == "h2d")
    print(f"== {layers}: {syncs} syncs, {h2d} async H2D copies per forward; "
          + ", ".join(f"{k} {v}" for k, v in sorted(totals.items()))
          + f" ({seconds:.0f} s on the CPU)", file=out)  # fmt: skip
    rows = sorted(counts.items(), key=lambda kv: (kv[0][0] != "sync", -kv[1], kv[0][1]))
    print(f"{'kind':5} {'count':>5}  {'op':44} site", file=out)
    for (kind, where, op), n in rows:
        print(f"{kind:5} {n:5d}  {op:44} {where}", file=out)
    out.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", nargs="+", default=["kimi-linear-debug"])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run under Triton's interpreter)")
    torch.set_num_threads(1)
    install_hooks()
    for flavor in args.flavor:
        for n in args.seqs:
            print_table(flavor, n, args.tokens, *audit(flavor, n, args.tokens))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
