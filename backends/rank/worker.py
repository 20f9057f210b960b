"""One rank's life: build its layers and host state, run the schedule step after step, checkpoint, save.

`train_rank` is the whole life given a communicator and a control group, so the same code runs in
a process of its own (`rankprocess.process_main`, under `tinypipe run` or `torchrun`) and, for tests, as a
thread (`spawn.run_threads`): the rank's host settings and guards around a `trainer.Trainer`. Step k runs the
schedule's iteration min(k, K-1) as a template, with the actions' steps shifted to k: iterations repeat, and
the last compiled one is the steady state.
"""

from __future__ import annotations

import threading

from .comm import Comm
from .groups import Group
from .hostwork import gc_pauses, host_settings, settle_heap_enabled, settled_heap
from .job import Job as Job  # what a rank is given and what it reports: where spawn, launch and tests take them
from .job import RankResult as RankResult
from .rank_state import strip_parameters as strip_parameters  # where tests and the profiler take it from
from .rss_guard import RssGuard
from .trainer import Trainer
from .trainer import step_data as step_data  # where the planner and tests take it from


def train_rank(job: Job, rank: int, world: int, comm: Comm | None, group: Group, *,
               stop: threading.Event | None = None, local_rank: int = 0, norms: Group | None = None) -> RankResult:
    """Train `job.steps` steps as rank `rank` of `world`; returns what this rank saw. `norms`: the
    collective the optimizer thread sums the gradient norm over (a schedule that clips)."""
    host_spans: list[tuple[str, float, float]] = []  # RankResult.host
    stop = threading.Event() if stop is None else stop  # Ctrl-C's event, which the host-memory guard sets too
    with (host_settings(), gc_pauses(host_spans), settled_heap(host_spans) as settle_heap,
          RssGuard(stop, job.rss_guard, rank=rank) as guard):
        trainer = Trainer(job, rank, world, comm, group, stop=stop, local_rank=local_rank, norms=norms,
                          host_spans=host_spans, guard=guard,
                          settle_heap=settle_heap if settle_heap_enabled(job.compile_blocks, job.backend) else None)
        return trainer.run()
