"""Text in, text out on one device: the library side of `k3batch generate`."""

from k3batch.actors.build import build_engine
from k3batch.engine.config import EngineConfig
from k3batch.engine.request import GenerationResult, SamplingParams


def generate_text(
    model_dir: str,
    prompts: list[str],
    sampling: SamplingParams,
    *,
    chat: bool,
    engine_config: EngineConfig | None = None,
    device: str | None = None,
) -> list[tuple[str, GenerationResult]]:
    engine, tok = build_engine(model_dir, engine_config, device=device)
    if chat:
        ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    else:
        ids = [tok.encode(p, add_bos=True) for p in prompts]
    results = engine.generate(ids, sampling)
    return [(tok.decode(r.output_token_ids), r) for r in results]
