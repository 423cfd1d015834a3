"""Runners: what the engine calls to run one forward. A runner owns the model's caches.

Protocol: `submit(ids, batch, all_logits)` starts a forward over packed token ids and returns a
handle; `wait(handle)` returns its logits as fp32 on the CPU ([num_seqs, V], or [T, V] with
all_logits). Forwards run in submission order. `depth` is how many forwards may usefully be in
flight at once (1 on one device; the number of stages for a pipeline).
"""

import torch

from k3batch.cache.state_cache import StateCache
from k3batch.model.forward_batch import ForwardBatch


class LocalRunner:
    """The whole model on one device; a forward runs at submit time."""

    depth = 1

    def __init__(self, model, *, num_slots: int, max_seq_len: int):
        self.model, self.config = model, model.config
        p = next(model.parameters())
        self.device = p.device
        self.cache = StateCache(
            self.config,
            range(self.config.num_hidden_layers),
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            device=p.device,
            dtype=p.dtype,
        )

    @torch.inference_mode()
    def submit(self, ids: list[int], batch: ForwardBatch, all_logits: bool):
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits = self.model.forward_batch(x, batch, self.cache, all_logits=all_logits)
        return logits.float().cpu()

    def wait(self, handle):
        return handle

    def export_request(self, slot: int, num_tokens: int, layout) -> list[list[dict]]:
        """One request's caches resharded for each rank of a decode group: per rank, a list
        with one piece (see `parallel.handoff`)."""
        from k3batch.parallel.handoff import reshard_request

        full = request_cache(self.cache, slot, num_tokens)
        return [[reshard_request(full, self.config, layout, r)] for r in range(layout.tp_size)]


def request_cache(cache: StateCache, slot: int, num_tokens: int) -> dict:
    """A request's cache tensors by kind and layer: KDA [H, K, V], conv [3, C, W-1], MLA
    latent of its first num_tokens tokens [L, kv_lora + rope]."""
    return {
        "kda_state": {i: t[slot] for i, t in cache.kda_state.items()},
        "kda_conv": {i: t[slot] for i, t in cache.kda_conv.items()},
        "mla_latent": {i: t[slot, :num_tokens] for i, t in cache.mla_latent.items()},
    }
