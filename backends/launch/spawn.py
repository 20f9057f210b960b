"""Starting the ranks: N processes spawned here (free local port), or those `torchrun` started, or threads.

`launch` picks: under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK in the environment) this process
is one rank; otherwise one CPU rank runs in this process, and more ranks (or any CUDA rank) are
spawned with `torch.multiprocessing` (gloo on CPU, NCCL on CUDA), meeting through a file store in
a fresh temporary directory. A rank that fails brings the
others down (spawn terminates them) and its error comes back as one line. Rank 0 gathers every
rank's `RankResult`; `launch` returns them on rank 0 and None on the other torchrun ranks. A job with the
Python API's callback (`stepfeed.LocalFeed`) hears spawned rank 0's metrics rows through a queue, relayed here
while the ranks run.

`run_threads` runs the ranks as threads of this process with in-process transfers: for tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException, start_processes

from tinypipe.common.errors import TinypipeError

from ..rank.comm import LocalComm
from ..rank.groups import LocalGroup
from ..rank.stepfeed import LocalFeed, spawned_feed
from ..rank.worker import Job, RankResult, train_rank
from .rankprocess import process_main

FEED_POLL_S = 0.1  # how often the launcher relays rank 0's metrics rows to the Python API's callback


class WorkerError(TinypipeError):
    """A rank failed; the message is that rank's error in one line."""


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def _one_line(trace: str) -> str:
    """The last line of a worker's traceback without the exception's class: what went wrong, in words."""
    lines = [x.strip() for x in trace.strip().splitlines() if x.strip()]
    last = lines[-1] if lines else "unknown error"
    head, sep, rest = last.partition(": ")
    if sep and rest and head.replace(".", "").replace("_", "").isalnum() and " " not in head:
        return rest  # `tinypipe.backends.rank.interpreter.ExecutionError: ...` -> `...`
    return last


def _first_failure(error_files: list[str], index: int, trace: str) -> tuple[int, str]:
    """(rank, traceback) of the rank that failed first: when one rank raises, its peers fail next
    with broken connections, and the one spawn noticed first may be one of them. Each rank that
    raised wrote its traceback to its error file; the oldest file is the first failure."""
    written = []
    for rank, f in enumerate(error_files):
        try:
            mtime = os.stat(f).st_mtime_ns
            with open(f, "rb") as fh:
                written.append((mtime, rank, str(pickle.load(fh))))
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
    if not written:
        return index, trace
    _, rank, first = min(written)
    return rank, first


def _died(index: int, exit_code: int, out: str | None) -> str:
    """One line for a rank that died without raising (a signal, an abort), with where to resume from."""
    try:
        how = f"was killed by {signal.Signals(-exit_code).name}" if exit_code < 0 else f"exited with code {exit_code}"
    except ValueError:
        how = f"died (exit code {exit_code})"
    text = f"rank {index} {how}; the other ranks were stopped"
    if out is not None:
        from ..save import checkpoint

        found = checkpoint.find(out)
        if found is not None:
            try:
                step = checkpoint.read_record(found)["step"]
            except TinypipeError:
                return text
            text += f"; the last checkpoint is at step {step}: continue with --resume --out {out}"
    return text


@contextlib.contextmanager
def _quiet_spawn() -> Iterator[None]:
    """Mute torch.multiprocessing's `Terminating process ...` warnings: the error says it in one line."""
    log = logging.getLogger("torch.multiprocessing.spawn")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def launch(job: Job, world: int) -> list[RankResult] | None:
    """Run `job` on `world` ranks; rank 0 gets every rank's result (other torchrun ranks: None)."""
    env = torchrun_env()
    if env is not None:
        rank, env_world, local_rank = env
        if env_world != world:
            raise WorkerError(f"torchrun started {env_world} processes but the schedule is for {world} ranks "
                              f"(--nproc-per-node must equal --gpus)")
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "results.pt") if rank == 0 else None
            process_main(local_rank, job, world, "env://", path, env_rank=rank)
            return torch.load(path, weights_only=False) if path else None
    if world == 1 and job.backend == "cpu":
        return [_run_here(job, LocalGroup(1))]
    local = job.feed if isinstance(job.feed, LocalFeed) else None  # the Python API's callback (`stepfeed`)
    remote = None if local is None else spawned_feed()  # rank 0's rows come back through its queue
    if remote is not None:
        job = dataclasses.replace(job, feed=remote)

    def relay() -> None:
        if remote is not None and local is not None:
            remote.relay(local)

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "results.pt")
        # a file store in a fresh directory: unlike a "free" TCP port picked here, nothing else can
        # take it between the pick and rank 0's bind (gloo and NCCL choose their own ports)
        init = f"file://{Path(tmp) / 'store'}"
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the workers checkpoint and stop themselves
        try:
            with _quiet_spawn():
                ctx = start_processes(process_main, args=(job, world, init, path), nprocs=world,
                                                            join=False, start_method="spawn")
                try:
                    while not ctx.join(timeout=None if remote is None else FEED_POLL_S):
                        relay()
                except ProcessRaisedException as exc:
                    # a rank killed by a signal (not spawn's own SIGTERM) broke its peers' connections
                    killed = [(r, p.exitcode) for r, p in enumerate(ctx.processes)
                              if p.exitcode is not None and p.exitcode < 0 and p.exitcode != -signal.SIGTERM
                              and not os.path.exists(ctx.error_files[r])]
                    if killed:
                        raise WorkerError(_died(*killed[0], job.out)) from None
                    rank, trace = _first_failure(ctx.error_files, exc.error_index, str(exc))
                    raise WorkerError(f"rank {rank} failed: {_one_line(trace)}") from None
                except ProcessExitedException as exc:
                    if not os.path.exists(path):
                        raise WorkerError(_died(exc.error_index, exc.exit_code, job.out)) from None
                    # every rank had trained, saved and sent its result (rank 0 writes them after the
                    # gather): a rank that dies in its teardown cannot change the run, so say so and go on
                    print(f"warning: {_died(exc.error_index, exc.exit_code, None).split(';')[0]} at exit, after "
                          "every rank had delivered its results; the run is complete", file=sys.stderr)
                finally:
                    for f in ctx.error_files:
                        with contextlib.suppress(OSError):
                            os.unlink(f)
        finally:
            signal.signal(signal.SIGINT, previous)
        relay()  # the rows written since the last poll
        results: list[RankResult] = torch.load(path, weights_only=False)  # written by rank 0 (process_main)
        return results


def _run_here(job: Job, group: LocalGroup) -> RankResult:
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        if job.threads:
            torch.set_num_threads(job.threads)
        return train_rank(job, 0, 1, None, group.view(0), stop=stop)
    finally:
        signal.signal(signal.SIGINT, previous)


def run_threads(job: Job, world: int) -> list[RankResult]:
    """All ranks as threads of this process (tests): in-process transfers, same `train_rank`."""
    from ..model.hf import build_model

    build_model(job.model, seed=job.seed, only=set())  # imports transformers' lazy modules once, not racing
    comm = LocalComm(world)
    group = LocalGroup(world)
    norms = LocalGroup(world) if job.schedule.grad_clip else None  # the optimizer threads' own collective
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = train_rank(job, rank, world, comm.for_rank(rank) if world > 1 else None,
                                       group.view(rank), norms=None if norms is None else norms.view(rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)
            group._barrier.abort()
            if norms is not None:
                norms._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    return results
