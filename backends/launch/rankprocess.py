"""One rank's process: its signal handling, threads and process group around `worker.train_rank`.

`process_main` is the entry of a worker process (spawned by `spawn`, or this process under
torchrun); the rest is what a clean start and teardown of its process group needs.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from datetime import timedelta
from typing import Any

import torch

from ..rank.comm import DistComm
from ..rank.groups import DistGroup
from ..rank.worker import Job, train_rank


def import_before_groups(model: str, seed: int) -> None:
    """Import what training imports before any process group exists.

    transformers imports `torch.distributed.nn` (through its FSDP integration), whose functions take
    `group=group.WORLD` as a default argument, evaluated at import. Imported after
    `init_process_group`, they hold the live default group for good: `destroy_process_group` then
    cannot free it, and gloo's threads (`pt_gloo_runloop`, `gloo_tcp_loop`) run on into interpreter
    shutdown and static destruction, while the peer exits and closes their sockets: the teardown
    race behind a finished run's rank dying with SIGABRT ("terminate called without an active
    exception"; seen about 1 run in 14, not reproduced on the 2-core dev box in ~250 runs).
    Imported first, the defaults are None and the teardown frees the groups and joins their threads.
    """
    import torch.distributed.nn  # noqa: F401

    from ..model.hf import build_model

    build_model(model, seed=seed, only=set())  # transformers' lazy modules for this model


def lingering_group_threads() -> list[str]:
    """Names of this process's threads that belong to a torch.distributed backend (Linux; tests)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if "gloo" in n or "nccl" in n.lower())


# The caching allocator grows segments in place instead of keeping one per size: reserved memory
# stays near what is allocated, so a run planned under `--gpu-mem` does not reach the cap through
# fragmentation. At the cap the allocator frees its cache, and freeing (cudaFree, or the events of
# blocks used on other streams) waits for the device: with an NCCL receive posted before its peer's
# send, that wait needs the peer's host, which may be waiting for this one.
CUDA_ALLOC_CONF = "expandable_segments:True"


def process_main(local_rank: int, job: Job, world: int, init_method: str, result_path: str | None,
                 env_rank: int | None = None) -> None:
    """The entry of one worker process (`torch.multiprocessing.spawn`, or in-process under torchrun)."""
    import torch.distributed as dist

    rank = local_rank if env_rank is None else env_rank
    stop = threading.Event()
    hang_s = float(os.environ.get("TINYPIPE_STACKS_AFTER_S", "0") or 0)
    if hang_s > 0:  # diagnosis of a stuck run: every thread's Python stack on stderr after this long
        import faulthandler

        faulthandler.dump_traceback_later(hang_s, exit=False)

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    main = threading.current_thread() is threading.main_thread()
    if main:  # Ctrl-C: finish the window, checkpoint, stop (SIGTERM keeps killing: spawn uses it on failure)
        signal.signal(signal.SIGINT, on_signal)
    if job.threads:
        torch.set_num_threads(job.threads)
    backend = "nccl" if job.backend == "cuda" else "gloo"
    if job.backend == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)  # before the allocator's first use
        torch.cuda.set_device(local_rank)
    import_before_groups(job.model, job.seed)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=job.timeout_s))
    finished = False
    try:
        comm = DistComm(rank, world, backend=backend)
        group = DistGroup(rank, world, backend)
        if env_rank is not None:  # torchrun: each process planned for itself; rank 0's plan is the one run
            feed = job.feed  # the Python API's callback stays in rank 0's process, where train() was called
            box = [dataclasses.replace(job, feed=None)]
            dist.broadcast_object_list(box, src=0, group=group.group)
            job = dataclasses.replace(box[0], feed=feed if rank == 0 else None)
        # clipping: the optimizer threads all-reduce each step's gradient norm in a group of their own
        norms = DistGroup(rank, world, backend, own_group=True) if job.schedule.grad_clip else None
        result = train_rank(job, rank, world, comm, group, stop=stop, local_rank=local_rank, norms=norms)
        results = group.gather(result)
        if rank == 0 and result_path is not None:
            tmp = f"{result_path}.part{os.getpid()}"
            torch.save(results, tmp)
            os.replace(tmp, result_path)
        # Orderly teardown: no helper thread inside a gloo Work, and no rank destroying its groups
        # while a peer still uses them (a rank once died with SIGABRT at exit without this).
        comm.close()
        group.barrier()
        finished = True
    finally:
        if main:  # done: a late Ctrl-C must not kill the exiting process (Python restores SIG_DFL at exit)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Failing, keep the groups' connections open: torch's spawn wrapper writes this rank's error
        # file after the exception leaves here, and the launcher names the rank whose file is oldest
        # (`spawn._first_failure`). Destroyed here, the peers' "connection closed" errors could be
        # written first (seen under load). The process exits right after anyway.
        if finished:
            dist.destroy_process_group()

