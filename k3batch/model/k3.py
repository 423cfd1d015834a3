"""K3Model: Kimi K3 (and Kimi Linear) as plain single-device PyTorch.

Module names follow the official checkpoint (`model.layers.{i}.self_attn.q_proj`, ...), except
the routed experts, which are stacked per layer (see `moe.Experts`). A model may hold only a
range of layers (a pipeline stage): `embed_tokens` then exists only on the first stage and the
final AttnRes, norm and `lm_head` only on the last. The code knows nothing of Ray or process
groups. Shape legend: B sequences, T tokens, D hidden, V vocabulary.
"""

import torch
from torch import nn

from k3batch.model.attn_res import Stream, mix
from k3batch.model.forward_batch import ForwardBatch, to_device
from k3batch.model.kda import KimiDeltaAttention
from k3batch.model.layers import GatedMLP, RMSNorm, linear
from k3batch.model.mla import KimiMLAAttention
from k3batch.model.moe import SparseMoE


class Embedding(nn.Module):
    """Token embedding, not scaled. Uninitialized: weights come from a checkpoint or init.py."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device))

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype=None, device=None, expert_dtype="bf16"):
        super().__init__()
        self.layer_idx = layer_idx
        D, eps = config.hidden_size, config.rms_norm_eps
        self.block_size = config.attn_res_block_size
        if config.layer_types[layer_idx] == "kda":
            self.self_attn = KimiDeltaAttention(config, layer_idx, dtype, device)
        else:
            self.self_attn = KimiMLAAttention(config, layer_idx, dtype, device)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = SparseMoE(config, layer_idx, dtype, device, expert_dtype)
        else:
            self.mlp = GatedMLP(config, D, config.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(D, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype, device)
        if self.block_size is not None:
            self.self_attention_res_proj = linear(D, 1, dtype, device)
            self.self_attention_res_norm = RMSNorm(D, eps, dtype, device)
            self.mlp_res_proj = linear(D, 1, dtype, device)
            self.mlp_res_norm = RMSNorm(D, eps, dtype, device)

    def ffn(self, x_TD, batch, residual=None):
        """The FFN's output, plus residual when given (the MoE adds it in its last pass)."""
        if hasattr(self, "mlp"):
            y = self.mlp(x_TD)
            return y if residual is None else y + residual
        return self.block_sparse_moe(x_TD, batch, residual=residual)

    def forward(self, stream: Stream, batch: ForwardBatch, cache=None) -> Stream:
        if self.block_size is None:  # Kimi Linear: pre-norm residual in stream.partial
            h = stream.partial
            a = self.self_attn(self.input_layernorm(h), batch, cache)
            x, h = self.post_attention_layernorm(a, residual=h)  # h + a and its norm, one pass
            return Stream(partial=self.ffn(x, batch, residual=h))
        bank, p = stream.bank, stream.partial
        h = mix(stream, self.self_attention_res_proj, self.self_attention_res_norm)
        if self.layer_idx % self.block_size == 0:  # the partial sum is a finished block
            bank, p = bank + [p], None
        a = self.self_attn(self.input_layernorm(h), batch, cache)
        p = a if p is None else p + a
        h = mix(Stream(bank, p), self.mlp_res_proj, self.mlp_res_norm)
        p = p + self.ffn(self.post_attention_layernorm(h), batch)
        return Stream(bank, p)


class K3Model(nn.Module):
    """The whole model or the layers [first_layer, last_layer) of it.

    `forward(input_ids [B, T])` is the plain API: a full causal forward from an empty cache,
    returning logits [B, T, V]. The engine calls `forward_batch` with packed tokens, a
    `ForwardBatch` and a cache. `expert_dtype`: "bf16" (routed experts in `dtype`) or "mxfp4"
    (kept packed, see `moe.Experts`).
    """

    def __init__(
        self, config, *, layer_range: tuple[int, int] | None = None, dtype=None, device=None,
        expert_dtype: str = "bf16",
    ):  # fmt: skip
        super().__init__()
        self.config = config
        first, last = layer_range or (0, config.num_hidden_layers)
        self.layer_range = (first, last)
        D, eps = config.hidden_size, config.rms_norm_eps
        self.model = nn.Module()
        if first == 0:
            self.model.embed_tokens = Embedding(config.vocab_size, D, dtype, device)
        self.model.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(config, i, dtype, device, expert_dtype)
                for i in range(first, last)
            }
        )
        if last == config.num_hidden_layers:
            self.model.norm = RMSNorm(D, eps, dtype, device)
            if config.has_attn_res:
                self.model.output_attn_res_proj = linear(D, 1, dtype, device)
                self.model.output_attn_res_norm = RMSNorm(D, eps, dtype, device)
            self.lm_head = linear(D, config.vocab_size, dtype, device)

    @property
    def is_first(self) -> bool:
        return self.layer_range[0] == 0

    @property
    def is_last(self) -> bool:
        return self.layer_range[1] == self.config.num_hidden_layers

    def set_backend(self, backend: str) -> "K3Model":
        """'torch' (reference ops) or 'fla' (fla-core kernels for KDA, Triton kernels for MLA
        where the tensors are on CUDA) for the attention layers."""
        for m in self.modules():
            if isinstance(m, KimiDeltaAttention):
                m.backend = backend
            elif isinstance(m, KimiMLAAttention):
                m.backend = "torch" if backend == "torch" else "auto"
        return self

    def warm_up(self, max_tokens: int) -> None:
        """Tune ahead what the kernels tune by batch size, for batches of up to max_tokens
        tokens (the KDA layers share one shape: the first one's)."""
        kda = next((m for m in self.modules() if isinstance(m, KimiDeltaAttention)), None)
        if kda is not None:
            kda.warm_up(max_tokens)

    def embed(self, input_ids_T) -> Stream:
        e = self.model.embed_tokens(input_ids_T)
        return Stream(partial=e)  # b_0 is banked by layer 0

    def run_layers(self, stream: Stream, batch: ForwardBatch, cache=None) -> Stream:
        if cache is not None:
            cache.bind(batch)
        for layer in self.model.layers.values():
            stream = layer(stream, batch, cache)
        return stream

    def final_hidden(self, stream: Stream):
        """RMSNorm_final(AttnRes_out(bank, partial)) [T, D]."""
        if self.config.has_attn_res:
            h = mix(stream, self.model.output_attn_res_proj, self.model.output_attn_res_norm)
        else:
            h = stream.partial
        return self.model.norm(h)

    def forward_batch(
        self, input_ids_T, batch: ForwardBatch, cache=None, *, all_logits: bool = False
    ):
        """Whole-model forward on packed tokens. Returns logits [num_seqs, V] at each
        sequence's last new token, or [T, V] for every token with all_logits."""
        stream = self.run_layers(self.embed(input_ids_T), batch, cache)
        h = self.final_hidden(stream)
        if not all_logits and batch.num_tokens != batch.num_seqs:
            h = h[to_device(batch.last_token_idx, h.device)]
        return self.lm_head(h)

    def forward(self, input_ids):
        """input_ids [B, T] -> logits [B, T, V]: a full causal forward from an empty cache."""
        B, T = input_ids.shape
        batch = ForwardBatch.fresh([T] * B)
        logits = self.forward_batch(input_ids.reshape(-1), batch, all_logits=True)
        return logits.view(B, T, -1)
