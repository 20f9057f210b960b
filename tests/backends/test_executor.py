"""The executor's issuing rules on the CPU stand-in: the same code path the CUDA streams take.

Contracts: the optimizer step runs on the rank's host worker thread, not the issuing one; a RECV is
posted no earlier than its place in the schedule; the CPU streams report complete markers and
host-clock times.
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import compiled, job  # noqa: E402

from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.rank.hostwork import GIL_SWITCH_S, HostWorker, gc_pauses, host_settings  # noqa: E402
from tinypipe.backends.rank.streams import CpuStreams, make_streams  # noqa: E402
from tinypipe.ir.schedule import Kind  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_recvs_are_posted_in_schedule_order_relative_to_the_ranks_compute() -> None:
    """Every RECV of a rank is issued after every FWD / BWD of that rank with a smaller id (a RECV
    allocates its buffer when posted: posting all of them at the start blew GPU memory)."""
    sched = compiled("tiny-llama", PRESETS["tinypipe"].replace(packing=(1, 2, 1, 2), mapping=(0, 1, 0, 1)), 2)
    results = run_threads(job("tiny-llama", sched, 3), 2)
    kinds = {a.id: a.kind for a in sched.actions}
    checked = 0
    for r in results:
        pos = {aid: i for i, aid in enumerate(r.issued)}
        computes = [aid for aid in r.issued if kinds[aid] in (Kind.FWD, Kind.BWD)]
        for aid in r.issued:
            if kinds[aid] in (Kind.RECV_F, Kind.RECV_B):
                earlier = [c for c in computes if c < aid]
                assert all(pos[c] < pos[aid] for c in earlier), f"rank {r.rank}: RECV {aid} posted too early"
                checked += 1
    assert checked > 0


def test_optimizer_steps_run_on_the_host_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT_STEP handlers run on a thread other than the one issuing the rank's actions."""
    from tinypipe.backends.rank.interpreter import Interpreter

    seen: dict[str, set[str]] = {"opt": set(), "other": set()}
    original = Interpreter.dispatch

    def spy(self: Interpreter, a: object, step: int) -> object:
        seen["opt" if a.kind is Kind.OPT_STEP else "other"].add(threading.current_thread().name)  # type: ignore[attr-defined]
        return original(self, a, step)  # type: ignore[arg-type]

    monkeypatch.setattr(Interpreter, "dispatch", spy)
    sched = compiled("tiny-llama", PRESETS["tinypipe"].replace(packing=(2, 2, 2), mapping=(0, 0, 0)), 1)
    run_threads(job("tiny-llama", sched, 2), 1)
    assert seen["opt"] and seen["other"]
    assert not seen["opt"] & seen["other"]
    assert all("optim" in name for name in seen["opt"])


def test_host_worker_runs_in_order_and_times_the_work() -> None:
    """Work runs in submission order after its `before`; the future holds (start, end) or the error."""
    w = HostWorker()
    out: list[str] = []
    futs = [w.submit(lambda i=i: out.append(f"wait{i}"), lambda i=i: out.append(f"run{i}")) for i in range(3)]
    bad = w.submit(lambda: None, lambda: 1 / 0)
    t0, t1 = futs[-1].result()
    assert t0 <= t1
    with pytest.raises(ZeroDivisionError):
        bad.result()
    w.close()
    assert out == ["wait0", "run0", "wait1", "run1", "wait2", "run2"]


def test_host_settings_set_the_switch_interval_and_restore_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank runs at GIL_SWITCH_S (the environment may override it, and the thread count), and the
    process's own settings come back after, also when the body fails."""
    import sys

    before, threads = sys.getswitchinterval(), torch.get_num_threads()
    monkeypatch.delenv("TINYPIPE_GIL_SWITCH_S", raising=False)
    monkeypatch.delenv("TINYPIPE_THREADS", raising=False)
    with host_settings():
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)
        assert torch.get_num_threads() == threads
    assert sys.getswitchinterval() == before
    monkeypatch.setenv("TINYPIPE_GIL_SWITCH_S", "0.003")
    monkeypatch.setenv("TINYPIPE_THREADS", "1")
    with pytest.raises(RuntimeError), host_settings():
        assert sys.getswitchinterval() == pytest.approx(0.003)
        assert torch.get_num_threads() == 1
        raise RuntimeError("the body failed")
    assert sys.getswitchinterval() == before and torch.get_num_threads() == threads


def test_gc_pauses_records_each_collection_within_the_block_only() -> None:
    """Inside the block a collection of at least `min_s` is noted with its generation and host-clock span;
    the callback is gone after, also when the body fails."""
    import gc

    spans: list[tuple[str, float, float]] = []
    with gc_pauses(spans, min_s=0.0):
        gc.collect()
    assert spans and spans[-1][0] == "gc gen2" and spans[-1][1] <= spans[-1][2]
    n = len(spans)
    with pytest.raises(RuntimeError), gc_pauses(spans, min_s=10.0):
        gc.collect()  # shorter than 10 s: not noted
        raise RuntimeError("the body failed")
    gc.collect()
    assert len(spans) == n


def test_cpu_streams_complete_at_once_and_time_the_body() -> None:
    """The CPU stand-in: markers complete when issued, times bracket the body, memory from the callback."""
    s = make_streams(torch.device("cpu"), kept={}, memory=lambda: 123)
    assert isinstance(s, CpuStreams)
    with s.issuing("g0.compute", 7, [1, 2]):
        s.use(torch.zeros(1))
        s.mark_end(7)
    assert s.done(7) and s.done(99)
    s.host_wait([7, 99])
    t = s.times(7)
    assert t is not None and t[0] <= t[1]
    assert s.times(8) is None and s.memory_allocated() == 123
    s.forget()
    assert s.times(7) is None
