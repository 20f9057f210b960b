"""Packers, mappers and the analytic cost model, each against what it promises."""

from __future__ import annotations

import itertools
from dataclasses import replace
from itertools import accumulate
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tinypipe.common.units import GIB, MIB
from tinypipe.describe.hardware import load_hardware
from tinypipe.estimate.cost import estimate, gpu_peak_bytes
from tinypipe.estimate.plan import Plan
from tinypipe.partition import mobius, packing
from tinypipe.partition.mapping import best_cycle, cross, round_robin, shared_links


def wl(n: int = 12, g: int = 2, m: int = 4, *, mem: int = 8 * GIB, **kw: Any) -> Plan:
    """A hand-made plan (no packs): n equal blocks of 0.5 GiB, 10 GB/s uploads, 10 ms forward per microbatch;
    activations held on the GPU are each layer's 16 MiB input (nothing more is saved)."""
    w = Plan(microbatches=m, fwd_s=(0.01,) * n, bwd_s=(0.03,) * n, weight_bytes=(GIB // 2,) * n,
             input_bytes=(0,) + (16 * MIB,) * (n - 1), saved_bytes=(0,) * n, layer_workspace_bytes=(64 * MIB,) * n,
             host_grad_bytes=(0,) * n, master_bytes=(0,) * n, opt_s=(0.02,) * n, num_gpus=g, h2d_gbps=(10.0,) * g,
             p2p_gbps=20.0, p2p_through_host=False, gpu_memory_bytes=(mem,) * g, host_memory_bytes=256 * GIB,
             host_static_bytes=64 * GIB, host_dynamic_bytes=0, host_dma_gbps=50.0)
    return replace(w, **kw)


def rr(g: int) -> packing.Mapper:
    return lambda n: round_robin(n, g)


def bottleneck(costs: list[float], sizes: tuple[int, ...]) -> float:
    b = [0, *accumulate(sizes)]
    return max(sum(costs[b[i]:b[i + 1]]) for i in range(len(sizes)))


# ---- simple packers --------------------------------------------------------------------------------

def test_uniform_and_per_gpu() -> None:
    """uniform: k per pack, the rest last; per-gpu: one pack per GPU, fewer when layers run out."""
    assert packing.uniform(10, 3) == (3, 3, 3, 1)
    assert packing.uniform(4, 4) == (4,)
    assert packing.per_gpu([1.0] * 10, 4) == (2, 3, 2, 3)
    assert packing.per_gpu([1.0] * 3, 8) == (1, 1, 1)


def test_balanced_table() -> None:
    """balanced minimises the largest pack; a heavy layer gets a pack of its own."""
    assert packing.balanced([1, 1, 1, 1, 4], 2) == (4, 1)
    assert packing.balanced([4, 1, 1, 1, 1], 2) == (1, 4)
    assert packing.balanced([1] * 8, 4) == (2, 2, 2, 2)
    assert packing.balanced([1] * 5, 5) == (1, 1, 1, 1, 1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 7.0]), min_size=1, max_size=9), st.data())
def test_balanced_is_optimal(costs: list[float], data: st.DataObject) -> None:
    """balanced's bottleneck equals the brute-force optimum over all contiguous partitions."""
    k = data.draw(st.integers(1, len(costs)))
    sizes = packing.balanced(costs, k)
    assert len(sizes) == k and sum(sizes) == len(costs) and min(sizes) >= 1
    best = min(bottleneck(costs, tuple(b - a for a, b in zip((0, *cuts), (*cuts, len(costs)))))
               for cuts in itertools.combinations(range(1, len(costs)), k - 1))
    assert abs(bottleneck(costs, sizes) - best) < 1e-9


# ---- mobius ----------------------------------------------------------------------------------------------

def test_mobius_respects_memory_bound() -> None:
    """The Mobius partition fits every GPU by the GPU-memory formula, whose moments are its constraints."""
    w = wl(12, 2, mem=4 * GIB, swap="pack")
    sizes = mobius.mobius(w, rr(2), time_limit_s=5.0)
    assert sum(sizes) == 12 and len(sizes) % 2 == 0
    caps = [m - w.cost.gpu_reserve_bytes for m in w.gpu_memory_bytes]
    assert all(p <= c for p, c in zip(gpu_peak_bytes(w, sizes, round_robin(len(sizes), 2)), caps))


def test_mobius_falls_back_to_balanced() -> None:
    """When nothing fits (or the MILP finds nothing in time) Mobius returns the balanced partition."""
    w = wl(12, 2, mem=GIB + GIB // 4, swap="pack")
    counts = mobius.mobius_counts(w)
    assert mobius.mobius(w, rr(2)) == packing.balanced(w.layer_time_s, counts[0])


def test_mobius_counts_are_gpu_multiples() -> None:
    """Mobius tries multiples of the GPU count, from the smallest whose balanced packs fit by the GPU-memory
    formula under the 1 GiB reserve (4 packs of 3 blocks need 4.4 GiB a GPU, 6 of 2 need 3.5: the last
    layer keeps its graph, so its weights twice from its re-LOAD on); all layers when there are few."""
    assert mobius.mobius_counts(wl(12, 2, mem=6 * GIB)) == [4, 6, 8]
    assert mobius.mobius_counts(wl(12, 2, mem=5 * GIB)) == [6, 8, 10]
    assert mobius.mobius_counts(wl(3, 4)) == [3]


# ---- holistic --------------------------------------------------------------------------------------------

def test_holistic_beats_every_balanced_seed() -> None:
    """Holistic's plan scores no worse than any balanced partition of any pack count."""
    w = wl(12, 2, mem=4 * GIB)
    sizes = packing.holistic(w, rr(2))
    mine = packing.score(estimate(w, sizes, round_robin(len(sizes), 2)), w.cost.memory_weight)
    for n in range(1, 13):
        seed = packing.balanced(w.layer_time_s, n)
        assert mine <= packing.score(estimate(w, seed, round_robin(n, 2)), w.cost.memory_weight)
    assert estimate(w, sizes, round_robin(len(sizes), 2)).fits


def test_holistic_uses_layer_swapping_memory() -> None:
    """Layer swapping needs a pack plus a few layers, not two packs: holistic finds bigger packs fit
    where the pack-swapping (Mobius) memory bound forces smaller ones."""
    layer = wl(12, 2, mem=3 * GIB + GIB // 2)
    pack = replace(layer, swap="pack")
    big = packing.holistic(layer, rr(2))
    assert estimate(layer, big, round_robin(len(big), 2)).fits
    assert not estimate(pack, big, round_robin(len(big), 2)).fits or len(big) <= len(mobius.mobius(pack, rr(2)))


def test_holistic_respects_a_fixed_count() -> None:
    """With an explicit mapping the pack count is fixed; holistic only moves boundaries."""
    assert len(packing.holistic(wl(12, 3), lambda n: (0, 1, 2), counts=[3])) == 3


# ---- mapping ---------------------------------------------------------------------------------------------

def test_round_robin() -> None:
    """Pack s on GPU s mod G."""
    assert round_robin(5, 2) == (0, 1, 0, 1, 0)


def test_cross_mapping_alternates_switches() -> None:
    """On 8 GPUs under two switches, neighbouring packs land under different switches."""
    hw = load_hardware("rtx4090x8-pcie4")
    assert cross(10, hw) == (0, 4, 1, 5, 2, 6, 3, 7, 0, 4)
    share = shared_links(hw)
    assert share[0][1] > share[0][4]


def test_cross_heuristic_beyond_eight() -> None:
    """Past 8 GPUs the heuristic still finds a cycle that never pairs GPUs of one switch."""
    n = 10
    share = tuple(tuple(0 if i == j else (2 if (i < 5) == (j < 5) else 0) for j in range(n)) for i in range(n))
    order = best_cycle(share)
    assert sorted(order) == list(range(n))
    assert all(share[order[i]][order[(i + 1) % n]] == 0 for i in range(n))


# ---- cost model ----------------------------------------------------------------------------------------

def test_cost_memory_by_swap_mode() -> None:
    """Layer swapping holds less than pack swapping with prefetch; host activations less than GPU ones."""
    w = wl(12, 2)
    sizes, mapping = (3, 3, 3, 3), (0, 1, 0, 1)
    layer = gpu_peak_bytes(w, sizes, mapping)
    pack = gpu_peak_bytes(replace(w, swap="pack"), sizes, mapping)
    host = gpu_peak_bytes(replace(w, activation_home="host"), sizes, mapping)
    assert all(a < b for a, b in zip(layer, pack)) and all(a < b for a, b in zip(host, layer))
    everything = gpu_peak_bytes(replace(w, resident="all"), sizes, mapping)
    assert all(e >= 6 * GIB // 2 for e in everything)


def test_cost_iteration_bounds() -> None:
    """The iteration is at least each GPU's busy time and at least the CPU optimizer's time."""
    w = wl(12, 2)
    e = estimate(w, (3, 3, 3, 3), (0, 1, 0, 1))
    assert e.iteration_s >= max(e.busy_s) and e.iteration_s >= e.optimizer_s
    slow_cpu = estimate(replace(w, opt_s=(10.0,) * 12), (3, 3, 3, 3), (0, 1, 0, 1))
    assert slow_cpu.iteration_s >= 120.0


def test_every_packer_and_mapper_name_has_its_rule() -> None:
    """`partition.resolve`'s tables hold a rule for exactly the packer and mapper names a policy accepts, and each
    packer, under each mapper, packs every layer onto the plan's GPUs."""
    from tinypipe.partition.resolve import MAPPER_TABLE, PACKER_TABLE, resolve
    from tinypipe.policy.modes import MAPPERS, PACKERS
    from tinypipe.policy.policy import Policy

    assert sorted(PACKER_TABLE) == sorted(PACKERS) and sorted(MAPPER_TABLE) == sorted(MAPPERS)
    hw = load_hardware("h200x2")
    for packer in PACKERS:
        for mapper in MAPPERS:
            sizes, gpus = resolve(Policy(name="p", packing=packer, mapping=mapper), wl(8), hw)
            assert sum(sizes) == 8 and min(sizes) >= 1 and len(gpus) == len(sizes) and set(gpus) <= {0, 1}
