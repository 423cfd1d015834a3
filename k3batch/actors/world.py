"""A replica's actors as one torch.distributed world: P prefill stage actors (world ranks
0..P-1, in pipeline order) and, in a disaggregated replica, the N rank actors of its decode
group (world ranks P..P+N-1). One group serves all their traffic: the stream from stage to
stage, the decode ranks' TP and DCP collectives (subgroups), and the handoff, where each stage
sends its layers of a finished request to every decode rank (`parallel.handoff`). NCCL on GPU
(device to device), gloo on CPU. A placement group holds the actors: bundle `first_bundle` + i
holds world rank i.
"""

import torch

from k3batch.actors.decode import DecodeGroupRunner, DecodeRankActor
from k3batch.actors.pipeline import PipelineRunner
from k3batch.actors.placement import Members, spawn_world
from k3batch.actors.prefill import PrefillStageActor
from k3batch.engine.config import EngineConfig
from k3batch.model.config import K3Config
from k3batch.parallel.layout import ParallelLayout, split_layers


def spawn_runners(
    model_dir: str,
    *,
    num_stages: int,
    decode_layout: ParallelLayout | None = None,
    engine_config: EngineConfig,
    device: str,
    dtype: torch.dtype,
    stage_sizes: list[int] | None = None,
    placement_group=None,
    first_bundle: int = 0,
    gpus_per_actor: float = 0,
) -> tuple[PipelineRunner, DecodeGroupRunner | None]:
    """Start the prefill pipeline and (with `decode_layout`, any tp_size >= 1) the decode group
    of one replica, joined in one world; returns their runners (the decode runner None
    without a decode group). stage_sizes: layers per stage (default: whole AttnRes blocks)."""
    config = K3Config.from_hf(model_dir)
    layer_ranges = split_layers(
        config.num_hidden_layers, num_stages, config.attn_res_block_size, stage_sizes
    )
    shared = dict(model_dir=model_dir, engine_config=engine_config, device=device, dtype=dtype)
    parts = [
        Members(
            actor_cls=PrefillStageActor,
            kwargs=[
                shared | dict(layer_range=rng, rank=r, num_stages=num_stages,
                              decode_layout=decode_layout)  # fmt: skip
                for r, rng in enumerate(layer_ranges)
            ],
            role="prefill stage",
            first_bundle=first_bundle,
            num_gpus=gpus_per_actor,
        )
    ]
    if decode_layout is not None:
        parts.append(
            Members(
                actor_cls=DecodeRankActor,
                kwargs=[
                    shared | dict(layout=decode_layout, tp_rank=r)
                    for r in range(decode_layout.tp_size)
                ],
                role="decode rank",
                first_bundle=first_bundle + num_stages,
                num_gpus=gpus_per_actor,
            )
        )
    actors = spawn_world(parts, device=device, placement_group=placement_group)
    n = decode_layout.tp_size if decode_layout is not None else 0
    pipeline = PipelineRunner(
        actors[0], config=config, layer_ranges=layer_ranges, num_decode_ranks=n
    )
    decode = None
    if decode_layout is not None:
        decode = DecodeGroupRunner(actors[1], config=config, layout=decode_layout)
    return pipeline, decode
