"""EngineConfig: the runtime settings of one engine (scheduling and cache memory)."""

from dataclasses import dataclass
from typing import Literal, get_args

MemoryPool = Literal["unified", "static"]
MEMORY_POOLS = get_args(MemoryPool)
# What the automatic fields (0) become where no arena sizes them (`engine.runner.sized`).
CPU_MAX_NUM_SEQS = 8
CPU_BATCH_TOKENS, GPU_BATCH_TOKENS = 2048, 8192


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 0  # requests running at once; 0: as many as the arena holds on a GPU
    # (at most 256), CPU_MAX_NUM_SEQS on the CPU
    max_seq_len: int = 4096  # prompt + output tokens per request
    chunk_size: int = 256  # prompt tokens per request per prefill step
    max_batch_tokens: int = 0  # tokens per prefill step; 0: 8192 on a GPU, 2048 on the CPU
    page_size: int = 16  # tokens per MLA page (local tokens under DCP)
    memory_pool: MemoryPool = "unified"  # "unified": KDA blocks and MLA pages share one arena;
    # "static": a fixed region of max_num_seqs KDA blocks, pages in the rest (for comparison)
    prefix_cache: bool = True  # share prompt prefixes: MLA pages and KDA checkpoints
    cache_bytes: int = 0  # arena bytes per device; 0: memory_fraction on a GPU when set,
    # else room for max_num_seqs requests of max_seq_len tokens
    memory_fraction: float = 0.0  # of a GPU for weights + workspace + arena (0: 0.9)
    cuda_graphs: bool = True  # replay the decode step as CUDA graphs (CUDA: one device, TP ranks)
    overlap: bool = True  # one device: launch each decode step before the host takes the tokens
    # of the one before (the step's inputs come from the device; see `Engine._decode`)

    def batch_tokens(self, cuda: bool) -> int:
        """max_batch_tokens, or its default on this kind of device (never below chunk_size)."""
        if self.max_batch_tokens:
            return self.max_batch_tokens
        return max(self.chunk_size, GPU_BATCH_TOKENS if cuda else CPU_BATCH_TOKENS)

    def validate(self) -> "EngineConfig":
        for name in ("max_seq_len", "chunk_size", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        for name in ("max_num_seqs", "max_batch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1, or 0: sized "
                                 "by the engine")  # fmt: skip
        if self.max_batch_tokens and self.chunk_size > self.max_batch_tokens:
            raise ValueError(
                f"chunk_size = {self.chunk_size} > max_batch_tokens = {self.max_batch_tokens}"
            )
        if self.memory_pool not in MEMORY_POOLS:
            raise ValueError(f"memory_pool = {self.memory_pool!r} must be one of {MEMORY_POOLS}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes = {self.cache_bytes} must be >= 0")
        if not 0 <= self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction = {self.memory_fraction} must be in [0, 1]")
        return self
