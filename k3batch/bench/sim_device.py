"""A GPU simulated on the wall clock, for `bench job --device sim`: the job's own overhead
against the engine alone, measured on a CPU.

The flavor's config and a tiny tokenizer, no weights (`write_sim_checkpoint`); the replica
(`SimReplica`) and the engine alone (`sim_engine`) run the real engine over
`sim.clock.SimRunner` on a `WallClock`: a decode step takes `decode_s` (default 20 ms), a
prefill step `prefill_s` per 8,192 tokens (default 165 ms), the arena `arena_bytes` (default
38.3 GiB): Kimi Linear on one H100 (`benchmarks/job_kimi_linear_h100.txt`). The host's work
(the driver, Ray, the replica, the engine's scheduling, admission and prefix cache over the real
arena's layout) is real, the device's is slept with the real runner's timing (the overlapped
decode takes a step's tokens after launching the next), so what the job adds between the steps
shows, and what it adds to them.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from k3batch.actors.replica import ReplicaActor
from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.model.config import K3Config, get_flavor
from k3batch.model.weights import write_side_files
from k3batch.sim.clock import SimRunner, VirtualClock, phase
from k3batch.tokenizer import Tokenizer

SIM_TOKENS = 8192  # the prefill tokens that SimDevice.prefill_s is given for


class WallClock(VirtualClock):
    """A `VirtualClock` on the wall clock: `now` is the seconds since it was made and moving
    to a time sleeps until then, so a `SimRunner` device runs in real time beside real host
    work (`submit` starts a batch when the device is free, `wait` sleeps until it is done)."""

    def __init__(self):
        self._t0 = time.perf_counter()
        super().__init__(keep_trace=False)

    @property
    def now(self) -> float:
        return time.perf_counter() - self._t0

    @now.setter
    def now(self, value: float) -> None:
        pass  # the wall clock moves by itself

    def advance_to(self, t: float) -> None:
        time.sleep(max(t - self.now, 0.0))


@dataclass(frozen=True)
class SimDevice:
    """A GPU's step times (device "sim"): any decode step decode_s, a prefill step prefill_s
    per SIM_TOKENS tokens; its arena (sizes max_num_seqs and the prefix cache's room)."""

    decode_s: float = 0.020
    prefill_s: float = 0.165
    arena_bytes: int = int(38.3 * 2**30)

    @classmethod
    def parse(cls, device: str) -> "SimDevice":
        """From "sim" or "sim:DECODE_MS,PREFILL_MS,ARENA_GIB" (trailing fields may be left
        out: their defaults)."""
        fields = [float(v) for v in device.partition(":")[2].split(",") if v]
        names = [("decode_s", 1e-3), ("prefill_s", 1e-3), ("arena_bytes", 2**30)]
        if len(fields) > len(names):
            raise ValueError(f"device {device!r}: sim:DECODE_MS,PREFILL_MS,ARENA_GIB at most")
        kw = {n: type(getattr(cls, n))(v * unit) for (n, unit), v in zip(names, fields)}
        return cls(**kw)

    def forward_s(self, batch) -> float:
        if phase(batch) == "decode":
            return self.decode_s
        return self.prefill_s * batch.num_tokens / SIM_TOKENS


def sim_engine(model_dir, engine_config: EngineConfig, sim: SimDevice):
    """(engine, tokenizer) over a `SimRunner` of the checkpoint's config on the wall clock."""
    tokenizer = Tokenizer.from_dir(model_dir)
    runner = SimRunner(K3Config.from_hf(model_dir), engine_config, sim,
                       arena_bytes=sim.arena_bytes, clock=WallClock())  # fmt: skip
    engine = Engine(None, engine_config, runner=runner, eos_token_ids=tokenizer.stop_token_ids)
    return engine, tokenizer


class SimReplica(ReplicaActor):
    """The job's replica with its engine on a simulated device (`sim_engine`)."""

    def __init__(self, *args, sim: SimDevice, **kw):
        self.sim = sim
        super().__init__(*args, **kw)

    def _build(self, model_dir: str, engine_config: EngineConfig, **_):
        return sim_engine(model_dir, engine_config, self.sim)


def write_sim_checkpoint(flavor: str, out_dir: Path) -> None:
    """A flavor's config.json and a tiny tokenizer of its vocabulary: all a simulated device
    reads (no weights)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_side_files(get_flavor(flavor), out_dir)
