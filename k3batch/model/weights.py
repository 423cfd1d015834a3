"""The checkpoint layer: official safetensors names and shapes, loading into a K3Model, writing.

Official names equal our parameter names (spec section 11) except: K3 prefixes the text model
with `language_model.`; routed experts are stored per expert (`experts.{e}.w1.weight` [I, Din],
or MXFP4 `weight_packed` + `weight_scale`) while we stack them (w2 [E, Din, I]; w1 and w3 fused
into w13 [E, 2 I, Din], gate rows first); and KDA `A_log`
is stored as [head_dim] (K3) or [1, 1, H, 1] (Kimi Linear) while we keep [H] (spec 14.2).
Loading reads the index and the shard headers first and raises `ValueError` (naming the
tensor) on missing, unexpected or misshapen tensors and missing shard files before any weight
memory is allocated; it then reads shard by shard, tensor by tensor, copying each into its
parameter, so the model is never held twice.
"""

import dataclasses
import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3batch.model.config import K3Config, get_flavor
from k3batch.model.init import init_random_
from k3batch.model.k3 import K3Model
from k3batch.model.moe import note_packed_scales_
from k3kernels.moe.mxfp4 import (
    dequantize_mxfp4,
    from_word_layout,
    quantize_mxfp4_stacked,
    round_to_mxfp4_,
    to_word_layout,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
K3_PREFIX = "language_model."
# The K3 wrapper's vision parts, and multi-token prediction (spec 14.16: K3 has none).
_SKIPPED = re.compile(r"^(vision_tower|mm_projector)\.|(^|\.)mtp")
_ALT_ATTN_RES = re.compile(r"_res\.(proj|norm)_weight$")  # MLX spelling (spec 14.10)
_MAX_LISTED = 10


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One checkpoint tensor: its unprefixed name and where it goes in the model."""

    name: str  # official name without the `language_model.` prefix
    param: str  # our parameter FQN
    expert: int | None  # row of a stacked expert parameter, else None
    role: str  # "weight" (plain copy), "A_log", "packed" or "scale" (MXFP4 halves)
    shape: tuple[int, ...]  # shape in the checkpoint
    dtype: torch.dtype  # dtype in the checkpoint
    part: int | None = None  # fused w13: 0 = its gate rows (w1), 1 = its up rows (w3)

    @property
    def num_bytes(self) -> int:
        return self.dtype.itemsize * _numel(self.shape)


def expert_rows(param: torch.Tensor, entry: Entry, expert: int) -> torch.Tensor:
    """The view of stacked expert parameter `param` that checkpoint tensor `entry` fills, for
    row `expert` of the stack (the entry's own, or a rank-local index under expert parallelism)."""
    rows = param[expert]
    if entry.part is None:
        return rows
    n = rows.shape[0] // 2
    return rows.narrow(0, entry.part * n, n)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _meta_model(config: K3Config) -> K3Model:
    """The whole model in bf16 on the meta device: its parameter dtypes are the checkpoint
    dtypes (conv, A_log, dt_bias and the correction bias are fp32 params even in bf16)."""
    with torch.device("meta"):
        return K3Model(config, dtype=torch.bfloat16)


def _entries(meta: K3Model, mxfp4: bool) -> list[Entry]:
    """Every checkpoint tensor of the bf16 model `meta` (see `_meta_model`), in parameter
    order. Stacked experts [E, out, in] become E tensors: bf16 [out, in], or MXFP4 halves;
    fused w13 [E, 2 I, in] becomes the E tensors of w1, then the E of w3, each [I, in]."""
    H, K = meta.config.kda_num_heads, meta.config.kda_head_dim
    out = []
    for fqn, p in meta.named_parameters():
        if fqn.endswith(".A_log"):
            stored = (max(H, K),) if meta.config.is_k3 else (1, 1, H, 1)
            out.append(Entry(fqn, fqn, None, "A_log", stored, p.dtype))
        elif ".experts.w" in fqn:
            base, w = fqn.rsplit(".", 1)
            E, rows, cols = p.shape
            parts = ((w, None),) if w != "w13" else (("w1", 0), ("w3", 1))
            rows //= len(parts)
            halves = (("packed", (rows, cols // 2)), ("scale", (rows, -(-cols // 32))))
            for w, part in parts:
                for e in range(E):
                    name = f"{base}.{e}.{w}"
                    if not mxfp4:
                        shape = (rows, cols)
                        out.append(Entry(f"{name}.weight", fqn, e, "weight", shape, p.dtype, part))
                        continue
                    for role, shape in halves:
                        name_r = f"{name}.weight_{role}"
                        out.append(Entry(name_r, fqn, e, role, shape, torch.uint8, part))
        else:
            out.append(Entry(fqn, fqn, None, "weight", tuple(p.shape), p.dtype))
    return out


def checkpoint_manifest(config: K3Config, *, mxfp4: bool | None = None) -> dict:
    """{official name: (shape, dtype)} of every tensor in a checkpoint of `config`.

    Names carry the `language_model.` prefix for K3 configs. Routed experts are MXFP4 halves
    when `mxfp4` (default: `config.experts_mxfp4`), else bf16 [I, Din] per expert.
    """
    prefix = K3_PREFIX if config.is_k3 else ""
    mx = config.experts_mxfp4 if mxfp4 is None else mxfp4
    return {prefix + e.name: (e.shape, e.dtype) for e in _entries(_meta_model(config), mx)}


# ---- loading -----------------------------------------------------------------------------


def canonical_name(raw: str) -> str | None:
    """Official name -> the unprefixed spelling used by `Entry.name`; None for tensors that
    k3batch ignores (vision tower, projector, multi-token prediction)."""
    name = raw.removeprefix(K3_PREFIX)
    if _SKIPPED.search(name):
        return None
    return _ALT_ATTN_RES.sub(r"_res_\1.weight", name)


def read_weight_map(path) -> dict[str, str]:
    """{official tensor name: shard file name} from the index, or from a single file."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text())
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{path / INDEX_FILE} has no 'weight_map' object")
        return dict(index["weight_map"])
    if (path / SINGLE_FILE).is_file():
        with safe_open(path / SINGLE_FILE, framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise ValueError(f"no {INDEX_FILE} or {SINGLE_FILE} in {path}")


class LoadPlan(NamedTuple):
    """What to read: per shard file, (official name, entry) pairs for this model's stage."""

    path: Path
    shards: dict[str, list[tuple[str, Entry]]]


def plan_load(path, model: K3Model) -> LoadPlan:
    """Match the checkpoint's index against `model` (which may live on the meta device).

    Raises ValueError for unexpected or missing tensors, a missing shard file, or a shape
    mismatch (only shard headers are read). Tensors of other pipeline stages are skipped.
    Experts may be stored either as bf16 or as MXFP4, whatever `config.experts_mxfp4` says;
    missing ones are named in the config's form.
    """
    path, config = Path(path), model.config
    weight_map = read_weight_map(path)
    full = _meta_model(config)
    by_name = {e.name: e for mx in (False, True) for e in _entries(full, mx)}
    params = dict(model.named_parameters())
    shards: dict[str, list[tuple[str, Entry]]] = {}
    unexpected, present = [], set()
    for raw, file in weight_map.items():
        name = canonical_name(raw)
        if name is None:
            continue
        entry = by_name.get(name)
        if entry is None:
            unexpected.append(raw)
        elif holds(params, entry):
            shards.setdefault(file, []).append((raw, entry))
            present.add(name)
    if unexpected:
        raise ValueError(
            f"{len(unexpected)} unexpected tensors in {path} for this config: "
            f"{_listing(unexpected)}"
        )
    missing = []
    for entry in _entries(full, config.experts_mxfp4):
        if entry.name in present or not holds(params, entry):
            continue
        if entry.expert is not None and _alternative_complete(entry, present):
            continue
        missing.append((K3_PREFIX if config.is_k3 else "") + entry.name)
    if missing:
        raise ValueError(f"{len(missing)} tensors missing from {path}: {_listing(missing)}")
    for file, items in shards.items():
        if not (path / file).is_file():
            raise ValueError(
                f"shard file {file} (listed in {INDEX_FILE} for {items[0][0]} and "
                f"{len(items) - 1} more tensors) does not exist in {path}"
            )
        with safe_open(path / file, framework="pt") as f:
            keys = set(f.keys())
            for raw, entry in items:
                if raw not in keys:
                    raise ValueError(f"tensor {raw} is listed under {file} but that file lacks it")
                _check_shape(raw, entry, tuple(f.get_slice(raw).get_shape()), config)
    return LoadPlan(path, shards)


def _alternative_complete(entry: Entry, present: set[str]) -> bool:
    """Whether an expert weight is present in the other encoding (bf16 vs MXFP4)."""
    base = entry.name.rsplit(".", 1)[0]
    if entry.role == "weight":
        return {f"{base}.weight_packed", f"{base}.weight_scale"} <= present
    return f"{base}.weight" in present


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def holds(params: dict, entry: Entry) -> bool:
    """Whether a model with these named parameters takes checkpoint tensor `entry` (a model
    with packed experts holds `{param}_packed` / `{param}_scale` instead of `{param}`)."""
    return entry.param in params or f"{entry.param}_packed" in params


def load_expert_(params: dict, entry: Entry, e: int, t: torch.Tensor, halves: dict,
                 raw: str, copy_=None) -> str:  # fmt: skip
    """Put one routed-expert checkpoint tensor `t` into row `e` (the local expert) of the
    model's stacked expert parameters; returns the parameter's name. Packed models take MXFP4
    halves (the packed bytes put into the W4A16 kernel's word layout); a bf16 model takes bf16
    as it is and dequantizes an MXFP4 pair once both halves are in `halves` (shared across
    calls). copy_(dst, src, raw) does the copy."""
    copy_ = copy_ or (lambda dst, src, _: dst.copy_(src))
    if entry.role in ("packed", "scale") and t.dtype != torch.uint8:
        raise ValueError(f"tensor {raw}: MXFP4 data must be uint8, found {t.dtype}")
    packed = f"{entry.param}_{entry.role}"
    if f"{entry.param}_packed" in params:
        if packed not in params:
            raise ValueError(
                f"tensor {raw}: the checkpoint stores bf16 experts; load it with "
                f"expert_dtype 'bf16' (packed experts come from MXFP4 checkpoints)"
            )
        rows = expert_rows(params[packed], entry, e)
        copy_(rows, t, raw)
        if entry.role == "packed":  # into the W4A16 kernel's word layout, on the rows' device
            rows.copy_(to_word_layout(rows))
        return packed
    dst = expert_rows(params[entry.param], entry, e)
    if entry.role == "weight":
        copy_(dst, t, raw)
        return entry.param
    key = (entry.param, e, entry.part)
    pair = halves.setdefault(key, {})
    pair[entry.role] = t.to(dst.device)
    if len(pair) == 2:
        copy_(dst, dequantize_mxfp4(pair["packed"], pair["scale"], dtype=dst.dtype), raw)
        del halves[key]
    return entry.param


def check_halves_paired(halves: dict) -> None:
    if halves:  # only possible when an expert is stored both ways, one of them incomplete
        (param, e, _), pair = next(iter(halves.items()))
        raise ValueError(f"{param}[{e}]: MXFP4 {list(pair)} found without its other half")


@torch.no_grad()
def load_weights_(model: K3Model, plan: LoadPlan) -> K3Model:
    """Fill every parameter of `model` from the checkpoint, shard by shard, tensor by tensor.

    `plan` comes from `plan_load`, which checked names and shapes; values are cast to the
    parameter's dtype. Routed experts go through `load_expert_` (packed, or MXFP4
    dequantized on the parameter's device once both halves have been read).
    """
    params = dict(model.named_parameters())
    halves: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for file, items in plan.shards.items():
        with safe_open(plan.path / file, framework="pt", device="cpu") as f:
            for raw, entry in items:
                t = f.get_tensor(raw)
                if entry.expert is not None:
                    load_expert_(params, entry, entry.expert, t, halves, raw)
                elif entry.role == "A_log":
                    param = params[entry.param]
                    param.copy_(t.reshape(-1)[: param.shape[0]])
                else:
                    params[entry.param].copy_(t)
    check_halves_paired(halves)
    return note_packed_scales_(model)


def _check_shape(raw: str, entry: Entry, found: tuple, config: K3Config) -> None:
    if entry.role == "A_log":  # spec 14.2: [head_dim] (K3), [1, 1, H, 1] (Kimi Linear) or [H]
        H, K = config.kda_num_heads, config.kda_head_dim
        allowed = {(H,), (1, 1, H, 1), (max(H, K),)}
        if found not in allowed:
            raise ValueError(
                f"tensor {raw}: expected shape {list(entry.shape)} (or one of "
                f"{sorted(list(s) for s in allowed)}), found {list(found)}"
            )
    elif found != entry.shape:
        raise ValueError(f"tensor {raw}: expected shape {list(entry.shape)}, found {list(found)}")


# ---- writing -----------------------------------------------------------------------------

_TINY_SHARD_BYTES = 2 * 2**20  # splits the tiny flavors (3 to 9 MB) into several shards
_LARGE_SHARD_BYTES = 4 * 2**30


def write_checkpoint(
    model_or_config, out_dir, *, seed: int = 0, max_shard_bytes: int | None = None
) -> K3Model:
    """Write a checkpoint in the official layout (spec section 11) and return the model written.

    `model_or_config`: a whole K3Model (any dtype), or a K3Config for which an fp32 CPU model
    with `init_random_(model, seed)` weights is built. Files: config.json (`config.to_hf()`),
    generation_config.json, the tiny tokenizer, model-0000k-of-0000n.safetensors shards and
    model.safetensors.index.json. Tensors are bf16 except A_log, dt_bias, conv weights and
    e_score_correction_bias (fp32); K3 names carry `language_model.`; K3's A_log is padded to
    [head_dim] with values drawn like an untouched init (log U(1, 16), from `seed`).

    MXFP4 (`config.experts_mxfp4`) is lossy: the model's routed-expert parameters are first
    replaced IN PLACE by dequantize(quantize(w)), so that loading the checkpoint gives back
    exactly the returned model's experts. A model holding its experts packed (expert_dtype
    "mxfp4") writes their bytes as they are, and only into an MXFP4 checkpoint (ValueError
    otherwise). `max_shard_bytes` defaults to 2 MiB for models under
    256 MiB (so tiny flavors exercise the index) and 4 GiB otherwise; shards are written one at
    a time, so peak extra memory is about one shard.
    """
    if isinstance(model_or_config, K3Config):
        model = K3Model(model_or_config.validate(), dtype=torch.float32, device="cpu")
        init_random_(model, seed)
    else:
        model = model_or_config
    if not (model.is_first and model.is_last):
        raise ValueError(f"write_checkpoint needs a whole model, got layers {model.layer_range}")
    config, out_dir = model.config, Path(out_dir)
    params = dict(model.named_parameters())
    if not config.experts_mxfp4 and any(n.endswith("_packed") for n in params):
        raise ValueError("a model holding packed MXFP4 experts writes an MXFP4 checkpoint: "
                         "its config needs experts_mxfp4 = True")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.experts_mxfp4:
        _round_experts_to_mxfp4_(model)
    entries = _entries(_meta_model(config), config.experts_mxfp4)
    total_bytes = sum(e.num_bytes for e in entries)
    if max_shard_bytes is None:
        max_shard_bytes = _TINY_SHARD_BYTES if total_bytes < 256 * 2**20 else _LARGE_SHARD_BYTES
    groups = _split_shards(entries, max_shard_bytes)
    prefix = K3_PREFIX if config.is_k3 else ""
    gen = torch.Generator().manual_seed(seed)
    quantized = {}  # {param FQN: (packed, scale)} of the stacked experts being written
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for entry in group:
            tensors[prefix + entry.name] = _export(params, entry, gen, quantized)
            weight_map[prefix + entry.name] = file
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    write_side_files(config, out_dir)
    return model


def init_checkpoint(flavor: str, out_dir, seed: int, experts: str = "auto",
                    device: str = "cpu") -> K3Model:  # fmt: skip
    """Random-weight checkpoint of a named flavor (the `k3batch init-checkpoint` command).

    experts: "mxfp4" (routed experts stored packed, config.json carries the
    quantization_config), "bf16", or "auto": as the official checkpoints store them, MXFP4 for
    K3 flavors and bf16 for Kimi Linear. Returns the fp32 model written; with MXFP4 its experts
    hold their dequantized values, so loading the checkpoint in fp32 gives back exactly
    `param.to(bf16)`. device "cuda": the weights are drawn there in bf16 (k3-slice's 31 B
    parameters do not fit a host's memory in fp32; other values than the CPU's draw), MXFP4
    experts drawn packed, one expert at a time (kimi-linear's bf16 experts, 94 GB, do not fit
    an H100; packed they take 25 GB).
    """
    if experts not in ("auto", "mxfp4", "bf16"):
        raise ValueError(f"experts = {experts!r}; expected auto, mxfp4 or bf16")
    config = get_flavor(flavor)
    mxfp4 = config.is_k3 if experts == "auto" else experts == "mxfp4"
    config = dataclasses.replace(config, experts_mxfp4=mxfp4)
    if device == "cpu":
        return write_checkpoint(config, out_dir, seed=seed)
    held = "mxfp4" if mxfp4 else "bf16"
    model = K3Model(config.validate(), dtype=torch.bfloat16, device=device, expert_dtype=held)
    return write_checkpoint(init_random_(model, seed), out_dir, seed=seed)


def _split_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive groups of at most max_shard_bytes (a larger tensor gets a shard alone)."""
    groups, size = [[]], 0
    for entry in entries:
        if groups[-1] and size + entry.num_bytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.num_bytes
    return groups


@torch.no_grad()
def _round_experts_to_mxfp4_(model: K3Model) -> None:
    """Round the unpacked routed experts (packed ones are MXFP4 already)."""
    for fqn, p in model.named_parameters():
        if fqn.endswith((".experts.w13", ".experts.w2")):
            round_to_mxfp4_(p)


@torch.no_grad()
def _export(params: dict, entry: Entry, gen, quantized: dict) -> torch.Tensor:
    """The checkpoint tensor for one entry, from the model's named `params`: a fresh contiguous
    CPU tensor (safetensors refuses tensors that share storage)."""
    held = params.get(f"{entry.param}_{entry.role}")  # an expert half held packed
    if held is not None:  # the packed bytes leave the W4A16 kernel's word layout
        rows = expert_rows(held.detach(), entry, entry.expert)
        return (from_word_layout(rows) if entry.role == "packed" else rows).cpu().clone()
    param = params[entry.param]
    src = param.detach()
    if entry.expert is not None:
        src = expert_rows(src, entry, entry.expert)
    src = src.to("cpu")
    if entry.role == "A_log":
        pad = _numel(entry.shape) - src.numel()
        init_like = torch.rand(pad, generator=gen).mul(15).add(1).log()  # log U(1, 16)
        src = torch.cat([src.float(), init_like]).reshape(entry.shape)
    elif entry.role in ("packed", "scale"):  # all experts of a param are quantized at once
        if entry.param not in quantized:
            quantized.clear()
            quantized[entry.param] = tuple(t.cpu() for t in quantize_mxfp4_stacked(param))
        packed, scale = quantized[entry.param]  # rows quantize independently: slice after
        half = packed if entry.role == "packed" else scale
        return expert_rows(half, entry, entry.expert).clone()
    return src.to(dtype=entry.dtype, copy=True).contiguous()


def write_side_files(config: K3Config, out_dir: Path) -> None:
    """What a checkpoint holds beside its weights: config.json, generation_config.json and a
    tiny tokenizer of the config's vocabulary."""
    from k3batch.tokenizer import write_tiny_tokenizer  # only the writer needs it

    (out_dir / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    gen_cfg = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    write_tiny_tokenizer(
        out_dir,
        vocab_size=config.vocab_size,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
