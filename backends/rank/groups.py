"""Control-plane collectives among a run's ranks (barrier, any-true vote, gather), never on the data path:
over a gloo group between processes, or among threads of one process (`spawn.run_threads`)."""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch


class Group(Protocol):
    """Control-plane collectives among ranks (not on the data path)."""

    def barrier(self) -> None: ...

    def any_true(self, flag: bool) -> bool: ...

    def gather(self, obj: Any) -> list[Any] | None: ...

    def all_sum(self, x: float) -> float: ...


class DistGroup:
    """Control collectives over a gloo group (also under NCCL, which needs CUDA tensors)."""

    def __init__(self, rank: int, world: int, backend: str, *, own_group: bool = False) -> None:
        """`own_group`: a gloo group of its own even under gloo (for use beside the default group from
        another thread); every rank creates it, in the same order."""
        import torch.distributed as dist

        self.dist, self.rank, self.world = dist, rank, world
        self.group = dist.new_group(backend="gloo") if backend != "gloo" or own_group else None

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def any_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_sum(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, group=self.group)
        return float(t.item())


class LocalGroup:
    """Control collectives among threads of one process (`spawn.run_threads`)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world)
        self._slots: list[Any] = [None] * world

    def view(self, rank: int) -> _LocalView:
        return _LocalView(self, rank)


class _LocalView:
    def __init__(self, g: LocalGroup, rank: int) -> None:
        self.g, self.rank = g, rank

    def barrier(self) -> None:
        self.g._barrier.wait()

    def _exchange(self, obj: Any) -> list[Any]:
        self.g._slots[self.rank] = obj
        self.barrier()
        out = list(self.g._slots)
        self.barrier()
        return out

    def any_true(self, flag: bool) -> bool:
        return any(self._exchange(flag))

    def gather(self, obj: Any) -> list[Any] | None:
        out = self._exchange(obj)
        return out if self.rank == 0 else None

    def all_sum(self, x: float) -> float:
        return float(sum(self._exchange(x)))  # the same order on every rank: the same float
