"""Text in, text out on one device: the library side of `k3batch generate`."""

import torch

from k3batch.engine.engine import Engine, EngineConfig
from k3batch.engine.request import GenerationResult, SamplingParams
from k3batch.model.loader import load_model
from k3batch.tokenizer import Tokenizer


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """bf16 on accelerators (the checkpoint dtype); fp32 on CPU, where the reference ops run."""
    return torch.float32 if device == "cpu" else torch.bfloat16


def build_engine(model_dir: str, engine_config: EngineConfig, *, device: str | None = None,
                 dtype: torch.dtype | None = None) -> tuple[Engine, Tokenizer]:  # fmt: skip
    device = device or default_device()
    if device == "cpu":
        # CPU runs are the tiny debug flavors, bound by per-op overhead: extra intra-op threads
        # only spin (10x slower on a busy 2-core machine).
        torch.set_num_threads(1)
    model = load_model(model_dir, dtype=dtype or default_dtype(device), device=device)
    tokenizer = Tokenizer.from_dir(model_dir)
    stops = tuple(tokenizer.stop_token_ids) or (model.config.eos_token_id,)
    return Engine(model, engine_config, eos_token_ids=stops), tokenizer


def generate_text(model_dir: str, prompts: list[str], sampling: SamplingParams, *, chat: bool,
                  engine_config: EngineConfig = EngineConfig(),
                  device: str | None = None) -> list[tuple[str, GenerationResult]]:  # fmt: skip
    engine, tok = build_engine(model_dir, engine_config, device=device)
    if chat:
        ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    else:
        ids = [tok.encode(p, add_bos=True) for p in prompts]
    results = engine.generate(ids, sampling)
    return [(tok.decode(r.output_token_ids), r) for r in results]
