"""The fit check (`sim.guard`) bounds a sync schedule's GPU peak over the host optimizer's speed where its
gradients wait on the GPU for host slots (the compact layout's ring), and only there."""

from __future__ import annotations

import pytest

from tinypipe.common.units import GIB
from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.policy import PRESETS, Policy
from tinypipe.sim import simulate
from tinypipe.sim.guard import gradients_wait_for_host, simulate_policy

# the search's pick for Llama-3.1-8B on one H200 at 24 GiB (evidence/h200-2026-12-05/winner.json)
WINNER = Policy(name="searched", packing="uniform", pack_size=3, mapping="cross", swap="layer", prefetch_depth=1,
                resident="none", host_memory="compact", microbatches=8, microbatch_size=4, recompute=True,
                optimizer="sync", activation_home="host")


@pytest.mark.parametrize(("changes", "grad_clip", "waits"), [
    ({}, False, True),
    ({"host_memory": "replicated"}, False, False),  # a GRAD_OUT waits for its layer's step of the step before
    ({"optimizer": "async"}, False, False),  # simulate's own slow-host pass
    ({}, True, False),  # clipping: a slot per layer, no ring
])
def test_gradients_wait_for_host_under_the_compact_ring_only(changes: dict[str, str], grad_clip: bool,
                                                              waits: bool) -> None:
    """tiny-llama, six one-layer packs on one GPU, sync: the compact ring makes a GRAD_OUT wait for a step of its own
    iteration; the replicated layout, the async optimizer and clipping by the global norm do not."""
    model, hw = load_model("tiny-llama"), load_hardware("h200x1")
    trace = trace_for(model, hw.gpus[0], 1, 64)
    p = PRESETS["tinypipe"].replace(packing=(1,) * 6, mapping=(0,) * 6, resident="none", microbatches=2, **changes)
    assert gradients_wait_for_host(compile_schedule(p, model, hw, trace, iterations=2, grad_clip=grad_clip)) == waits


def test_the_8b_winners_gpu_peak_holds_for_a_slow_host() -> None:
    """The pick of evidence/h200-2026-12-05: 8.13 GiB at the planned host rate, 17.74 bounded (its run's ledger
    reached 13.30 GiB); under a 16 GiB cap the violation says it comes from a slow host."""
    model, hw = load_model("llama-3.1-8b"), load_hardware("h200x1")
    trace = trace_for(model, hw.gpus[0], 4, 2048)
    sched, res = simulate_policy(WINNER, model, hw, trace, iterations=3, gpu_mem_bytes=24 * GIB)
    planned = simulate(sched, model, hw, trace, gpu_mem_bytes=24 * GIB).peak_gpu_bytes
    assert (round(planned / GIB, 2), round(res.peak_gpu_bytes / GIB, 2), res.fits) == (8.13, 17.74, True)
    _, capped = simulate_policy(WINNER, model, hw, trace, iterations=3, gpu_mem_bytes=16 * GIB)
    assert not capped.fits and capped.violation is not None and "slower than planned" in capped.violation
