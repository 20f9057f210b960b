"""The simulator's engine: stream + event semantics, costs per kind, memory ledgers, results (sim/engine.py).

Exact tests use a hand-built two-GPU machine (one root complex, 25 GB/s PCIe per GPU with 5 µs per
copy, 100 GB/s DRAM, a 40 GB/s DMA cap, GPU peer-to-peer through the root complex) and hand-built
schedules, and assert literal event logs: `<start µs> <end µs> <action>` in start order.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tinypipe.common.errors import CapacityError, InputError, ScheduleError, TinypipeError
from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import GPU, Hardware, Host, Link
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.looptimes import LoopTimes
from tinypipe.describe.model import LayerKind, LayerSpec, ModelSpec
from tinypipe.describe.optimprofile import OptimizerProfile
from tinypipe.describe.trace import KindProfile, ProfileTrace, analytic_trace, trace_for
from tinypipe.estimate.hostmem import COMPACT_OPTIM_FACTOR
from tinypipe.ir.order import layer_owner
from tinypipe.ir.schedule import Action, Kind, Mem, Schedule
from tinypipe.policy import PRESETS
from tinypipe.sim import SimResult, simulate
from tinypipe.sim.durations import link_capacities

MS = 1e-3


def tiny_hardware(*, pcie_gbps: float | tuple[float, ...] = 25.0, dma_gbps: float = 40.0, gpus: int = 2,
                  mem_gbps: float = 100.0, latency_s: float = 5e-6) -> Hardware:
    """GPUs under one root complex; `pcie_gbps` for all GPU links or one per GPU."""
    pcie = pcie_gbps if isinstance(pcie_gbps, tuple) else (pcie_gbps,) * gpus
    return Hardware(
        name="tiny", provenance="spec", source="test fixture",
        host=Host(memory_bytes=10**9, dma_gbps=dma_gbps, cpu_cores=2, adam_params_per_s=1e9),
        gpus=tuple(GPU(f"gpu{i}", "T", 10**9, 1e12, 1000.0) for i in range(len(pcie))),
        switches=("rc0",),
        links=(Link("host", "rc0", "mem", mem_gbps, 0.0),
               *(Link("rc0", f"gpu{i}", "pcie", g, latency_s) for i, g in enumerate(pcie))),
    )


def tiny_model() -> ModelSpec:
    kinds = (LayerKind.EMBED, LayerKind.BLOCK, LayerKind.HEAD)
    params = (1_000_000, 2_000_000, 1_000_000)
    layers = tuple(LayerSpec(i, k, f"{k.value}{i}", p, p, 2.0 * p, 0.0, 64, 32)
                   for i, (k, p) in enumerate(zip(kinds, params)))
    return ModelSpec("tiny", "llama", layers, hidden_size=16, vocab_size=100, num_blocks=1,
                     tied_embeddings=False, max_seq_len=16, source="test fixture")


def tiny_trace(scale: float = 1.0) -> ProfileTrace:
    def kp(fwd_ms: float) -> KindProfile:
        return KindProfile(fwd_ms * MS * scale, 2 * fwd_ms * MS * scale, 3 * fwd_ms * MS * scale, 1024, 512, 256)

    return ProfileTrace("T", "bf16", 1, 16, {"embed": kp(1), "block": kp(2), "head": kp(1)}, analytic=True,
                        source="test fixture")


class Builder:
    """Actions appended in order (ids = positions); `kind` by name, the rest as Action fields."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    def __call__(self, kind: str, resource: str, **kw: Any) -> int:
        i = len(self.actions)
        self.actions.append(Action(i, Kind[kind], resource, **kw))
        return i

    def schedule(self, *, gpus: int = 2, iterations: int = 1, recompute: bool = True,
                 host_memory: str = "replicated", static: tuple[tuple[str, int], ...] = ()) -> Schedule:
        return Schedule(tuple(self.actions), num_gpus=gpus, num_layers=3, iterations=iterations, microbatches=1,
                        tokens_per_microbatch=16, recompute=recompute, pack_layers=((0,), (1,), (2,)),
                        pack_gpu=(0, 0, 1), host_memory=host_memory, static_bytes=static)


def sim(s: Schedule, hw: Hardware | None = None, **kw: Any) -> SimResult:
    return simulate(s, tiny_model(), hw or tiny_hardware(), tiny_trace(), **kw)


def log(r: SimResult) -> list[str]:
    s = sorted(r.timeline.records, key=lambda x: (x.start_s, x.id))
    return [f"{x.start_s * 1e6:.3f} {x.end_s * 1e6:.3f} {x.resource} {x.label}" for x in s]


def test_compute_runs_strictly_in_order_and_waits_for_deps() -> None:
    """A compute stream runs its list in order; an action also waits for a dependency on another stream.

    LOAD L1 (100 MB at 25 GB/s + 5 µs = 4005 µs) gates FWD L1 after FWD L0 (1000 µs); FWD L2 m0 then
    follows FWD L1 m1 although its own LOAD ended long before.
    """
    b = Builder()
    ld1 = b("LOAD", "g0.h2d", layer=1, nbytes=100_000_000)
    b("FWD", "g0.compute", layer=0, microbatch=0)
    b("FWD", "g0.compute", layer=1, microbatch=0, deps=(ld1,))
    b("FWD", "g0.compute", layer=1, microbatch=1)
    ld2 = b("LOAD", "g0.h2d", layer=2, nbytes=2_000_000)
    b("FWD", "g0.compute", layer=2, microbatch=0, deps=(ld2,))
    assert log(sim(b.schedule())) == [
        "0.000 4005.000 g0.h2d LD1",
        "0.000 1000.000 g0.compute F0.0",
        "4005.000 6005.000 g0.compute F1.0",
        "4005.000 4090.000 g0.h2d LD2",
        "6005.000 8005.000 g0.compute F1.1",
        "8005.000 9005.000 g0.compute F2.0",
    ]


def test_send_recv_rendezvous_into_one_copy() -> None:
    """RECV posted at 0 waits for its SEND (ready after FWD at 1000 µs); one copy of 1 MB over
    gpu0 -> rc0 -> gpu1 (10 µs + 40 µs) ends both halves at 1050 µs; the receiver's FWD follows."""
    b = Builder()
    f = b("FWD", "g0.compute", layer=0, microbatch=0)
    b("SEND_F", "g0.send", layer=1, microbatch=0, peer=1, nbytes=1_000_000, deps=(f,))
    rv = b("RECV_F", "g1.recv", layer=1, microbatch=0, peer=0, nbytes=1_000_000)
    b("FWD", "g1.compute", layer=1, microbatch=0, deps=(rv,))
    r = sim(b.schedule())
    assert log(r) == [
        "0.000 1000.000 g0.compute F0.0",
        "0.000 1050.000 g1.recv R1.0",
        "1000.000 1050.000 g0.send S1.0",
        "1050.000 3050.000 g1.compute F1.0",
    ]
    assert r.link_bytes == {"gpu0->rc0": 1_000_000, "rc0->gpu1": 1_000_000}


def test_copy_staged_through_host_crosses_the_dma_cap_twice() -> None:
    """Without GPU peer-to-peer a 4 MB SEND goes gpu0 -> rc0 -> host -> rc0 -> gpu1: it passes the
    40 GB/s DMA cap down and up, so it moves at 20 GB/s: 10 µs + 200 µs."""
    b = Builder()
    b("SEND_F", "g0.send", layer=1, microbatch=0, peer=1, nbytes=4_000_000)
    b("RECV_F", "g1.recv", layer=1, microbatch=0, peer=0, nbytes=4_000_000)
    r = sim(b.schedule(), replace(tiny_hardware(), gpu_p2p=False))
    assert log(r) == ["0.000 210.000 g0.send S1.0", "0.000 210.000 g1.recv R1.0"]
    assert r.link_bytes == {"gpu0->rc0": 4_000_000, "host->rc0": 4_000_000, "host.dma": 8_000_000,
                            "rc0->gpu1": 4_000_000, "rc0->host": 4_000_000}


def test_recv_ready_after_send() -> None:
    """The copy also waits when the receiver is the late half: it starts when RECV is reached."""
    b = Builder()
    b("SEND_F", "g0.send", layer=1, microbatch=0, peer=1, nbytes=1_000_000)
    f = b("FWD", "g1.compute", layer=0, microbatch=0)
    b("RECV_F", "g1.recv", layer=1, microbatch=0, peer=0, nbytes=1_000_000, deps=(f,))
    assert log(sim(b.schedule())) == [
        "0.000 1050.000 g0.send S1.0",
        "0.000 1000.000 g1.compute F0.0",
        "1000.000 1050.000 g1.recv R1.0",
    ]


def test_uploads_to_two_gpus_share_the_dma_cap() -> None:
    """Two 4 MB uploads at once are each held to 20 GB/s by the 40 GB/s DMA cap (not 25 by PCIe)."""
    b = Builder()
    b("LOAD", "g0.h2d", layer=0, nbytes=4_000_000)
    b("LOAD", "g1.h2d", layer=2, nbytes=4_000_000)
    r = sim(b.schedule())
    assert log(r) == ["0.000 205.000 g0.h2d LD0", "0.000 205.000 g1.h2d LD2"]
    assert r.link_bytes == {"host->rc0": 8_000_000, "host.dma": 8_000_000, "rc0->gpu0": 4_000_000,
                            "rc0->gpu1": 4_000_000}


def test_costs_per_kind() -> None:
    """FWD / BWD from the trace (BWD with recompute: 3 x fwd), EVICT 0 s, GRAD_OUT a copy to host,
    OPT_STEP params / AdamW rate x the replicated layout's factor 1.31 (2M params at 1e9/s = 2.62 ms)
    on host.optim after its dependency."""
    b = Builder()
    b("FWD", "g0.compute", layer=1, microbatch=0)
    bw = b("BWD", "g0.compute", layer=1, microbatch=0)
    go = b("GRAD_OUT", "g0.d2h", layer=1, nbytes=4_000_000, deps=(bw,))
    b("EVICT", "g0.compute", layer=1)
    b("OPT_STEP", "host.optim", layer=1, deps=(go,))
    assert log(sim(b.schedule())) == [
        "0.000 2000.000 g0.compute F1.0",
        "2000.000 8000.000 g0.compute B1.0",
        "8000.000 8165.000 g0.d2h GO1",
        "8000.000 8000.000 g0.compute EV1",
        "8165.000 10785.000 host.optim OPT1",
    ]


def test_backward_without_recompute_and_compact_optimizer() -> None:
    """Without recompute BWD takes bwd_s (2 x fwd); the compact host layout slows OPT_STEP by its factor."""
    b = Builder()
    b("BWD", "g0.compute", layer=1, microbatch=0)
    b("OPT_STEP", "host.optim", layer=1)
    r = sim(b.schedule(recompute=False, host_memory="compact"))
    assert log(r) == ["0.000 4000.000 g0.compute B1.0",
                      f"0.000 {2000 * COMPACT_OPTIM_FACTOR:.3f} host.optim OPT1"]
    assert f"{2000 * COMPACT_OPTIM_FACTOR:.3f}" == "3380.000"


MSG = ("g0 out of memory at `g0.h2d LOAD L2` (action 1, t=0.000165 s): needs 2,000,000 bytes (w.L2), "
       "only 1,000,000 of 5,000,000 bytes free; lower the prefetch depth or microbatch size, swap layer "
       "by layer, or use more GPUs")


def _two_loads() -> Schedule:
    b = Builder()
    b("LOAD", "g0.h2d", layer=1, nbytes=4_000_000, allocs=(Mem("g0", "w.L1", 4_000_000),))
    b("LOAD", "g0.h2d", layer=2, nbytes=2_000_000, allocs=(Mem("g0", "w.L2", 2_000_000),))
    b("FWD", "g0.compute", layer=1, microbatch=0, deps=(0,))
    b("EVICT", "g0.compute", layer=1, frees=(Mem("g0", "w.L1", 4_000_000),))
    return b.schedule()


def test_over_capacity_allocation_raises_naming_device_action_and_bytes() -> None:
    """A 5 MB GPU holding w.L1 (4 MB) cannot start the LOAD of w.L2 (2 MB): one-line CapacityError."""
    with pytest.raises(CapacityError) as exc:
        sim(_two_loads(), gpu_mem_bytes=5_000_000)
    assert str(exc.value) == MSG


def test_over_capacity_recorded_and_run_continues() -> None:
    """With on_capacity="record" the run finishes, fits is False and the first violation is kept."""
    r = sim(_two_loads(), gpu_mem_bytes=5_000_000, on_capacity="record")
    assert (r.fits, r.violation, r.peak_bytes["g0"]) == (False, MSG, 6_000_000)
    assert [(round(t * 1e6, 3), b) for t, b in r.timeline.memory["g0"]] == [
        (0.0, 0), (0.0, 4_000_000), (165.0, 6_000_000), (2165.0, 2_000_000)]
    assert sim(_two_loads()).fits


def test_the_allocators_slack_comes_off_the_gpu_capacity() -> None:
    """A GPU's `allocator_slack_bytes` is kept free below its memory or the cap: two loads (6 MB at once) fit a
    6 MB cap without slack and not with 1 byte of it; the recorded capacity is the cap less the slack."""
    import dataclasses

    hw = tiny_hardware()
    slack = dataclasses.replace(hw, gpus=tuple(dataclasses.replace(g, allocator_slack_bytes=1) for g in hw.gpus))
    assert sim(_two_loads(), gpu_mem_bytes=6_000_000).fits
    r = sim(_two_loads(), slack, gpu_mem_bytes=6_000_000, on_capacity="record")
    assert not r.fits and r.capacity_bytes["g0"] == 5_999_999
    assert sim(_two_loads(), slack).capacity_bytes["g0"] == 10**9 - 1  # the whole GPU, less the slack


def test_static_host_bytes_count_and_per_param() -> None:
    """Static host bytes are held from t=0; host bytes per parameter = peak host / model params (4M)."""
    b = Builder()
    b("GRAD_OUT", "g0.d2h", layer=1, nbytes=8_000_000, allocs=(Mem("host", "gring.L1", 8_000_000),))
    b("OPT_STEP", "host.optim", layer=1, deps=(0,), frees=(Mem("host", "gring.L1", 8_000_000),))
    r = sim(b.schedule(static=(("host", 48_000_000),)))
    assert (r.peak_bytes["host"], r.host_bytes_per_param) == (56_000_000, 14.0)


def test_iterations_steady_state_and_tokens_per_s() -> None:
    """Iteration i ends when its compute and every earlier iteration's have ended; the steady state is
    the mean after the first.

    The LOAD of iteration 0 (4005 µs) overlaps the FWDs but is not compute, so it does not mark an
    iteration's end: the FWDs (2000 µs each, back to back) end at 2, 4, 6 and 8 ms.
    """
    b = Builder()
    for i in range(4):
        b("FWD", "g0.compute", layer=1, microbatch=0, iteration=i)
        if i == 0:
            b("LOAD", "g0.h2d", layer=0, nbytes=100_000_000, iteration=0)
    r = sim(b.schedule(iterations=4))
    assert [round(t * 1e6, 3) for t in r.iteration_times_s] == [2000.0, 2000.0, 2000.0, 2000.0]
    assert (round(r.iteration_s * 1e6, 3), round(r.tokens_per_s, 3)) == (2000.0, 8000.0)


def test_iteration_times_of_a_sequential_run() -> None:
    """Iterations that do not overlap last from one end to the next."""
    b = Builder()
    for i in range(3):
        ld = b("LOAD", "g0.h2d", layer=1, nbytes=100_000_000, iteration=i, deps=(len(b.actions) - 1,) if i else ())
        b("FWD", "g0.compute", layer=1, microbatch=0, iteration=i, deps=(ld,))
    r = sim(b.schedule(iterations=3))
    assert [round(t * 1e6, 3) for t in r.iteration_times_s] == [6005.0, 6005.0, 6005.0]
    assert (round(r.iteration_s * 1e6, 3), round(r.tokens_per_s, 3)) == (6005.0, 2664.446)


def test_critical_path_and_busy_fraction() -> None:
    """The path runs LOAD L1 (4005 µs, h2d) -> FWD L1 (2000 µs); FWD L0 (1000 µs) is off it."""
    b = Builder()
    ld = b("LOAD", "g0.h2d", layer=1, nbytes=100_000_000)
    b("FWD", "g0.compute", layer=0, microbatch=0)
    b("FWD", "g0.compute", layer=1, microbatch=0, deps=(ld,))
    r = sim(b.schedule())
    cp = r.critical_path
    assert cp.actions == (0, 2)
    assert {k: round(v, 6) for k, v in cp.by_resource.items()} == {"g0.compute": round(2000 / 6005, 6),
                                                                    "g0.h2d": round(4005 / 6005, 6)}
    assert cp.bottleneck == "g0.h2d"
    assert {k: round(v, 6) for k, v in r.busy_fraction.items()} == {"g0.compute": round(3000 / 6005, 6),
                                                                     "g0.h2d": round(4005 / 6005, 6)}
    row = r.table_row()
    assert (row["fits"], row["bottleneck"]) == (True, "g0.h2d")
    assert r.to_json()["critical_path"]["actions"] == 2
    assert json.loads(json.dumps(r.to_json(timeline=True)))["timeline"]["records"][0][1] == "g0.h2d"


def test_deadlock_is_a_schedule_error_naming_the_stuck_actions() -> None:
    b = Builder()
    b("FWD", "g0.compute", layer=0, microbatch=0, deps=(1,))
    b("FWD", "g1.compute", layer=1, microbatch=0, deps=(0,))
    with pytest.raises(ScheduleError, match=r"deadlocks: 2 of 2 actions never run; `g0.compute FWD L0 m0` "
                                            r"\(action 0\) waits for `g1.compute FWD L1 m0` \(action 1\)"):
        sim(b.schedule())


def test_bad_dependency_is_a_schedule_error() -> None:
    b = Builder()
    b("FWD", "g0.compute", layer=0, microbatch=0, deps=(7,))
    with pytest.raises(ScheduleError, match=r"`g0.compute FWD L0 m0` \(action 0\) depends on action 7, which "
                                            r"does not exist \(ids are 0..0\)"):
        sim(b.schedule())


def test_unmatched_send_is_a_schedule_error() -> None:
    b = Builder()
    b("SEND_F", "g0.send", layer=1, microbatch=0, peer=1, nbytes=10)
    with pytest.raises(ScheduleError, match=r"g0 -> g1: 1 SEND but 0 RECV"):
        sim(b.schedule())


def test_a_kind_without_a_simulator_cost_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind whose cost the simulator does not know is refused, not timed like some other kind."""
    from types import SimpleNamespace

    monkeypatch.setattr(Kind.EVICT, "info", replace(Kind.EVICT.info, cost=SimpleNamespace(value="teleport")))
    b = Builder()
    b("EVICT", "g0.compute", layer=0)
    with pytest.raises(ScheduleError, match=r"`g0.compute EVICT L0` \(action 0\): the simulator has no cost for "
                                            r"kind EVICT \(cost teleport\)"):
        sim(b.schedule())


def test_mismatched_inputs_are_input_errors() -> None:
    b = Builder()
    b("FWD", "g0.compute", layer=0, microbatch=0)
    with pytest.raises(InputError, match="has 1"):
        sim(b.schedule(), tiny_hardware(gpus=1))
    with pytest.raises(InputError, match="profiled at 32 tokens per microbatch but the schedule uses 16"):
        simulate(b.schedule(), tiny_model(), tiny_hardware(),
                 ProfileTrace("T", "bf16", 2, 16, tiny_trace().kinds, True, "x"))
    with pytest.raises(InputError, match="on_capacity"):
        sim(b.schedule(), on_capacity="ignore")


def test_replay_durations_replace_each_actions_cost() -> None:
    """`durations` (replay's hook) fixes an action's time instead of its cost: a FWD 1500 µs instead of
    1000, a 100 MB LOAD 300 µs instead of 4005 (no flow on the link), and each SEND / RECV half its
    own time after the later half is ready (SEND 20 µs, RECV 70 µs from 1500 µs, not one 50 µs copy).
    Actions without a duration keep their cost (the receiver's FWD: 2000 µs)."""
    b = Builder()
    ld = b("LOAD", "g0.h2d", layer=0, nbytes=100_000_000)
    f = b("FWD", "g0.compute", layer=0, microbatch=0, deps=(ld,))
    s = b("SEND_F", "g0.send", layer=1, microbatch=0, peer=1, nbytes=1_000_000, deps=(f,))
    rv = b("RECV_F", "g1.recv", layer=1, microbatch=0, peer=0, nbytes=1_000_000)
    b("FWD", "g1.compute", layer=1, microbatch=0, deps=(rv,))
    r = sim(b.schedule(), durations={ld: 300e-6, f: 1500e-6, s: 20e-6, rv: 70e-6})
    assert log(r) == [
        "0.000 300.000 g0.h2d LD0",
        "0.000 1870.000 g1.recv R1.0",
        "300.000 1800.000 g0.compute F0.0",
        "1800.000 1820.000 g0.send S1.0",
        "1870.000 3870.000 g1.compute F1.0",
    ]
    assert r.link_bytes == {}
    with pytest.raises(InputError, match=r"durations: action 9: -1.0 s"):
        sim(b.schedule(), durations={9: -1.0})


def test_each_rank_steps_on_a_lane_of_its_own() -> None:
    """As in the backend (one optimizer thread per rank), OPT_STEPs of layers on different GPUs overlap and
    those of one GPU's layers run one after another: L0 and L1 on g0, L2 on g1 (replicated: 1M params at
    1e9/s x 1.31 = 1310 us, 2M = 2620 us)."""
    b = Builder()
    for layer in range(3):
        b("OPT_STEP", "host.optim", layer=layer)
    assert log(sim(b.schedule())) == ["0.000 1310.000 host.optim OPT0", "0.000 1310.000 host.optim OPT2",
                                      "1310.000 3930.000 host.optim OPT1"]


def test_replay_lanes_replace_the_resource_lists() -> None:
    """`lanes` (replay's hook) runs the given lists instead of `run_lanes`': on one lane the two ranks'
    OPT_STEPs run one after the other; the measured durations replace the costs."""
    b = Builder()
    o1 = b("OPT_STEP", "host.optim", layer=1)
    o2 = b("OPT_STEP", "host.optim", layer=2)
    one = sim(b.schedule(), durations={o1: 1e-3, o2: 1e-3}, lanes={"host.optim": (o1, o2)})
    two = sim(b.schedule(), durations={o1: 1e-3, o2: 1e-3})
    assert log(one) == ["0.000 1000.000 host.optim OPT1", "1000.000 2000.000 host.optim OPT2"]
    assert log(two) == ["0.000 1000.000 host.optim OPT1", "0.000 1000.000 host.optim OPT2"]
    assert one.busy_fraction["host.optim"] == pytest.approx(1.0)  # one lane busy all along
    assert two.busy_fraction["host.optim"] == pytest.approx(1.0)  # two lanes, each busy all along


def test_a_slow_host_issues_each_load_after_the_fwd_before_it() -> None:
    """`issue` (replay's hook: per action the loop's pass and the handler's time) starts a device action no
    earlier than its issue began, and the host issues one action at a time, lowest id first among the ready
    list heads (backends/rank/executor.py). With 500 us handlers for 300 us FWDs the compute head is always
    ready, so LOAD L1 goes only after FWD L0 m1's issue (1150 us, after its 50 us pass from 600) and FWD L1
    m0 waits for it; without the loop LOAD L1 ran at 200 us and FWD L1 m0 followed FWD L0 m1 at once."""
    b = Builder()
    ld0 = b("LOAD", "g0.h2d", layer=0, nbytes=1_000_000)
    f00 = b("FWD", "g0.compute", layer=0, microbatch=0, deps=(ld0,))
    f01 = b("FWD", "g0.compute", layer=0, microbatch=1)
    ld1 = b("LOAD", "g0.h2d", layer=1, nbytes=1_000_000)
    f10 = b("FWD", "g0.compute", layer=1, microbatch=0, deps=(ld1,))
    durations = {ld0: 200e-6, f00: 300e-6, f01: 300e-6, ld1: 200e-6, f10: 300e-6}
    issue = {ld0: (0.0, 100e-6), f00: (0.0, 500e-6), f01: (50e-6, 500e-6), ld1: (0.0, 100e-6), f10: (0.0, 500e-6)}
    assert log(sim(b.schedule(), durations=durations, issue=issue)) == [
        "0.000 200.000 g0.h2d LD0",
        "200.000 500.000 g0.compute F0.0",
        "650.000 950.000 g0.compute F0.1",
        "1150.000 1350.000 g0.h2d LD1",
        "1350.000 1650.000 g0.compute F1.0",
    ]
    assert log(sim(b.schedule(), durations=durations)) == [
        "0.000 200.000 g0.h2d LD0",
        "200.000 500.000 g0.compute F0.0",
        "200.000 400.000 g0.h2d LD1",
        "500.000 800.000 g0.compute F0.1",
        "800.000 1100.000 g0.compute F1.0",
    ]


def test_a_fast_host_runs_ahead_by_two_computes_and_polls_for_the_evict_before_a_load() -> None:
    """With issue times of 0 the host keeps RUNAHEAD_COMPUTE (2) FWD / BWD in flight, so LOAD L1, listed
    after FWD L0 m2, goes at 0 while FWD L0 m2 waits for FWD L0 m0 to end. LOAD L2 waits for the device to
    have run EVICT L1 (ends at 2100 us with FWD L1 m0); the sleeping host sees that at the end of its
    0.5 ms pause (2500 us), and FWD L2 m0 waits for the upload."""
    b = Builder()
    f = [b("FWD", "g0.compute", layer=0, microbatch=m) for m in range(3)]
    ld1 = b("LOAD", "g0.h2d", layer=1, nbytes=1_000_000)
    f10 = b("FWD", "g0.compute", layer=1, microbatch=0, deps=(ld1,))
    ev1 = b("EVICT", "g0.compute", layer=1)
    ld2 = b("LOAD", "g0.h2d", layer=2, nbytes=1_000_000, deps=(ev1,))
    f20 = b("FWD", "g0.compute", layer=2, microbatch=0, deps=(ld2,))
    durations = {**{i: 600e-6 for i in f}, ld1: 200e-6, f10: 300e-6, ev1: 0.0, ld2: 200e-6, f20: 300e-6}
    issue = {i: (0.0, 0.0) for i in range(len(b.actions))}
    assert log(sim(b.schedule(), durations=durations, issue=issue)) == [
        "0.000 600.000 g0.compute F0.0",
        "0.000 200.000 g0.h2d LD1",
        "600.000 1200.000 g0.compute F0.1",
        "1200.000 1800.000 g0.compute F0.2",
        "1800.000 2100.000 g0.compute F1.0",
        "2100.000 2100.000 g0.compute EV1",
        "2500.000 2700.000 g0.h2d LD2",
        "2700.000 3000.000 g0.compute F2.0",
    ]
    assert "2100.000 2300.000 g0.h2d LD2" in log(sim(b.schedule(), durations=durations))  # no loop: at once


def test_opt_step_takes_the_traces_measured_step_per_kind() -> None:
    """A trace that carries a kind's measured step (`KindProfile.optimizer`) sets OPT_STEP for its layers
    and layout: the block's compact step measured at 5 ms for 1M parameters costs the 2M-parameter
    layer 1 10 ms; the embedding (no measurement) keeps the host's rate (1M params at 1e9/s x the
    compact factor 1.69 = 1690 us); under the replicated layout, which the trace did not measure, the
    block falls back too (2620 us)."""
    t = tiny_trace()
    block = replace(t.kinds["block"], optimizer=OptimizerProfile(params=1_000_000, threads=4, alone_s={"compact": 4e-3},
                                                                 in_run_s={"compact": 5e-3}))
    measured = replace(t, kinds={**t.kinds, "block": block})
    b = Builder()
    b("OPT_STEP", "host.optim", layer=0)
    b("OPT_STEP", "host.optim", layer=1)
    r = simulate(b.schedule(host_memory="compact"), tiny_model(), tiny_hardware(), measured)
    assert log(r) == ["0.000 1690.000 host.optim OPT0", "1690.000 11690.000 host.optim OPT1"]
    r = simulate(b.schedule(host_memory="replicated"), tiny_model(), tiny_hardware(), measured)
    assert log(r) == ["0.000 1310.000 host.optim OPT0", "1310.000 3930.000 host.optim OPT1"]


def looped_trace() -> ProfileTrace:
    """tiny_trace with the block's loop times: FWD 1.5 ms alone, 2.5 ms beside the optimizer; BWD 4 / 7 ms
    (isolated: FWD 2 ms, recomputing BWD 6 ms, BWD from kept activations 4 ms)."""
    t = tiny_trace()
    loop = LoopTimes(fwd_s=1.5 * MS, recompute_bwd_s=4 * MS, fwd_beside_optimizer_s=2.5 * MS,
                     recompute_bwd_beside_optimizer_s=7 * MS)
    return replace(t, kinds={**t.kinds, "block": replace(t.kinds["block"], loop=loop)})


def _beside_schedule(recompute: bool) -> Schedule:
    b = Builder()
    b("OPT_STEP", "host.optim", layer=0)  # rank 0's lane: 0-1310 us
    b("FWD", "g0.compute", layer=0, microbatch=0)  # the embedding: no loop times
    b("FWD", "g0.compute", layer=1, microbatch=0)
    b("BWD", "g0.compute", layer=1, microbatch=0)
    b("FWD", "g0.compute", layer=1, microbatch=1)
    b("BWD", "g0.compute", layer=1, microbatch=1)
    f2 = b("FWD", "g1.compute", layer=2, microbatch=0)
    b2 = b("BWD", "g1.compute", layer=2, microbatch=0, deps=(f2,))
    b("OPT_STEP", "host.optim", layer=2, deps=(b2,))  # rank 1's lane: 3000-4310 us
    return b.schedule(recompute=recompute)


def test_a_recomputed_block_takes_its_loop_time_beside_a_running_step_or_alone() -> None:
    """Start-time rule: F1.0 starts at 1000 us while rank 0's OPT0 runs (to 1310): 2.5 ms beside; B1.0
    starts at 3500 while rank 1's OPT2 runs (3000-4310; any lane counts): 7 ms beside, to 10500, though the
    step ends long before; F1.1 and B1.1 start with no step running: 1.5 and 4 ms alone. The embedding and
    the head (no loop times) keep the trace's isolated times."""
    r = simulate(_beside_schedule(True), tiny_model(), tiny_hardware(), looped_trace())
    assert log(r) == [
        "0.000 1310.000 host.optim OPT0",
        "0.000 1000.000 g0.compute F0.0",
        "0.000 1000.000 g1.compute F2.0",
        "1000.000 3500.000 g0.compute F1.0",
        "1000.000 3000.000 g1.compute B2.0",
        "3000.000 4310.000 host.optim OPT2",
        "3500.000 10500.000 g0.compute B1.0",
        "10500.000 12000.000 g0.compute F1.1",
        "12000.000 16000.000 g0.compute B1.1",
    ]


def test_a_looped_action_waits_its_issue_gap_after_the_lanes_last_compute() -> None:
    """With the loop's issue gaps (FWD 0.3 ms alone / 0.5 beside a step, BWD 0.2 / 0.4), a recomputed block's
    FWD / BWD starts no earlier than its gap after the lane's previous FWD / BWD ended: F1.0, ready at 1000
    us while OPT0 runs (0-1310), 0.5 ms after F0.0 and at its beside time; B1.0 0.2 ms after F1.0 (no step
    running); F1.1, ready only when g1's F2.6 ends at 9000 us (after B1.0's end + 0.3 ms), starts then. The
    lane's first compute (F0.0, the embedding: no loop) and g1's head never wait."""
    t = looped_trace()
    loop = replace(t.kinds["block"].loop, fwd_gap_s=0.3 * MS, recompute_bwd_gap_s=0.2 * MS,
                   fwd_gap_beside_optimizer_s=0.5 * MS, recompute_bwd_gap_beside_optimizer_s=0.4 * MS)
    gapped = replace(t, kinds={**t.kinds, "block": replace(t.kinds["block"], loop=loop)})
    b = Builder()
    b("OPT_STEP", "host.optim", layer=0)
    b("FWD", "g0.compute", layer=0, microbatch=0)
    b("FWD", "g0.compute", layer=1, microbatch=0)
    b("BWD", "g0.compute", layer=1, microbatch=0)
    b("FWD", "g1.compute", layer=2, microbatch=0)
    b("BWD", "g1.compute", layer=2, microbatch=0)
    last = [b("FWD", "g1.compute", layer=2, microbatch=m) for m in range(1, 7)][-1]
    b("FWD", "g0.compute", layer=1, microbatch=1, deps=(last,))
    r = simulate(b.schedule(), tiny_model(), tiny_hardware(), gapped)
    assert [x for x in log(r) if "g1" not in x or "F2.6" in x] == [
        "0.000 1310.000 host.optim OPT0",
        "0.000 1000.000 g0.compute F0.0",
        "1500.000 4000.000 g0.compute F1.0",
        "4200.000 8200.000 g0.compute B1.0",
        "8000.000 9000.000 g1.compute F2.6",
        "9000.000 10500.000 g0.compute F1.1",
    ]
    assert log(r)[2:4] == ["0.000 1000.000 g1.compute F2.0", "1000.000 3000.000 g1.compute B2.0"]


def test_a_block_not_recomputed_or_replayed_keeps_its_times() -> None:
    """Without recompute the loop times do not apply (F1 2 ms, B1 from kept activations 4 ms, step or
    not); with replay's durations every action takes its measured time, a looped one too."""
    r = simulate(_beside_schedule(False), tiny_model(), tiny_hardware(), looped_trace())
    assert [x for x in log(r) if "g0.compute" in x] == [
        "0.000 1000.000 g0.compute F0.0", "1000.000 3000.000 g0.compute F1.0", "3000.000 7000.000 g0.compute B1.0",
        "7000.000 9000.000 g0.compute F1.1", "9000.000 13000.000 g0.compute B1.1"]
    r = simulate(_beside_schedule(True), tiny_model(), tiny_hardware(), looped_trace(),
                 durations={2: 1e-3, 3: 1e-3, 4: 1e-3, 5: 1e-3})
    assert [x for x in log(r) if "g0.compute" in x] == [
        "0.000 1000.000 g0.compute F0.0", "1000.000 2000.000 g0.compute F1.0", "2000.000 3000.000 g0.compute B1.0",
        "3000.000 4000.000 g0.compute F1.1", "4000.000 5000.000 g0.compute B1.1"]


def phased_trace(*, asynchronous: bool = False) -> ProfileTrace:
    """tiny_trace whose block (1M parameters measured) steps 2 ms alone, 6 ms beside FWDs and 4 ms beside BWDs
    (compact; the sync step's fields, or with `asynchronous` the async step's), 5 ms in a mixed loop."""
    t = tiny_trace()
    times = {"alone_s": {"compact": 2 * MS}, "beside_fwd_s": {"compact": 6 * MS},
             "beside_bwd_s": {"compact": 4 * MS}}
    if asynchronous:
        times = {"alone_s": {"compact": 1 * MS}, **{f"async_{k}": v for k, v in times.items()}}
    opt = OptimizerProfile(params=1_000_000, threads=4, in_run_s={"compact": 5 * MS}, **times)
    return replace(t, kinds={**t.kinds, "block": replace(t.kinds["block"], optimizer=opt)})


def _phase_schedule(optimizer: str = "sync") -> Schedule:
    b = Builder()
    b("OPT_STEP", "host.optim", layer=1)  # g0's layer: 2M parameters, twice the measured block's times
    b("FWD", "g0.compute", layer=0, microbatch=0)  # 0-1000 us
    b("BWD", "g0.compute", layer=0, microbatch=0)  # 1000-4000 (recomputing: 3 ms)
    b("FWD", "g1.compute", layer=2, microbatch=0)  # g1 keeps computing: its phase is not g0's
    b("BWD", "g1.compute", layer=2, microbatch=0)
    b("FWD", "g1.compute", layer=2, microbatch=1)
    b("FWD", "g1.compute", layer=2, microbatch=2)
    last = b("FWD", "g1.compute", layer=2, microbatch=3)  # ends at 6000
    b("EVICT", "g0.compute", layer=0)  # no time: keeps the phase
    b("FWD", "g0.compute", layer=0, microbatch=1, deps=(last,))  # g0 waits 4000-6000, then 6000-7000
    s = b.schedule(host_memory="compact")
    return replace(s, optimizer=optimizer)


def test_a_phased_step_runs_at_the_rate_of_its_ranks_compute_phase() -> None:
    """With the step measured by phase, OPT1 (g0's layer: 12 ms beside FWDs, 8 ms beside BWDs, 4 ms alone) is
    a fluid: 1000/12000 of it beside F0.0, 3000/8000 beside B0.0, 2000/4000 while g0 waits for g1 (g1's
    compute does not count; EV0 takes no time and keeps the phase), so 1/24 is left when F0.1 starts at
    6000 us, which it finishes at the FWD rate: 500 us later. The mixed loop's 10 ms is not used."""
    r = simulate(_phase_schedule(), tiny_model(), tiny_hardware(), phased_trace())
    assert log(r) == [
        "0.000 6500.000 host.optim OPT1",
        "0.000 1000.000 g0.compute F0.0",
        "0.000 1000.000 g1.compute F2.0",
        "1000.000 4000.000 g0.compute B0.0",
        "1000.000 3000.000 g1.compute B2.0",
        "3000.000 4000.000 g1.compute F2.1",
        "4000.000 5000.000 g1.compute F2.2",
        "4000.000 4000.000 g0.compute EV0",
        "5000.000 6000.000 g1.compute F2.3",
        "6000.000 7000.000 g0.compute F0.1",
    ]


def test_the_async_step_takes_its_own_phases() -> None:
    """Under the async optimizer the async step's phases apply (the same times here), not the sync step's
    (2 ms alone, no FWD / BWD times: the trace measured only the mixed loop for sync, 10 ms whatever runs)."""
    asy = simulate(_phase_schedule("async"), tiny_model(), tiny_hardware(), phased_trace(asynchronous=True))
    assert log(asy)[0] == "0.000 6500.000 host.optim OPT1"
    syn = simulate(_phase_schedule("sync"), tiny_model(), tiny_hardware(), phased_trace(asynchronous=True))
    assert log(syn)[0] == "0.000 10000.000 host.optim OPT1"


def test_a_phased_step_alone_and_replayed() -> None:
    """A rank that computes nothing steps at the alone rate (4 ms), and one whose compute lane has run out
    goes back to it: OPT1 runs 3000 us beside FWDs (F0.0, F0.1, F0.2 back to back: 1/4 of it) and the rest
    alone (3 ms). Replay's measured duration replaces the fluid (its record still counts as a running step)."""
    b = Builder()
    b("OPT_STEP", "host.optim", layer=1)
    alone = simulate(b.schedule(host_memory="compact"), tiny_model(), tiny_hardware(), phased_trace())
    assert log(alone) == ["0.000 4000.000 host.optim OPT1"]
    for m in range(3):
        b("FWD", "g0.compute", layer=0, microbatch=m)
    r = simulate(b.schedule(host_memory="compact"), tiny_model(), tiny_hardware(), phased_trace())
    assert log(r)[0] == "0.000 6000.000 host.optim OPT1"
    r = simulate(b.schedule(host_memory="compact"), tiny_model(), tiny_hardware(), phased_trace(), durations={0: 1e-3})
    assert log(r)[0] == "0.000 1000.000 host.optim OPT1"


@settings(max_examples=25, deadline=None)
@given(st.floats(0.5, 50.0), st.sampled_from(["sync", "async"]), st.sampled_from(["compact", "replicated"]))
def test_equal_phases_are_the_fixed_step(step_ms: float, optimizer: str, layout: str) -> None:
    """A trace whose step is the same in every phase predicts what one fixed step time predicts: the fluid
    changes rate only when the phase's time differs (compiled 2-GPU pipelines over the chain model)."""
    model = chain_model(4)
    trace = trace_for(model, tiny_hardware().gpus[0], 1, 16)
    flat = {layout: step_ms * MS}
    fixed_opt = OptimizerProfile(params=2_000_000, threads=4, alone_s=flat, in_run_s=flat, async_in_run_s=flat)
    phased_opt = replace(fixed_opt, async_alone_s=flat, beside_fwd_s=flat, beside_bwd_s=flat, async_beside_fwd_s=flat,
                         async_beside_bwd_s=flat)

    def with_opt(opt: OptimizerProfile) -> ProfileTrace:
        return replace(trace, kinds={**trace.kinds, "block": replace(trace.kinds["block"], optimizer=opt)})

    policy = PRESETS["tinypipe"].replace(optimizer=optimizer, host_memory=layout, microbatches=3)
    sched = compile_schedule(policy, model, tiny_hardware(), with_opt(fixed_opt), iterations=2)
    a = simulate(sched, model, tiny_hardware(), with_opt(fixed_opt))
    b = simulate(sched, model, tiny_hardware(), with_opt(phased_opt))
    assert [t for x in b.timeline.records for t in (x.start_s, x.end_s)] == pytest.approx(
        [t for x in a.timeline.records for t in (x.start_s, x.end_s)], rel=1e-9, abs=1e-12)


# ---- properties over hand-built pipeline schedules -------------------------------------------------

def chain_model(blocks: int) -> ModelSpec:
    """embed, `blocks` blocks, head; 1M / 2M / 1M parameters."""
    kinds = (LayerKind.EMBED, *([LayerKind.BLOCK] * blocks), LayerKind.HEAD)
    layers = tuple(LayerSpec(i, k, f"{k.value}{i}", 2_000_000 if k is LayerKind.BLOCK else 1_000_000,
                             2_000_000 if k is LayerKind.BLOCK else 1_000_000, 1.0, 0.0, 64, 32)
                   for i, k in enumerate(kinds))
    return ModelSpec("chain", "llama", layers, hidden_size=16, vocab_size=100, num_blocks=blocks,
                     tied_embeddings=False, max_seq_len=16, source="test fixture")


def pipeline(model: ModelSpec, gpus: int, microbatches: int, iterations: int, act_bytes: int) -> Schedule:
    """A layer-per-pack pipeline, packs round-robin over GPUs, built in one sequential program order
    (so it cannot deadlock): per iteration LOAD each layer (after its previous OPT_STEP), forward with
    SEND/RECV between GPUs, backward in reverse, then GRAD_OUT, EVICT and OPT_STEP per layer."""
    b = Builder()
    n = len(model.layers)
    gpu = [layer % gpus for layer in range(n)]
    opt: dict[int, int] = {}
    for it in range(iterations):
        last_fwd: dict[int, int] = {}
        for layer in range(n):
            g = gpu[layer]
            wb = model.layers[layer].param_bytes()
            ld = b("LOAD", f"g{g}.h2d", layer=layer, nbytes=wb, iteration=it,
                   deps=(opt[layer],) if layer in opt else (), allocs=(Mem(f"g{g}", f"w.L{layer}", wb),))
            for m in range(microbatches):
                deps = [ld]
                if layer and gpu[layer - 1] != g:
                    p = gpu[layer - 1]
                    b("SEND_F", f"g{p}.send", layer=layer, microbatch=m, peer=g, nbytes=act_bytes, iteration=it,
                      deps=(last_fwd[m],))
                    deps.append(b("RECV_F", f"g{g}.recv", layer=layer, microbatch=m, peer=p, nbytes=act_bytes,
                                  iteration=it))
                last_fwd[m] = b("FWD", f"g{g}.compute", layer=layer, microbatch=m, iteration=it, deps=tuple(deps))
        last_bwd: dict[int, int] = {}
        for layer in reversed(range(n)):
            g = gpu[layer]
            for m in range(microbatches):
                deps = []
                if layer < n - 1 and gpu[layer + 1] != g:
                    p = gpu[layer + 1]
                    b("SEND_B", f"g{p}.send", layer=layer, microbatch=m, peer=g, nbytes=act_bytes, iteration=it,
                      deps=(last_bwd[m],))
                    deps.append(b("RECV_B", f"g{g}.recv", layer=layer, microbatch=m, peer=p, nbytes=act_bytes,
                                  iteration=it))
                last_bwd[m] = b("BWD", f"g{g}.compute", layer=layer, microbatch=m, iteration=it, deps=tuple(deps))
            wb = model.layers[layer].param_bytes()
            go = b("GRAD_OUT", f"g{g}.d2h", layer=layer, nbytes=2 * wb, iteration=it, deps=(last_bwd[0],))
            b("EVICT", f"g{g}.compute", layer=layer, iteration=it, frees=(Mem(f"g{g}", f"w.L{layer}", wb),))
            opt[layer] = b("OPT_STEP", "host.optim", layer=layer, iteration=it, deps=(go,))
    return Schedule(tuple(b.actions), num_gpus=gpus, num_layers=n, iterations=iterations,
                    microbatches=microbatches, tokens_per_microbatch=16, recompute=True,
                    pack_layers=tuple((layer,) for layer in range(n)), pack_gpu=tuple(gpu))


def mesh_hardware(pcie: tuple[float, ...], nvlink_gbps: float) -> Hardware:
    """Where no two copies can ever share a capacity: each GPU under its own root complex with its
    own DRAM link, an NVLink between every pair (so SEND/RECV never touch PCIe), and a DMA cap far
    above all links together. Each stream runs one copy at a time, so every copy has its own path."""
    g = len(pcie)
    return Hardware(
        name="mesh", provenance="spec", source="test fixture",
        host=Host(memory_bytes=10**12, dma_gbps=1e6, cpu_cores=2, adam_params_per_s=1e9),
        gpus=tuple(GPU(f"gpu{i}", "T", 10**12, 1e12, 1000.0) for i in range(g)),
        switches=tuple(f"rc{i}" for i in range(g)),
        links=(*(Link("host", f"rc{i}", "mem", 2 * pcie[i], 0.0) for i in range(g)),
               *(Link(f"rc{i}", f"gpu{i}", "pcie", pcie[i], 5e-6) for i in range(g)),
               *(Link(f"gpu{i}", f"gpu{j}", "nvlink", nvlink_gbps, 2e-6) for i in range(g) for j in range(i + 1, g))),
    )


def test_more_bandwidth_can_slow_a_run_under_fair_sharing() -> None:
    """Why monotonicity needs a tolerance: doubling PCIe bandwidth makes this run 10% longer.

    F (100 MB upload to gpu0, 10 ms at the 10 GB/s DMA cap) gates FWD L1 (10 ms). A 300 MB copy
    gpu1 -> gpu2 (12 ms at 25 GB/s) gates E, a 20 MB upload to gpu1. At 25 GB/s, E starts at 12 ms,
    after F: the run ends at 20 ms. At 50 GB/s the copy ends at 6 ms, E then splits the DMA cap with
    F, F ends at 12 ms and the run at 22 ms. The same happens on real hardware that shares fairly.
    """
    b = Builder()
    f = b("LOAD", "g0.h2d", layer=1, nbytes=100_000_000)
    b("FWD", "g0.compute", layer=1, microbatch=0, deps=(f,))
    b("SEND_F", "g1.send", layer=1, microbatch=0, peer=2, nbytes=300_000_000)
    rv = b("RECV_F", "g2.recv", layer=1, microbatch=0, peer=1, nbytes=300_000_000)
    b("LOAD", "g1.h2d", layer=2, nbytes=20_000_000, deps=(rv,))
    s = b.schedule(gpus=3)
    ends = [round(simulate(s, tiny_model(), tiny_hardware(pcie_gbps=g, dma_gbps=10, gpus=3, latency_s=0.0),
                           tiny_trace(5.0)).makespan_s * 1e3, 6) for g in (25.0, 50.0)]
    assert ends == [20.0, 22.0]


pipelines = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
                      st.sampled_from([10_000, 1_000_000, 5_000_000]))  # blocks, gpus, microbatches, act bytes
bandwidths = st.sampled_from([1.0, 2.0, 5.0, 10.0, 25.0])
speedups = st.sampled_from([1.5, 2.0, 4.0])
trace_scales = st.sampled_from([0.01, 0.1, 1.0])


@settings(max_examples=25, deadline=None)
@given(pipelines, bandwidths, bandwidths, trace_scales)
def test_deterministic(p: tuple[int, int, int, int], pcie: float, dma: float, scale: float) -> None:
    """The same inputs give the same timeline, memory and result twice."""
    blocks, gpus, mbs, act = p
    m = chain_model(blocks)
    s = pipeline(m, gpus, mbs, 2, act)
    hw = tiny_hardware(pcie_gbps=pcie, dma_gbps=dma, gpus=gpus)
    r1, r2 = (simulate(s, m, hw, tiny_trace(scale)) for _ in range(2))
    assert r1.timeline == r2.timeline
    j1, j2 = r1.to_json(), r2.to_json()
    j1.pop("wall_s")
    j2.pop("wall_s")
    assert j1 == j2


@settings(max_examples=25, deadline=None)
@given(pipelines, st.tuples(bandwidths, bandwidths, bandwidths), bandwidths, bandwidths, trace_scales)
def test_never_beats_the_lower_bound(p: tuple[int, int, int, int], pcie: tuple[float, float, float], mem: float,
                                     dma: float, scale: float) -> None:
    """The run (so also its mean iteration: every iteration here does the same work) takes at least
    max(compute on any GPU, optimizer work, bytes through any capacity / its bandwidth)."""
    blocks, gpus, mbs, act = p
    m = chain_model(blocks)
    s = pipeline(m, gpus, mbs, 3, act)
    hw = tiny_hardware(pcie_gbps=pcie[:gpus], dma_gbps=dma, mem_gbps=mem)
    r = simulate(s, m, hw, tiny_trace(scale))
    busy = r.timeline.busy_s()
    cap = link_capacities(hw)
    bound = max([busy.get(f"g{g}.compute", 0.0) for g in range(gpus)] + optimizer_busy(s, r)
                + [n / cap[k] for k, n in r.link_bytes.items()])
    assert r.makespan_s >= bound * (1 - 1e-9)


def optimizer_busy(s: Schedule, r: SimResult) -> list[float]:
    """Seconds of OPT_STEP per rank: each rank's optimizer lane must run its own steps one after another."""
    owner = layer_owner(s)
    out = [0.0] * s.num_gpus
    for x in r.timeline.records:
        if x.resource == "host.optim":
            out[owner[x.layer]] += x.end_s - x.start_s
    return out


def _faster(m: ModelSpec, s: Schedule, hw: Hardware, hw2: Hardware, scale: float, k: float,
            what: str) -> tuple[list[float], list[float]]:
    base = simulate(s, m, hw, tiny_trace(scale)).timeline.iteration_ends_s()
    if what == "compute":
        fast = simulate(s, m, hw, tiny_trace(scale / k))
    else:
        fast = simulate(s, m, hw2, tiny_trace(scale))
    return base, fast.timeline.iteration_ends_s()


@settings(max_examples=30, deadline=None)
@given(pipelines, st.tuples(bandwidths, bandwidths, bandwidths), bandwidths, trace_scales, speedups,
       st.sampled_from(["compute", "pcie", "nvlink"]), st.integers(0, 2))
def test_faster_never_slower_without_sharing(p: tuple[int, int, int, int], pcie: tuple[float, float, float],
                                             nvlink: float, scale: float, k: float, what: str, which: int) -> None:
    """Where no two copies share a capacity (mesh_hardware), every action's time is fixed and it
    starts at the max of its predecessors' ends, so times are monotone: faster compute or a faster
    link never ends any iteration later (exactly, up to float rounding: 1e-9 relative)."""
    blocks, gpus, mbs, act = p
    m = chain_model(blocks)
    s = pipeline(m, gpus, mbs, 3, act)
    links = pcie[:gpus]
    faster = tuple(x * k if i == which % gpus and what == "pcie" else x for i, x in enumerate(links))
    hw, hw2 = mesh_hardware(links, nvlink), mesh_hardware(faster, nvlink * k if what == "nvlink" else nvlink)
    base, fast = _faster(m, s, hw, hw2, scale, k, what)
    assert all(f <= b * (1 + 1e-9) for f, b in zip(fast, base)), (base, fast)


# Max-min fair sharing is not monotone (test_more_bandwidth_can_slow_a_run_under_fair_sharing: +10%),
# and no tight bound exists: the slow-down is the bytes an earlier copy takes from a critical one.
# Over ~12,000 random cases of the hand-built generator the worst slow-down seen was 5.3%, over
# ~3,000 compiled schedules 2.6%; the properties hold within SHARING_SLACK, with derandomized
# examples so that the tests cannot flake. Without sharing the property is exact (above).
SHARING_SLACK = 0.15


@settings(max_examples=30, deadline=None, derandomize=True)
@given(pipelines, st.tuples(bandwidths, bandwidths, bandwidths), bandwidths, bandwidths, trace_scales, speedups,
       st.sampled_from(["compute", "pcie", "mem", "dma"]), st.integers(0, 2))
def test_faster_never_much_slower_with_sharing(p: tuple[int, int, int, int], pcie: tuple[float, float, float],
                                               mem: float, dma: float, scale: float, k: float, what: str,
                                               which: int) -> None:
    """With shared PCIe, DRAM and DMA capacities, faster compute or more bandwidth ends no iteration
    more than SHARING_SLACK later (fair sharing lets an earlier copy steal bandwidth from a critical one)."""
    blocks, gpus, mbs, act = p
    m = chain_model(blocks)
    s = pipeline(m, gpus, mbs, 3, act)
    links = pcie[:gpus]
    faster = tuple(x * k if i == which % gpus and what == "pcie" else x for i, x in enumerate(links))
    hw = tiny_hardware(pcie_gbps=links, mem_gbps=mem, dma_gbps=dma)
    hw2 = tiny_hardware(pcie_gbps=faster, mem_gbps=mem * k if what == "mem" else mem,
                        dma_gbps=dma * k if what == "dma" else dma)
    base, fast = _faster(m, s, hw, hw2, scale, k, what)
    assert all(f <= b * (1 + SHARING_SLACK) for f, b in zip(fast, base)), (base, fast)


# ---- properties over compiled schedules ---------------------------------------------------------------

def faster_trace(trace: ProfileTrace, k: float) -> ProfileTrace:
    """Every compute time divided by k (sizes unchanged)."""
    return replace(trace, kinds={n: replace(p, fwd_s=p.fwd_s / k, bwd_s=p.bwd_s / k,
                                            recompute_bwd_s=p.recompute_bwd_s / k) for n, p in trace.kinds.items()})


@st.composite
def compiled(draw: st.DrawFn) -> tuple[ModelSpec, Schedule, Hardware, ProfileTrace, tuple[float, ...], float, float]:
    """A preset policy (microbatches, prefetch depth varied) compiled for tiny-llama on 1-3 GPUs."""
    model = load_model("tiny-llama")
    gpus = draw(st.integers(1, 3))
    pcie = tuple(draw(st.sampled_from([0.5, 1.0, 5.0, 25.0])) for _ in range(gpus))
    mem, dma = draw(st.sampled_from([1.0, 5.0, 100.0])), draw(st.sampled_from([0.5, 5.0, 40.0]))
    policy = PRESETS[draw(st.sampled_from(sorted(PRESETS)))].replace(
        microbatches=draw(st.integers(1, 4)), prefetch_depth=draw(st.integers(0, 2)))
    hw = tiny_hardware(pcie_gbps=pcie, mem_gbps=mem, dma_gbps=dma)
    trace = faster_trace(analytic_trace(model, hw.gpus[0], microbatch_size=1, seq_len=64),
                         draw(st.sampled_from([0.1, 1.0, 10.0])))
    try:
        sched = compile_schedule(policy, model, hw, trace, iterations=3)
    except TinypipeError:
        assume(False)
    return model, sched, hw, trace, pcie, mem, dma


@settings(max_examples=20, deadline=None, derandomize=True)
@given(compiled())
def test_compiled_deterministic_and_above_the_lower_bound(c: tuple[Any, ...]) -> None:
    """A compiled schedule simulates the same twice, and no faster than its busiest GPU, optimizer or capacity."""
    model, sched, hw, trace, *_ = c
    r1, r2 = (simulate(sched, model, hw, trace, on_capacity="record") for _ in range(2))
    assert r1.timeline == r2.timeline and r1.peak_bytes == r2.peak_bytes and r1.violation == r2.violation
    busy, cap = r1.timeline.busy_s(), link_capacities(hw)
    bound = max([busy.get(f"g{g}.compute", 0.0) for g in range(sched.num_gpus)] + optimizer_busy(sched, r1)
                + [n / cap[k] for k, n in r1.link_bytes.items()])
    assert r1.makespan_s >= bound * (1 - 1e-9)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(compiled(), speedups, st.sampled_from(["compute", "pcie", "mem", "dma"]), st.integers(0, 2))
def test_compiled_faster_never_much_slower(c: tuple[Any, ...], k: float, what: str, which: int) -> None:
    """The same compiled schedule on faster compute or more bandwidth ends no iteration more than
    SHARING_SLACK later (see above for why sharing needs the slack)."""
    model, sched, hw, trace, pcie, mem, dma = c
    base = simulate(sched, model, hw, trace, on_capacity="record").timeline.iteration_ends_s()
    if what == "compute":
        fast = simulate(sched, model, hw, faster_trace(trace, k), on_capacity="record")
    else:
        faster = tuple(x * k if i == which % len(pcie) and what == "pcie" else x for i, x in enumerate(pcie))
        hw2 = tiny_hardware(pcie_gbps=faster, mem_gbps=mem * k if what == "mem" else mem,
                            dma_gbps=dma * k if what == "dma" else dma)
        fast = simulate(sched, model, hw2, trace, on_capacity="record")
    ends = fast.timeline.iteration_ends_s()
    assert all(f <= b * (1 + SHARING_SLACK) for f, b in zip(ends, base)), (base, ends)


def test_the_optimizer_and_the_copies_share_the_hosts_dram() -> None:
    """With the host's DRAM bandwidth given (`Host.mem_gbps`), an OPT_STEP is a flow of its bytes (compact fp32:
    26 B a parameter) capped at its own rate, and a LOAD's pass through host memory crosses the same DRAM: alone
    the step takes its time (2M params at 1e9/s x 1.69 = 3380 us); beside a 40 MB LOAD on a 30 GB/s DRAM both
    get 15 GB/s until the LOAD ends (at 5 us + 40 MB / 15 GB/s), then the step finishes at its own rate; without
    `mem_gbps` neither slows the other."""
    b = Builder()
    b("OPT_STEP", "host.optim", layer=1)
    b("LOAD", "g0.h2d", layer=1, nbytes=40_000_000)
    s = b.schedule(host_memory="compact")
    base = tiny_hardware()
    alone = Builder()
    alone("OPT_STEP", "host.optim", layer=1)
    wide = replace(base, host=replace(base.host, mem_gbps=1e6))
    assert log(sim(alone.schedule(host_memory="compact"), wide)) == ["0.000 3380.000 host.optim OPT1"]
    assert log(sim(s, base)) == ["0.000 3380.000 host.optim OPT1", "0.000 1605.000 g0.h2d LD1"]
    shared = sim(s, replace(base, host=replace(base.host, mem_gbps=30.0)))
    load_end = 5.0 + 40e6 / 15e9 * 1e6
    step_bytes, own = 2e6 * 26, 2e6 * 26 / 3380e-6
    left = step_bytes - own * 5e-6 - 40e6  # its own rate while the LOAD waits its 5 us, then 15 GB/s beside it
    assert log(shared)[1] == f"0.000 {load_end:.3f} g0.h2d LD1"
    end = float(log(shared)[0].split()[1])
    assert end == pytest.approx((load_end * 1e-6 + left / own) * 1e6, rel=1e-6) and end > 3380.0
    assert shared.link_bytes["host.mem"] == pytest.approx(40e6 + step_bytes)
