"""`tinypipe profile`'s host optimizer steps (backends/profile/optim.py, devloop.py): the device loop the in-run
steps are timed beside, how many steps are timed, and the steps of each kind through the run's host state."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from tinypipe.backends.profile.devloop import DeviceLoop, cycle_actions  # noqa: E402
from tinypipe.backends.profile.measure_layers import LayerBench  # noqa: E402
from tinypipe.backends.profile.measure_loop import LOOP_BUDGET_S, MIN_WINDOWS, time_loop, windows_for  # noqa: E402
from tinypipe.backends.profile.optim import MIN_STEPS, OPT_BUDGET_S, steps_for, time_steps  # noqa: E402
from tinypipe.policy.modes import HostMemory  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 16
CPU = torch.device("cpu")


def test_cycle_actions_are_one_layers_swap_loop() -> None:
    """One window, literal: per cycle LOAD (after the previous cycle's EVICT: one set of the layer's weights
    at a time), the FWDs, the BWDs in reverse, GRAD_OUT after the last BWD, EVICT; the microbatches are
    numbered on across cycles, so a window's inputs never collide."""
    got = [f"{a.id} {a} <- {list(a.deps)}" for a in cycle_actions(1, microbatches=2, cycles=2)]
    assert got == ["0 g0.h2d LOAD L1 <- []", "1 g0.compute FWD L1 m0 <- [0]", "2 g0.compute FWD L1 m1 <- [0]",
                   "3 g0.compute BWD L1 m1 <- []", "4 g0.compute BWD L1 m0 <- []", "5 g0.d2h GRAD_OUT L1 <- [4]",
                   "6 g0.compute EVICT L1 <- []", "7 g0.h2d LOAD L1 <- [6]", "8 g0.compute FWD L1 m2 <- [7]",
                   "9 g0.compute FWD L1 m3 <- [7]", "10 g0.compute BWD L1 m3 <- []", "11 g0.compute BWD L1 m2 <- []",
                   "12 g0.d2h GRAD_OUT L1 <- [11]", "13 g0.compute EVICT L1 <- []"]


def test_cycle_actions_of_one_phase() -> None:
    """A loop of one phase, literal: FWDs only (no BWD, no GRAD_OUT), or BWDs only, which then wait for the
    LOAD themselves (no FWD before them does)."""
    fwd = [f"{a.id} {a} <- {list(a.deps)}" for a in cycle_actions(1, microbatches=2, cycles=1, only="fwd")]
    assert fwd == ["0 g0.h2d LOAD L1 <- []", "1 g0.compute FWD L1 m0 <- [0]", "2 g0.compute FWD L1 m1 <- [0]",
                   "3 g0.compute EVICT L1 <- []"]
    bwd = [f"{a.id} {a} <- {list(a.deps)}" for a in cycle_actions(1, microbatches=2, cycles=1, only="bwd")]
    assert bwd == ["0 g0.h2d LOAD L1 <- []", "1 g0.compute BWD L1 m1 <- [0]", "2 g0.compute BWD L1 m0 <- [0]",
                   "3 g0.d2h GRAD_OUT L1 <- [2]", "4 g0.compute EVICT L1 <- []"]


def test_steps_for_gives_fewer_steps_to_big_layers() -> None:
    """OPT_BUDGET_S of steps after a warm-up of `warm_s`, at least MIN_STEPS, at most the cap (which wins)."""
    assert (OPT_BUDGET_S, MIN_STEPS) == (1.0, 3)
    assert [steps_for(w, 5) for w in (0.01, 0.25, 0.4, 2.0, 0.0)] == [5, 4, 3, 3, 5]
    assert [steps_for(0.01, cap) for cap in (1, 2)] == [1, 2]


@pytest.fixture(scope="module")
def bench() -> LayerBench:
    return LayerBench("tiny-llama", device=CPU, dtype="fp32")


def test_device_loop_runs_the_block_through_the_executor(bench: LayerBench) -> None:
    """Each window runs the block's actions and hands on what they made: nothing is left behind in the
    interpreter (inputs, outputs, gradients), the weights are evicted, and the loop stops when told."""
    loop = DeviceLoop(bench, microbatch_size=2, seq_len=SEQ)
    calls = []

    def done() -> bool:
        calls.append(1)
        return len(calls) == 3

    assert loop.run_until(done) == 3
    assert loop.it.leftovers() == [] and loop.it.weights == {} and loop.it.grads == {}
    assert loop.it.host.version(loop.layer) == 0  # the loop never steps its own host state
    for only in ("fwd", "bwd"):  # a loop of one phase leaves nothing behind either
        one = DeviceLoop(bench, microbatch_size=2, seq_len=SEQ, only=only)  # type: ignore[arg-type]
        kinds = {r.kind for r in one.window().records}
        assert kinds == ({"LOAD", "FWD", "EVICT"} if only == "fwd" else {"LOAD", "BWD", "GRAD_OUT", "EVICT"})
        assert one.it.leftovers() == [] and one.it.weights == {} and one.it.grads == {}


class Watched:
    """A DeviceLoop that notes whether the timed steps had finished when it was started."""

    def __init__(self, loop: DeviceLoop) -> None:
        self.loop = loop
        self.done_before_start: list[bool] = []
        self.windows: list[int] = []

    def run_until(self, done: Callable[[], bool], *, started: Callable[[], None] = lambda: None) -> int:
        self.done_before_start.append(done())
        n = self.loop.run_until(done, started=started)
        self.windows.append(n)
        return n


@pytest.mark.parametrize("layout", tuple(HostMemory))
def test_in_run_steps_wait_for_the_loop(bench: LayerBench, layout: str) -> None:
    """The in-run steps (sync, then async) start only once the loop has started (the last one had not
    finished before it), as many as the alone ones, each > 0; the parameters are the kind's own."""
    watched = Watched(DeviceLoop(bench, microbatch_size=1, seq_len=SEQ))
    got = time_steps(bench, "block", layout, watched, max_steps=3)  # type: ignore[arg-type]
    assert watched.done_before_start == [False, False] and min(watched.windows) >= 1
    assert len(got.alone_s) == len(got.in_run_s) == len(got.async_in_run_s) == 3
    assert min(got.alone_s + got.in_run_s + got.async_in_run_s) > 0
    assert got.params == bench.spec.layers[1].params and got.phases_s == {}


def test_steps_by_phase_run_beside_each_phases_loop(bench: LayerBench) -> None:
    """With a loop per phase, the sync and the async step are also timed beside each (each started only once
    its loop has), and the async one alone: as many steps as the others, each > 0; the medians become
    the OptimizerProfile's phase fields, which `phases_s` reads."""
    from tinypipe.backends.profile.optim import PHASE_FIELDS, measure_optimizer

    mixed = Watched(DeviceLoop(bench, microbatch_size=1, seq_len=SEQ))
    phases = {only: Watched(DeviceLoop(bench, microbatch_size=1, seq_len=SEQ, only=only)) for only in ("fwd", "bwd")}
    got = time_steps(bench, "block", "compact", mixed, max_steps=2, phases=phases)  # type: ignore[arg-type]
    assert sorted(got.phases_s) == sorted(PHASE_FIELDS)
    assert all(len(t) == 2 and min(t) > 0 for t in got.phases_s.values())
    for w in phases.values():
        assert w.done_before_start == [False, False] and min(w.windows) >= 1  # the sync step, then the async
    loops = {only: w.loop for only, w in phases.items()}
    opt, steps, _ = measure_optimizer(bench, mixed.loop, threads=1, max_steps=1, phases=loops)
    block, med = opt["block"], statistics.median
    for layout in tuple(HostMemory):
        # one step per round; a round under steal is taken again, and when no round was quiet the
        # medians are over every round's steps (`quiet_rounds`): compare with the medians of what was kept
        k = steps["block"][layout]
        assert block.phases_s(layout, block.params) == (med(k.alone_s), med(k.phases_s["beside_fwd_s"]),
                                                        med(k.phases_s["beside_bwd_s"]))
        assert block.phases_s(layout, block.params, asynchronous=True) == tuple(
            med(k.phases_s[f]) for f in ("async_alone_s", "async_beside_fwd_s", "async_beside_bwd_s"))


class _FakeSteal:
    """`cpustat.Steal` whose rounds report the shares given, one per meter made."""

    shares: list[float | None] = []

    def __init__(self) -> None:
        self.value = type(self).shares.pop(0)

    def share(self) -> float | None:
        return self.value


@pytest.mark.parametrize("shares, taken, kept", [
    ([0.0, None], 2, 2),  # quiet (or unknown) rounds: as many as asked
    ([0.05, 0.0, 0.002], 3, 2),  # a round under steal is taken again and left out
    ([0.05, 0.03, 0.02, 0.04], 4, 4),  # at most twice the rounds; none quiet: all kept
])
def test_rounds_time_every_kind_again_and_take_the_medians_over_the_quiet_ones(
        bench: LayerBench, monkeypatch: pytest.MonkeyPatch, shares: list[float | None], taken: int,
        kept: int) -> None:
    """With `rounds`, each kind and layout is timed once per round; a round in which the hypervisor took more
    than NOTABLE_STEAL of the host's CPU is taken again (up to `rounds` more) and its steps are left out
    unless no round was quiet; the profile's medians are over the steps kept, and the stolen share is
    reported for every round taken."""
    import statistics

    from tinypipe.backends.profile import optim
    from tinypipe.backends.profile.command import steal_note

    monkeypatch.setattr(_FakeSteal, "shares", list(shares))
    monkeypatch.setattr(optim, "Steal", _FakeSteal)
    loop = DeviceLoop(bench, microbatch_size=1, seq_len=SEQ)
    opt, steps, steal = optim.measure_optimizer(bench, loop, threads=1, max_steps=1, rounds=2)
    assert steal == shares[:taken]
    for kind, by in steps.items():
        for layout, k in by.items():
            assert len(k.alone_s) == len(k.in_run_s) == len(k.async_in_run_s) == kept
            assert opt[kind].alone_s[layout] == statistics.median(k.alone_s)
    note = steal_note(steal)
    assert ("taken again" in note) == (kept < taken) and ("profile again" in note) == (kept == taken > 2)


@pytest.mark.parametrize("layout", tuple(HostMemory))
def test_a_tied_embedding_steps_with_both_shares(tied_config: str, layout: str) -> None:
    """A tied model's embedding is stepped as in a run, with its own gradient and the head's share of the
    matrix (`HostState.step` refuses a tied layer with one share); the head owns only its norm."""
    tied = LayerBench(tied_config, device=CPU, dtype="fp32")
    loop = DeviceLoop(tied, microbatch_size=1, seq_len=SEQ)
    embed = time_steps(tied, "embed", layout, loop, max_steps=1)
    head = time_steps(tied, "head", layout, loop, max_steps=1)
    assert embed.params == tied.spec.layers[0].params and head.params == tied.spec.layers[-1].params
    assert head.params == tied.spec.hidden_size  # the norm


def test_windows_for_fits_the_loops_budget() -> None:
    """LOOP_BUDGET_S of windows after a warm-up window of `warm_s`, at least MIN_WINDOWS, at most the cap."""
    assert (LOOP_BUDGET_S, MIN_WINDOWS) == (0.5, 2)
    assert [windows_for(w, 10) for w in (0.01, 0.1, 0.2, 1.0, 0.0)] == [10, 5, 2, 2, 10]
    assert [windows_for(0.01, cap) for cap in (1, 3)] == [1, 3]


def test_time_loop_takes_every_fwd_and_bwd_of_its_windows(bench: LayerBench) -> None:
    """Alone and beside the stepping optimizer, the same windows (here the cap, 2): 2 cycles x 4 microbatches
    of FWD and of BWD each, every time > 0; the optimizer stepped while the second set ran; the loop's
    interpreter is left clean and its own host state is never stepped."""
    loop = DeviceLoop(bench, microbatch_size=1, seq_len=SEQ)
    got = time_loop(bench, loop, max_windows=2)
    assert got.windows == 2 and got.steps >= 1
    assert [len(t) for t in (got.fwd_alone_s, got.bwd_alone_s, got.fwd_beside_s, got.bwd_beside_s)] == [16] * 4
    assert min(got.fwd_alone_s + got.bwd_alone_s + got.fwd_beside_s + got.bwd_beside_s) > 0
    t = got.times()
    assert (t.fwd_s, t.recompute_bwd_beside_optimizer_s) == (statistics.median(got.fwd_alone_s),
                                                            statistics.median(got.bwd_beside_s))
    assert loop.it.leftovers() == [] and loop.it.host.version(loop.layer) == 0
    # issue gaps: per window 2 cycles x 3 FWDs after a FWD (the first waits for its LOAD) and 4 BWDs
    gaps = (got.fwd_gap_alone_s, got.bwd_gap_alone_s, got.fwd_gap_beside_s, got.bwd_gap_beside_s)
    assert [len(g) for g in gaps] == [12, 16, 12, 16] and min(min(g) for g in gaps) >= 0
    assert (t.fwd_gap_s, t.recompute_bwd_gap_beside_optimizer_s) == (statistics.fmean(got.fwd_gap_alone_s),
                                                                    statistics.fmean(got.bwd_gap_beside_s))
    # issue times are CUDA's (on the CPU stand-in the issue runs the work): none here, and LoopTimes charges the records
    assert (got.fwd_issue_alone_s, got.bwd_issue_beside_s) == ((), ()) and t.fwd_issue_s == 0.0
    assert t.compute_s(True, False) == t.fwd_s


def test_issue_times_are_each_actions_issue_span() -> None:
    """Literal: a FWD's / BWD's issue time is its `RunLog.issue` span (end - start), by record id, per kind and
    condition; LoopSamples keeps their medians."""
    from tinypipe.backends.profile.measure_loop import LoopSamples, issue_fields
    from tinypipe.backends.rank.executor import RunLog
    from tinypipe.ir.timeline import Record

    def rec(i: int, kind: str) -> Record:
        return Record(i, "g0.compute", kind, kind, 1, 0, 0, float(i), i + 0.5)

    log = RunLog(records=[rec(0, "FWD"), rec(1, "FWD"), rec(2, "BWD"), rec(3, "LOAD")],
                 issue=[(0, 0.0, 0.25), (1, 1.0, 1.75), (2, 2.0, 3.0), (3, 3.0, 3.125)])
    other = RunLog(records=[rec(5, "FWD"), rec(6, "BWD")], issue=[(5, 0.0, 2.0), (6, 0.0, 4.0)])
    got = issue_fields([log], [other])
    assert got == {"fwd_issue_alone_s": (0.25, 0.75), "bwd_issue_alone_s": (1.0,), "fwd_issue_beside_s": (2.0,),
                   "bwd_issue_beside_s": (4.0,)}
    t = LoopSamples(windows=1, steps=1, fwd_alone_s=(0.5,), bwd_alone_s=(0.5,), fwd_beside_s=(0.5,),
                    bwd_beside_s=(0.5,), **got).times()
    assert (t.fwd_issue_s, t.recompute_bwd_issue_s, t.fwd_issue_beside_optimizer_s) == (0.5, 1.0, 2.0)
    assert (t.compute_s(True, False), t.compute_s(False, True)) == (0.5, 4.0)


def test_issue_gaps_follow_a_fwd_or_bwd_on_the_same_stream() -> None:
    """Literal: each FWD / BWD's start minus the end of the record before it on its stream (by start), when
    that one is a FWD or BWD; 0 when they overlap; a FWD after a LOAD-bound EVICT, and other streams'
    records, are not counted."""
    from tinypipe.backends.profile.measure_loop import issue_gaps
    from tinypipe.backends.rank.executor import RunLog
    from tinypipe.ir.schedule import Kind
    from tinypipe.ir.timeline import Record

    def rec(i: int, res: str, kind: str, t0: float, t1: float) -> Record:
        return Record(i, f"g0.{res}", kind, kind, 1, 0, 0, t0, t1)

    log = RunLog(records=[rec(0, "h2d", "LOAD", 0.0, 1.0), rec(1, "compute", "FWD", 1.0, 2.0),
                          rec(2, "compute", "FWD", 2.5, 3.0), rec(3, "compute", "BWD", 3.0, 4.0),
                          rec(4, "compute", "BWD", 3.9, 5.0), rec(5, "compute", "EVICT", 5.0, 5.0),
                          rec(6, "compute", "FWD", 7.0, 8.0), rec(7, "d2h", "GRAD_OUT", 5.0, 6.0)])
    assert issue_gaps([log], Kind.FWD) == (0.5,)
    assert issue_gaps([log], Kind.BWD) == (0.0, 0.0)
