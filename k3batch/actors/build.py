"""The engine factory: an engine on this device, or a disaggregated one whose prefill stages and
decode ranks are actors (Ray). Used by the replica actor and by `k3batch generate`."""

import functools

import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.runner import sized
from k3batch.model.loader import load_model
from k3batch.tokenizer import Tokenizer


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """bf16 on accelerators (the checkpoint dtype); fp32 on CPU, where the reference ops run."""
    return torch.float32 if device == "cpu" else torch.bfloat16


def build_engine(
    model_dir: str,
    engine_config: EngineConfig | None = None,
    *,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    pp: int = 1,
    pp_layers=None,
    tp: int = 1,
    dcp: int = 1,
    disaggregate: bool = False,
    placement_group=None,
) -> tuple[Engine, Tokenizer]:
    """An engine on this device (pp = tp = 1, not disaggregated), or one whose model runs on
    actors (Ray): a prefill pipeline of pp stage actors and, with tp > 1 or `disaggregate`, a
    decode group of tp rank actors that prompts are handed to (pp = tp = 1 with disaggregate:
    one stage, one rank). One placement group holds the whole replica: bundle 0 the replica
    actor, bundles 1..pp the stages, bundles pp + 1..pp + tp the decode ranks."""
    engine_config = engine_config or EngineConfig()
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if device == "cpu":
        # CPU runs are the tiny debug flavors, bound by per-op overhead: extra intra-op threads
        # only spin (10x slower on a busy 2-core machine).
        torch.set_num_threads(1)
    tokenizer = Tokenizer.from_dir(model_dir)
    stops = tuple(tokenizer.stop_token_ids) or None
    text = dict(eos_token_ids=stops, stop_check=functools.partial(_has_stop, tokenizer))
    decode_group = tp > 1 or disaggregate
    if pp == 1 and not decode_group:
        model = load_model(model_dir, dtype=dtype, device=device)
        return Engine(model, engine_config, **text), tokenizer
    from k3batch.actors.world import spawn_runners
    from k3batch.parallel.layout import ParallelLayout

    engine_config = sized(engine_config, cuda=device == "cuda")
    runner, decode = spawn_runners(
        model_dir,
        num_stages=pp,
        decode_layout=ParallelLayout(tp_size=tp, dcp_size=dcp) if decode_group else None,
        engine_config=engine_config,
        device=device,
        dtype=dtype,
        stage_sizes=list(pp_layers) if pp_layers else None,
        placement_group=placement_group,
        first_bundle=1,
        gpus_per_actor=1 if device == "cuda" else 0,
    )
    engine = Engine(None, engine_config, runner=runner, decode_runner=decode, **text)
    return engine, tokenizer


def _has_stop(tokenizer: Tokenizer, strings, ids: list[int]) -> bool:
    """Whether the text of `ids` holds one of `strings`. Only a match that takes in the last
    token is new (an earlier one would have stopped the request), so the tail decoded is as
    many tokens as the longest string has bytes (a token spells at least one byte), plus a few
    for a character cut across tokens at its start."""
    tail = tokenizer.decode(ids[-(max(len(s.encode()) for s in strings) + 4) :])
    return any(s in tail for s in strings)
