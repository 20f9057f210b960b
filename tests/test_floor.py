"""tinypipe.estimate.floor: a schedule's busiest-resource work per iteration, from its own inputs only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.looptimes import LoopTimes
from tinypipe.describe.optimprofile import OptimizerProfile
from tinypipe.describe.trace import trace_for
from tinypipe.estimate.floor import schedule_floor
from tinypipe.estimate.hostmem import optimizer_s_per_param, optimizer_step_s, optimizer_time_factor
from tinypipe.ir.schedule import Kind
from tinypipe.policy import PRESETS


@pytest.mark.parametrize(("hw_name", "recompute"), [("h200x1", True), ("h200x2", False)])
def test_floor_terms_are_the_work_of_one_iteration(hw_name: str, recompute: bool) -> None:
    """Compute: every microbatch through every layer at the trace's times (forward, then the
    backward the policy runs: with recompute, every layer but the head), on the busiest GPU; the host
    optimizer: the parameters of the busiest rank's layers at the layout's rate (each rank has its own
    optimizer thread); uploads: the LOAD and FETCH bytes of the busiest GPU over its PCIe rate. The
    floor is the largest."""
    spec, hw = load_model("llama-3.1-8b"), load_hardware(hw_name)
    policy = PRESETS["tinypipe"].replace(microbatches=8, microbatch_size=4, recompute=recompute)
    trace = trace_for(spec, hw.gpus[0], 4, 2048, "bf16")
    sched = compile_schedule(policy, spec, hw, trace, iterations=3)
    f = schedule_floor(sched, spec, hw, trace)
    per_layer = [trace.layer(x) for x in spec.layers]
    last = len(per_layer) - 1  # the head keeps its graph even under recompute (schedule.recomputes)
    total = 8 * sum(p.fwd_s + (p.recompute_bwd_s if recompute and i != last else p.bwd_s)
                    for i, p in enumerate(per_layer))
    gpus = len(hw.gpus)
    assert total / gpus <= f.compute_s * (1 + 1e-9) and f.compute_s <= total * (1 + 1e-9)
    if gpus == 1:
        assert f.compute_s == pytest.approx(total)
    per_param = optimizer_s_per_param(hw.host, policy.host_memory)  # the measured layout rate, else the factor
    if hw.host.compact_params_per_s is None:
        assert per_param == pytest.approx(optimizer_time_factor(policy.host_memory) / hw.host.adam_params_per_s)
    per_rank = [sum(spec.layers[x].params for p, g in enumerate(sched.pack_gpu) if g == rank
                    for x in sched.pack_layers[p]) for rank in range(gpus)]
    assert sum(per_rank) == spec.params and (gpus == 1 or max(per_rank) < spec.params)
    assert f.optimizer_s == pytest.approx(max(per_rank) * per_param)
    up = [sum(a.nbytes for a in sched.actions if a.kind in (Kind.LOAD, Kind.FETCH_ACT) and a.resource == f"g{g}.h2d")
          for g in range(gpus)]
    assert f.h2d_s == pytest.approx(max(up) / 3 / 55e9)
    assert f.iteration_s == max(f.compute_s, f.h2d_s, f.d2h_s, f.host_dma_s, f.optimizer_s)
    assert f.bound_by == "compute"


def test_floor_takes_the_traces_measured_optimizer_steps() -> None:
    """With a trace that carries each kind's measured step (`tinypipe profile`), the optimizer term is those
    steps, once per layer (the embedding 0.3 s, 32 blocks at 0.14 s, the head 0.31 s: 5.09 s), not the
    host's rate; the compute term is untouched."""
    spec, hw = load_model("llama-3.1-8b"), load_hardware("h200x1")
    trace = trace_for(spec, hw.gpus[0], 4, 2048, "bf16")
    policy = PRESETS["tinypipe"].replace(microbatches=8, microbatch_size=4)
    step_s = {"embed": 0.3, "block": 0.14, "head": 0.31}
    params = {x.kind.value: x.params for x in spec.layers}
    kinds = {k: replace(p, optimizer=OptimizerProfile(params=params[k], threads=15, in_run_s={"compact": step_s[k]}))
             for k, p in trace.kinds.items()}
    measured = replace(trace, kinds=kinds)
    sched = compile_schedule(policy, spec, hw, trace, iterations=3)
    f, before = schedule_floor(sched, spec, hw, measured), schedule_floor(sched, spec, hw, trace)
    assert f.optimizer_s == pytest.approx(0.3 + 32 * 0.14 + 0.31) and before.optimizer_s != pytest.approx(f.optimizer_s)
    assert f.compute_s == before.compute_s


def test_floor_takes_the_lesser_loop_time_of_a_recomputed_block() -> None:
    """A recomputed block with loop times counts the lesser of alone and beside the optimizer (the floor
    stays below any simulated run, which charges one of the two): on one GPU, 8 microbatches x (32 blocks x
    (1.4 + 9 ms) + the embedding's and the head's isolated times)."""
    spec, hw = load_model("llama-3.1-8b"), load_hardware("h200x1")
    trace = trace_for(spec, hw.gpus[0], 4, 2048, "bf16")
    loop = LoopTimes(fwd_s=1.5e-3, recompute_bwd_s=9e-3, fwd_beside_optimizer_s=1.4e-3,
                     recompute_bwd_beside_optimizer_s=10e-3)
    looped = replace(trace, kinds={**trace.kinds, "block": replace(trace.kinds["block"], loop=loop)})
    sched = compile_schedule(PRESETS["tinypipe"].replace(microbatches=8, microbatch_size=4), spec, hw, looped)
    e, h = trace.kinds["embed"], trace.kinds["head"]
    want = 8 * (32 * (1.4e-3 + 9e-3) + e.fwd_s + e.recompute_bwd_s + h.fwd_s + h.bwd_s)
    assert schedule_floor(sched, spec, hw, looped).compute_s == pytest.approx(want)


def test_floor_takes_the_least_of_a_steps_phases() -> None:
    """A block whose step was also measured by phase (alone 0.1 s, beside FWDs 0.3, beside BWDs 0.2; in a
    mixed loop 0.14) counts its least time, 0.1 s, as the simulator may charge that: the floor stays a
    floor. The steps that were not measured by phase keep their in-run times."""
    spec, hw = load_model("llama-3.1-8b"), load_hardware("h200x1")
    trace = trace_for(spec, hw.gpus[0], 4, 2048, "bf16")
    params = {x.kind.value: x.params for x in spec.layers}
    opt = OptimizerProfile(params=params["block"], threads=15, alone_s={"compact": 0.1}, in_run_s={"compact": 0.14},
                           beside_fwd_s={"compact": 0.3}, beside_bwd_s={"compact": 0.2})
    kinds = {**trace.kinds, "block": replace(trace.kinds["block"], optimizer=opt),
             "embed": replace(trace.kinds["embed"], optimizer=OptimizerProfile(
                 params=params["embed"], threads=15, in_run_s={"compact": 0.3}))}
    measured = replace(trace, kinds=kinds)
    sched = compile_schedule(PRESETS["tinypipe"].replace(microbatches=8, microbatch_size=4), spec, hw, trace)
    head = optimizer_step_s(spec.layers[-1], "compact", hw.host, trace)  # not measured: the host's rate
    assert schedule_floor(sched, spec, hw, measured).optimizer_s == pytest.approx(0.3 + 32 * 0.1 + head)
