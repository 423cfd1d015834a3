"""Inputs shared by the MLA kernel tests: paged latents with non-contiguous, shuffled page
tables and NaN poison everywhere a kernel must not read (pages of no sequence, positions past a
sequence's length), plus the CPU/GPU switch (without a GPU, tests/conftest.py has set
TRITON_INTERPRET=1, so the kernels run interpreted). Not a test module."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_latents(lens, C, *, page_size: int, dtype, seed: int, spare_pages: int = 3,
                  ramp: float = 0.0):  # fmt: skip
    """Sequences of lens[b] cached tokens [C] in pages of page_size, pages handed out in a
    shuffled order (no table is contiguous or sorted). Returns (pool [P, page_size, C] in dtype
    on DEVICE, page_rows [B, max pages] int64 on DEVICE, tokens: list of [lens[b], C] fp32 CPU
    (the values as stored, i.e. after the cast)). Unused pages and tails are NaN.
    ramp: token i is scaled by 1 + ramp * i, so attention scores grow along the sequence."""
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // page_size)) for n in lens]
    P = sum(need) + spare_pages
    order = torch.randperm(P, generator=g).tolist()
    pool = torch.full((P, page_size, C), float("nan"), dtype=dtype)
    rows = torch.zeros(len(lens), max(need), dtype=torch.long)
    tokens, k = [], 0
    for b, n in enumerate(lens):
        r = order[k : k + need[b]]
        k += need[b]
        rows[b, : len(r)] = torch.tensor(r)
        x = (torch.randn(n, C, generator=g) * (1 + ramp * torch.arange(n))[:, None]).to(dtype)
        for i in range(n):
            pool[r[i // page_size], i % page_size] = x[i]
        tokens.append(x.float())
    return pool.to(DEVICE), rows.to(DEVICE), tokens
