"""Point-to-point activation transfers between ranks: torch.distributed, or in-process queues for tests.

A SEND / RECV pair between two GPUs matches in list order (docs/schedule-contract.md). With gloo
the default group keeps that order per sender; NCCL runs all traffic between two ranks on one
communicator, where a send each way at once can deadlock, so each direction gets its own group.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Protocol

import torch

# Thread blocks (SMs) one NCCL send / receive may occupy. A receive is posted before its data is
# ready and its kernel spins on the GPU until the peer's send arrives, holding its blocks. Measured
# on 2 H200s, the 8B forward block took 7.42 ms with NCCL's default and 7.22 ms with this cap; a
# 1-GPU run without NCCL took 7.2 ms on that machine too (the profile's 6.6 ms was another machine).
# Boundary activations are 64 MiB per microbatch: a millisecond or two over NVLink with a few blocks.
P2P_MAX_CTAS = 4


class Handle(Protocol):
    def is_completed(self) -> bool: ...

    def wait(self) -> bool: ...


class Comm(Protocol):
    """What the interpreter needs: non-blocking send and receive of one tensor to or from a peer rank."""

    def isend(self, tensor: torch.Tensor, peer: int) -> Handle: ...

    def irecv(self, tensor: torch.Tensor, peer: int) -> Handle: ...


class _Waited:
    """A gloo send / receive: its Work only learns it completed inside `wait()`, so a helper
    thread waits and the interpreter polls the future."""

    def __init__(self, future: Future[Any]) -> None:
        self.future = future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> bool:
        self.future.result()  # re-raises the transfer's error
        return True


class DistComm:
    """torch.distributed isend / irecv; the process group must be initialised.

    NCCL: the returned Work's `wait()` makes the current CUDA stream wait (the CPU does not block).
    gloo: `wait()` blocks, so it runs on a helper thread (one send and one receive at a time).
    """

    def __init__(self, rank: int, world: int, *, backend: str) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = rank
        self.groups: dict[tuple[int, int], Any] = {}
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="p2p") if backend == "gloo" else None
        if backend == "nccl":  # every rank must create every group, in the same order
            options = dist.ProcessGroupNCCL.Options()
            options.config.max_ctas = P2P_MAX_CTAS
            for src in range(world):
                for dst in range(world):
                    if src != dst:
                        self.groups[(src, dst)] = dist.new_group([src, dst], pg_options=options)
            self._connect(world)

    def _connect(self, world: int) -> None:
        """Create every pair's NCCL communicator now, in one global order.

        NCCL builds a group's communicator at its first send / receive, and that call blocks the
        host until the peer makes it too. Left to the executor, a rank could block in its first
        receive from a peer while that peer waits for this rank's first send: a deadlock (suspected
        in a 2x H200 8B run that hung; that run hung again with this in place, so it was not the
        only cause). A one-element exchange per pair, in the same order on every rank, builds them
        all before any schedule runs.
        """
        import torch

        probe = torch.zeros(1, device="cuda")
        for (src, dst), group in sorted(self.groups.items()):
            if self.rank == src:
                self.dist.send(probe, dst, group=group)
            elif self.rank == dst:
                self.dist.recv(probe, src, group=group)
        torch.cuda.synchronize()

    def close(self) -> None:
        """Wait for the helper threads (gloo): none may be inside a Work when the group is destroyed."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def _handle(self, work: Any) -> Handle:
        return work if self.pool is None else _Waited(self.pool.submit(work.wait))

    def isend(self, tensor: torch.Tensor, peer: int) -> Handle:
        return self._handle(self.dist.isend(tensor, peer, group=self.groups.get((self.rank, peer))))

    def irecv(self, tensor: torch.Tensor, peer: int) -> Handle:
        return self._handle(self.dist.irecv(tensor, peer, group=self.groups.get((peer, self.rank))))


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class _Pending:
    """A receive from an in-process mailbox: completes when the matching send has been posted."""

    def __init__(self, box: queue.Queue[torch.Tensor], out: torch.Tensor, timeout_s: float) -> None:
        self.box, self.out, self.timeout_s, self.done = box, out, timeout_s, False

    def is_completed(self) -> bool:
        if not self.done:
            try:
                self.out.copy_(self.box.get_nowait())
                self.done = True
            except queue.Empty:
                pass
        return self.done

    def wait(self) -> bool:
        if not self.done:
            try:
                self.out.copy_(self.box.get(timeout=self.timeout_s))
            except queue.Empty:
                raise TimeoutError(f"receive waited {self.timeout_s} s for its matching send") from None
            self.done = True
        return True


class LocalComm:
    """Ranks as threads of one process (tests): one FIFO mailbox per (sender, receiver)."""

    def __init__(self, world: int, *, timeout: timedelta = timedelta(seconds=60)) -> None:
        self.world = world
        self.timeout_s = timeout.total_seconds()
        self._boxes: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
            (a, b): queue.Queue() for a in range(world) for b in range(world) if a != b}

    def for_rank(self, rank: int) -> _RankView:
        return _RankView(self, rank)


class _RankView:
    def __init__(self, comm: LocalComm, rank: int) -> None:
        self.comm, self.rank = comm, rank

    def isend(self, tensor: torch.Tensor, peer: int) -> Handle:
        self.comm._boxes[(self.rank, peer)].put(tensor.detach().clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, peer: int) -> Handle:
        return _Pending(self.comm._boxes[(peer, self.rank)], tensor, self.comm.timeout_s)

