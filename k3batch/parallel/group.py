"""Process groups as explicit values: `ParallelGroup` (a group, this process's rank in it, its
size) with the three collectives the parallel leaf layers need, and `create_groups`, which
makes a decode group's TP and DCP groups from its `layout.ParallelLayout`.

Layout: TP ranks 0..N-1; DCP size M divides N; dcp_rank = tp_rank % M and the DCP group of a
rank is the M consecutive ranks {r - r % M, ..., r - r % M + M - 1}. A group of size 1 needs
no process group and its collectives are no-ops, so a rank model with trivial groups runs on
one CPU without torch.distributed.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3batch.parallel.layout import ParallelLayout


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """A communicator for one parallel axis, seen from one process.

    group: the ProcessGroup, or None. None with size 1 is the trivial group (collectives are
    no-ops); None with size > 1 is a detached group (`ParallelGroup.detached`): it knows its
    coordinates, enough to build and load a rank model, but any collective raises.
    """

    group: object | None  # torch.distributed.ProcessGroup
    rank: int
    size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank = {self.rank} not in [0, size = {self.size})")

    @classmethod
    def single(cls) -> "ParallelGroup":
        return cls(None, 0, 1)

    @classmethod
    def detached(cls, rank: int, size: int) -> "ParallelGroup":
        """Coordinates without a communicator (weight loading and shape checks)."""
        return cls(None, rank, size)

    def _check(self) -> None:
        if self.group is None:
            raise RuntimeError(f"collective on a detached group (rank {self.rank} of {self.size})")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns t. Every rank gets the same bits.

        CPU tensors (gloo) take one exchange round: every rank receives all N tensors (one
        all_to_all_single) and adds them in rank order. Gloo's ring all-reduce needs 2(N-1)
        dependent rounds, several times slower for the small tensors of decode."""
        if self.size == 1:
            return t
        self._check()
        if t.device.type == "cpu":
            return t.copy_(self._exchange(t).sum(0))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's t along `dim`, in rank order (equal shapes everywhere)."""
        if self.size == 1:
            return t
        self._check()
        return torch.cat(self._exchange(t).unbind(0), dim=dim)

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """[N, *t.shape]: every rank's t, in rank order. One round on CPU (an all-to-all with
        t sent to every rank), all_gather_into_tensor elsewhere."""
        t = t.contiguous()
        out = t.new_empty(self.size, *t.shape)
        if t.device.type == "cpu":
            send = t.unsqueeze(0).expand(self.size, *t.shape).contiguous()
            dist.all_to_all_single(out, send, group=self.group)
        else:
            dist.all_gather_into_tensor(out, t, group=self.group)
        return out

    def all_to_all(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """tensors[j] goes to rank j; returns the list whose element j came from rank j.

        All tensors must have one shape and dtype; they travel as one packed buffer
        (a single all_to_all_single)."""
        if len(tensors) != self.size:
            raise ValueError(f"all_to_all needs {self.size} tensors, got {len(tensors)}")
        if self.size == 1:
            return list(tensors)
        self._check()
        send = torch.stack(tensors)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return list(recv.unbind(0))


def create_groups(
    layout: ParallelLayout, first_rank: int = 0
) -> tuple[ParallelGroup, ParallelGroup] | None:
    """(tp, dcp) groups of this process, from the default process group; None for a process
    that is not a decode rank.

    The decode ranks are the world ranks from `first_rank` on (a disaggregated replica's world
    starts with its prefill stages), cut into TP groups of tp_size consecutive ranks (their
    number must be a multiple of tp_size; usually it equals it), each cut into DCP groups of
    dcp_size consecutive ranks. Collective: every process of the world must call it, decode
    rank or not, in the same order relative to other group creation (`dist.new_group` is
    called for every group by every process, in one order)."""
    layout.validate()
    world, rank = dist.get_world_size(), dist.get_rank()
    num_ranks = world - first_rank
    if num_ranks < 1 or num_ranks % layout.tp_size:
        raise ValueError(
            f"{num_ranks} decode ranks (world_size = {world} from rank {first_rank}) are not a "
            f"multiple of tp_size = {layout.tp_size}"
        )
    local = rank - first_rank  # this process's index among the decode ranks (< 0: none)
    tp_rank = local % layout.tp_size
    tp = _new_group(first_rank, world, local, layout.tp_size, tp_rank)
    dcp = _new_group(first_rank, world, local, layout.dcp_size, layout.dcp_rank(tp_rank))
    return (tp, dcp) if local >= 0 else None


def _new_group(first_rank: int, world: int, local: int, size: int, local_rank: int):
    if size == 1:
        return ParallelGroup.single()
    mine = None
    for first in range(first_rank, world, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks)  # every process creates every group, in order
        if first_rank + local in ranks:
            mine = group
    return ParallelGroup(mine, local_rank, size) if local >= 0 else None
