"""The decode step on static buffers, replayed as one CUDA graph per batch bucket.

A decode step reads four things per sequence: its token id, its KDA block (slot), its position
(the cached length) and its page table. They live here in one device buffer at fixed offsets
for `max_batch` sequences; a step writes them into a pinned host copy of that buffer and moves
it with ONE host-to-device copy, then replays the graph of its bucket, whose kernels read those
offsets. A token id < 0 is the previous step's sampled token of row -1 - id, copied into the
`feed` buffer on the device (the engine's overlapped decode); the graph resolves it first. The
engine pads decode batches to a bucket (powers of two, capped at `max_batch`) with rows in a
scratch block and page (`Engine`, `pads_decode`), so a step always hits a captured shape; a
batch that is not a bucket runs eagerly on the same buffers. The single-device runner and every
rank of a TP/DCP decode group use it (a rank's graphs hold its collectives; on CPU the ranks
run the same static buffers without graphs).

Capture (`capture()`, once, before any request holds the cache): every bucket runs twice
eagerly first (Triton compiles and fla autotunes there, never inside a capture), then the
graphs are captured from the largest bucket down, sharing one memory pool. The warm-up runs
write into KDA block 0 and page row 0; nothing is cached yet, and a prefill never reads a block
or page it has not written. Logits come back in the graph's static output: queue what reads them
(the sampler) before the next step's replay.

The attended lengths are bounded by `max_seq_len` for every bucket (`ForwardBatch.max_len`
sizes the MLA decode split), so that the split count is fixed at capture time.
"""

import torch

from k3batch.model.forward_batch import ForwardBatch


def fill_fed(ids: torch.Tensor, feed: torch.Tensor) -> torch.Tensor:
    """ids with each id < 0 replaced by feed[-1 - id] (on the device, no host sync)."""
    rows = (-1 - ids).clamp_(0, feed.numel() - 1)
    return torch.where(ids < 0, feed[rows], ids)


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch: the decode batch sizes the engine pads to."""
    out = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, model, cache, *, max_batch: int, max_seq_len: int):
        self.model, self.cache = model, cache
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.max_pages = -(-max_seq_len // cache.page_size)
        B, P = max_batch, self.max_pages
        dev = cache.arena.device
        # [ids B | slots B | positions B | page rows B x P], int64
        self._host = torch.zeros(3 * B + B * P, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._dev = torch.zeros(3 * B + B * P, dtype=torch.long, device=dev)
        self.ids, self.slots, self.positions = self._dev[: 3 * B].view(3, B)
        self.page_rows = self._dev[3 * B :].view(B, P)
        self.feed = torch.zeros(B, dtype=torch.long, device=dev)  # the last step's tokens
        # the staging copy of the last step: the host buffer is written again after it ran
        self._staged = torch.cuda.Event() if dev.type == "cuda" else None
        self._tables: list[list[int]] = [[] for _ in range(B)]  # page tables staged per row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    @classmethod
    def build(cls, model, cache, config, *, capture: bool) -> "DecodeGraphs":
        """Static buffers for `config.max_num_seqs` x `config.max_seq_len`, the graphs captured
        when `capture` (CUDA; on a TP/DCP rank every rank captures at once: the collectives
        of the step are captured with it)."""
        graphs = cls(model, cache, max_batch=config.max_num_seqs, max_seq_len=config.max_seq_len)
        if capture:
            graphs.capture()
        return graphs

    @staticmethod
    def serves(batch: ForwardBatch, all_logits: bool) -> bool:
        """A plain decode step (no per-token logits, no pinned or recorded routes)."""
        return batch.is_decode and not (all_logits or batch.pinned_routes or batch.routes_out)

    @property
    def buckets(self) -> list[int]:
        return buckets_up_to(self.max_batch)

    def _batch(self, b: int) -> ForwardBatch:
        """A decode batch of b rows bound to the static buffers (host lists are placeholders:
        nothing on the decode path reads their values)."""
        batch = ForwardBatch(seq_lens=[1] * b, cached_lens=[1] * b, slot_ids=[0] * b,
                             page_tables=[[0]] * b)  # fmt: skip
        batch.slots, batch.positions = self.slots[:b], self.positions[:b]
        batch.max_len = self.max_seq_len
        if self.cache.mla_latent:
            batch.page_rows, batch.mla_pages = self.page_rows[:b], self.cache.mla_latent
        return batch

    def _forward(self, b: int) -> torch.Tensor:
        ids = fill_fed(self.ids[:b], self.feed)
        return self.model.forward_batch(ids, self._batch(b), self.cache)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every bucket up eagerly, then capture one graph per bucket (largest first)."""
        self._dev.zero_()  # every row: token 0, block 0, page row 0 ...
        self.positions.fill_(1)  # ... at position 1
        for b in self.buckets:
            for _ in range(2):
                self._forward(b)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._logits[b] = self._forward(b)
            self.graphs[b] = g
        torch.cuda.synchronize()

    def run(self, ids: list[int], batch: ForwardBatch, feed=None) -> torch.Tensor:
        """Logits [len(ids), V] of one decode step: the batch's rows staged (ids, slots and
        positions every step; page-table rows only where they changed, usually by one
        appended page), `feed` (the last step's sampled ids, for ids < 0) copied on the
        device, then the bucket's graph replayed (eager on the same buffers when none was
        captured)."""
        b, B, P = len(ids), self.max_batch, self.max_pages
        tables = batch.page_tables
        if b > B or any(len(t) > P for t in tables):
            raise ValueError(f"decode batch of {b} rows exceeds the static buffers ({B} x {P})")
        self.cache.check_decode_pages(batch)
        if feed is not None:
            self.feed[: feed.numel()].copy_(feed)
        host = self._host
        if self._staged is not None:
            self._staged.synchronize()  # the last step's staging copy has read the host buffer
        host[:b] = torch.tensor(ids)
        host[B : B + b] = torch.tensor(batch.slot_ids)
        host[2 * B : 2 * B + b] = torch.tensor(batch.cached_lens)
        self._dev[: 3 * B].copy_(host[: 3 * B], non_blocking=True)
        rows = host[3 * B :].view(B, P)
        changed = False
        for n, t in enumerate(tables):
            old = self._tables[n]
            if t != old:
                keep = len(old) if len(old) <= len(t) and t[: len(old)] == old else 0
                rows[n, keep : len(t)] = self.cache.num_pages - 1 - torch.tensor(t[keep:])
                self._tables[n], changed = list(t), True
        if changed:
            self._dev[3 * B :].copy_(host[3 * B :], non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        if b in self.graphs:
            self.graphs[b].replay()
            return self._logits[b]
        return self._forward(b)
