"""The Mobius baseline's partition is at least as fast in the simulator as every uniform one with its pack count."""

from __future__ import annotations

import pytest

from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.partition.mobius import same_count_uniform
from tinypipe.policy import load_policy
from tinypipe.sim import simulate
from tinypipe.sim.guard import simulate_policy


def test_same_count_uniform_partitions() -> None:
    """k-layer packs that give exactly k packs, and the even split with its larger packs first and last."""
    assert same_count_uniform(34, 12) == [(3,) * 11 + (1,), (3,) * 10 + (2, 2), (2, 2) + (3,) * 10]
    assert same_count_uniform(6, 3) == [(2, 2, 2)]
    assert all(len(s) == 24 and sum(s) == 34 for s in same_count_uniform(34, 24))


@pytest.mark.parametrize(("model", "hardware", "microbatches", "milp_kept"), [
    ("llama-3.1-8b", "rtx3090x4-pcie3", 8, False),  # the MILP alone: 9.98 s, uniform (3 x 11, 1): 7.84 s
    ("qwen2-7b", "rtx3090x4-pcie3", 16, True),  # the MILP beats every uniform partition (13.56 s vs 14.28 s)
])
def test_mobius_is_at_least_as_fast_as_uniform(model: str, hardware: str, microbatches: int, milp_kept: bool) -> None:
    """The simulated iteration of the `mobius` preset is no slower than any fitting uniform partition with the
    same pack count, and the MILP's own partition is kept where it is the fastest."""
    spec, hw = load_model(model), load_hardware(hardware)
    policy = load_policy("mobius").replace(microbatches=microbatches)
    trace = trace_for(spec, hw.gpus[0], policy.microbatch_size, 2048, "bf16")
    sched, res = simulate_policy(policy, spec, hw, trace, iterations=3)
    assert res.fits
    sizes = tuple(len(p) for p in sched.pack_layers)
    times = []
    for u in same_count_uniform(len(spec.layers), len(sizes)):
        r = simulate(compile_schedule(policy.replace(packing=u), spec, hw, trace, iterations=3), spec, hw, trace,
                     on_capacity="record")
        if r.fits:
            times.append(r.iteration_s)
    assert times and res.iteration_s <= min(times)
    assert (sizes not in same_count_uniform(len(spec.layers), len(sizes))) == milp_kept


def test_a_gpu_memory_cap_is_what_the_plan_is_made_for() -> None:
    """Under `--gpu-mem` the packers and `auto` residency plan for the cap, not the whole GPU: Llama-3.1-8B on one
    H200 capped at 24 GiB, one layer a pack, activations kept on the GPU, resident `auto` keeps what fits the
    cap (it kept all 34 layers, 35.7 GiB, when planned for the H200's 139.8 GiB) and the simulation fits."""
    from tinypipe.policy import Policy

    model, hw = load_model("llama-3.1-8b"), load_hardware("h200x1")
    cap = 24 << 30
    p = Policy(name="x", packing="uniform", pack_size=1, mapping="cross", resident="auto", microbatches=8,
               microbatch_size=4, activation_home="gpu")
    trace = trace_for(model, hw.gpus[0], 4, 2048)
    sched, res = simulate_policy(p, model, hw, trace, iterations=2, gpu_mem_bytes=cap)
    assert res.fits and res.peak_bytes["g0"] <= hw.gpus[0].usable_bytes(cap)
    whole = compile_schedule(p, model, hw, trace, iterations=2)
    assert simulate(whole, model, hw, trace).peak_bytes["g0"] > 35 << 30  # planned for the whole GPU
    assert compile_schedule(p, model, hw, trace, iterations=2, gpu_mem_bytes=cap) == sched
