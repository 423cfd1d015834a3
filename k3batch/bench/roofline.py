"""Rooflines: the least time a piece of work needs on one GPU, its FLOPs at the bf16 GEMM peak
or its bytes at the copy bandwidth, whichever is longer (`roofline_ms`; the peaks are the H200's
measured here unless given, `gpu_rates` names another GPU's); the decode step's,
component by component (`decode_floor`); and the prefill's useful FLOPs, 2 x `active_params` per
token, which `bench engine`'s MFU divides by the peak.

Every count walks the parameters of a model of the config (meta device), so each flavor's own
tensors are what is counted: q LoRA or a single q_proj, the MLA output gate or none, AttnRes or
none, latent or full-width experts, MLA and KDA at the config's layer indices.

A decode step of B sequences must read every weight outside the routed experts once
(attention, dense FFN, shared experts, routers, norms, AttnRes, the LM head; of the embedding
only B rows), each routed expert that some token of the step selected once (however many
tokens chose it), each sequence's KDA recurrent state (fp32) and conv states twice (read, then
written back), and each sequence's MLA latents (every cached token, plus the new one written).
Its FLOPs: 2 B per weight outside the routed experts and the embedding, 2 B k per weight of
one expert per MoE layer (top-k), and the absorbed MLA's scores and values over each
sequence's cached tokens (2 (576 + 512) per token and head at K3's widths). The KDA recurrence
does a few FLOPs per byte of state, far under the ridge, so it counts as bytes alone. Each
component's floor is the longer of its two times, and the step's is their sum (the components
run one after another). At a few sequences every component is bound by its bytes; at 256 the
dense weights are bound by their FLOPs (2 x 256 FLOPs per 2-byte weight, above the ridge of
777 / 4.26 = 182). Everything else (the activations, the logits, the small ops) is left out:
the floor is a lower bound.
"""

from dataclasses import dataclass

import torch

COPY_TBPS = 4.26  # device-to-device copy measured on the H200 (bytes read + written)
BF16_TFLOPS = 777.0  # dense bf16 GEMM measured on the H200

COMPONENTS = ("dense", "experts", "kda", "mla")


def roofline_ms(flops: float, nbytes: float, tflops: float = BF16_TFLOPS,
                tbps: float = COPY_TBPS) -> float:  # fmt: skip
    """The longer of the FLOPs at the bf16 peak and the bytes at the copy bandwidth."""
    return max(flops / tflops / 1e9, nbytes / tbps / 1e9)


def gpu_rates(name: str) -> tuple[float, float]:
    """(TFLOP/s, TB/s) that GPU `name`'s work is taken against: the H200's measured here; another
    catalogued GPU (`sim.cluster.GPUS`, matched by name: "NVIDIA H100 80GB HBM3" is h100) at its
    datasheet's rates derated to the fractions the H200 reaches of its own
    (`sim.cluster.derated`); anything else (the CPU) the H200's."""
    from k3batch.sim.cluster import GPUS, derated

    words = name.lower().removeprefix("nvidia ").split()
    gpu = GPUS.get(words[0] if words else "")
    if gpu is None:
        return BF16_TFLOPS, COPY_TBPS
    gpu = derated(gpu)
    return gpu.bf16_flops / 1e12, gpu.hbm_bytes_per_s / 1e12


def gpu_name(device="cuda") -> str:
    """The GPU's name ("NVIDIA H200"), or "cpu" for the CPU or where there is no GPU."""
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    return torch.cuda.get_device_name(device) if cuda else "cpu"


def device_rates(device="cuda") -> tuple[float, float]:
    """`gpu_rates` of the device (the H200's on the CPU)."""
    return gpu_rates(gpu_name(device))


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeFloor:
    bytes: dict[str, int]  # component -> bytes the step must move
    flops: dict[str, int]  # component -> FLOPs it must do (0 for the KDA states)
    tflops: float = BF16_TFLOPS  # the peaks the floor is taken at (`gpu_rates`)
    tbps: float = COPY_TBPS

    def ms(self) -> dict[str, float]:
        return {c: roofline_ms(self.flops[c], self.bytes[c], self.tflops, self.tbps)
                for c in COMPONENTS}  # fmt: skip

    def floor_ms(self) -> float:
        return sum(self.ms().values())


def _is_routed(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


def decode_floor(model, *, context_lens: list[int], experts_selected: dict[int, int],
                 tflops: float = BF16_TFLOPS, tbps: float = COPY_TBPS) -> DecodeFloor:  # fmt: skip
    """Bytes and FLOPs of one decode step of `model` (a K3Model or a pipeline stage of one, any
    device, meta included; only the layers it holds count) over sequences with `context_lens`
    tokens already cached; experts_selected: MoE layer index -> number of distinct routed
    experts the step's tokens chose there; tflops, tbps: the peaks its floor is taken at."""
    cfg = model.config
    B = len(context_lens)
    dense = dense_params = 0
    routed: dict[int, int] = {}
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if _is_routed(name):
            layer = int(name.split(".")[2])
            routed[layer] = routed.get(layer, 0) + nbytes
        elif name == "model.embed_tokens.weight":
            dense += B * p.shape[1] * p.element_size()
        else:
            dense += nbytes
            dense_params += p.numel()
    E, k, I = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    experts = sum(experts_selected.get(layer, 0) * n // E for layer, n in routed.items())
    D = cfg.routed_expert_hidden_size or cfg.hidden_size
    expert_flops = len(routed) * 2 * B * k * 3 * D * I
    # the model dtype (conv states and latents): a norm's, since a stage's first parameter may be
    # an fp32 A_log; the KDA and MLA layers are those the model (or stage) holds
    layers = model.model.layers
    act_bytes = next(iter(layers.values())).input_layernorm.weight.element_size()
    C, W = cfg.kda_proj_size, cfg.short_conv_kernel_size
    per_kda = cfg.kda_num_heads * cfg.kda_head_dim**2 * 4 + 3 * C * (W - 1) * act_bytes
    kda = 2 * B * per_kda * sum(str(i) in layers for i in cfg.kda_layer_ids)
    tokens = sum(n + 1 for n in context_lens) * sum(str(i) in layers for i in cfg.mla_layer_ids)
    mla_flops = tokens * cfg.num_attention_heads * 2 * (cfg.mla_latent_size + cfg.kv_lora_rank)
    return DecodeFloor(
        bytes={"dense": dense, "experts": experts, "kda": kda,
               "mla": tokens * cfg.mla_latent_size * act_bytes},
        flops={"dense": 2 * B * dense_params, "experts": expert_flops, "kda": 0, "mla": mla_flops},
        tflops=tflops, tbps=tbps,
    )  # fmt: skip


def active_params(config) -> int:
    """Parameters a token meets in a forward: every parameter but the embedding (a row lookup),
    with the routed experts at top-k of E (the shared experts whole). 2 x this is the useful
    FLOPs of one prefill token (no attention scores, no KDA recurrence); kimi-linear: 3.11 B."""
    from k3batch.model import K3Model

    with torch.device("meta"):
        model = K3Model(config)
    total = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    idle = config.num_experts - config.num_experts_per_token
    for layer in model.model.layers.values():
        if hasattr(layer, "block_sparse_moe"):
            ex = layer.block_sparse_moe.experts
            total -= idle * (ex.w13.numel() + ex.w2.numel()) // config.num_experts
    return total


class RouteCounter:
    """Counts the distinct routed experts each MoE layer selects during the forwards run while
    it is installed (forward hooks on the routers): `with RouteCounter(model) as rc: ...`,
    then `rc.selected` (layer index -> distinct experts in the last forward)."""

    def __init__(self, model):
        self.model, self.selected, self._handles = model, {}, []

    def __enter__(self):
        for idx, layer in self.model.model.layers.items():
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                hook = self._hook(int(idx))
                self._handles.append(moe.gate.register_forward_hook(hook))
        return self

    def _hook(self, layer: int):
        def record(module, args, out):
            ids = out[0]
            self.selected[layer] = int(torch.unique(ids).numel())

        return record

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
