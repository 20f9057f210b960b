"""tinypipe.floor: a schedule's busiest-resource work per iteration, from its own inputs only."""

from __future__ import annotations

import pytest

from tinypipe.compiler import compile_schedule
from tinypipe.floor import schedule_floor
from tinypipe.hardware import load_hardware
from tinypipe.hfconfig import load_model
from tinypipe.hostmem import optimizer_time_factor
from tinypipe.policy import PRESETS
from tinypipe.schedule import Kind
from tinypipe.trace import trace_for


@pytest.mark.parametrize(("hw_name", "recompute"), [("h200x1", True), ("h200x2", False)])
def test_floor_terms_are_the_work_of_one_iteration(hw_name: str, recompute: bool) -> None:
    """Compute: every microbatch through every layer at the trace's times (forward, then the
    backward the policy runs: with recompute, every layer but the head), on the busiest GPU; the host
    optimizer: every parameter at the layout's rate; uploads: the LOAD and FETCH bytes of the busiest
    GPU over its PCIe rate. The floor is the largest."""
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
    factor = optimizer_time_factor(policy.host_memory)
    assert f.optimizer_s == pytest.approx(spec.params * factor / hw.host.adam_params_per_s)
    up = [sum(a.nbytes for a in sched.actions if a.kind in (Kind.LOAD, Kind.FETCH_ACT) and a.resource == f"g{g}.h2d")
          for g in range(gpus)]
    assert f.h2d_s == pytest.approx(max(up) / 3 / 55e9)
    assert f.iteration_s == max(f.compute_s, f.h2d_s, f.d2h_s, f.host_dma_s, f.optimizer_s)
    assert f.bound_by == "compute"
