"""Mappers: which GPU runs each pack (round-robin, or Mobius's cross mapping over the PCIe tree).

Cross mapping (Mobius, ASPLOS'23, §4.3): neighbouring packs are uploaded at nearly the same
time, so they go to GPUs whose host->GPU paths share the fewest links. We order the GPUs in a
cycle that minimises the sum, over neighbours in the cycle, of the links their host routes share,
and map pack s to the (s mod G)-th GPU of the cycle. Exact (enumeration of the cycles, first
lexicographically on ties) for at most 8 GPUs; beyond, nearest neighbour then 2-opt.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import permutations

from tinypipe.describe.hardware import HOST, Hardware

EXACT_MAX_GPUS = 8


def round_robin(num_packs: int, num_gpus: int) -> tuple[int, ...]:
    """Pack s on GPU s mod G."""
    return tuple(s % num_gpus for s in range(num_packs))


def shared_links(hardware: Hardware) -> tuple[tuple[int, ...], ...]:
    """For each pair of GPUs, how many links their host->GPU routes have in common."""
    edges = [frozenset(frozenset(e) for e in hardware.route(HOST, g.name).edges) for g in hardware.gpus]
    return tuple(tuple(len(a & b) if i != j else 0 for j, b in enumerate(edges)) for i, a in enumerate(edges))


def _cycle_cost(order: tuple[int, ...], share: tuple[tuple[int, ...], ...]) -> int:
    n = len(order)
    if n < 2:
        return 0
    return sum(share[order[i]][order[(i + 1) % n]] for i in range(n))


def best_cycle(share: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """A cyclic order of the GPUs (starting at GPU 0) whose neighbours share the fewest links."""
    n = len(share)
    if n <= 3:
        return tuple(range(n))
    if n <= EXACT_MAX_GPUS:
        best: tuple[int, ...] = tuple(range(n))
        best_cost = _cycle_cost(best, share)
        for rest in permutations(range(1, n)):
            cand = (0, *rest)
            cost = _cycle_cost(cand, share)
            if cost < best_cost:
                best, best_cost = cand, cost
        return best
    order: list[int] = [0]
    left = set(range(1, n))
    while left:
        nxt = min(left, key=lambda g: (share[order[-1]][g], g))
        order.append(nxt)
        left.remove(nxt)
    improved = True
    while improved:  # 2-opt: reverse a segment while that lowers the cycle cost
        improved = False
        for i in range(1, n - 1):
            for j in range(i + 1, n):
                flip = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                if _cycle_cost(tuple(flip), share) < _cycle_cost(tuple(order), share):
                    order, improved = flip, True
    return tuple(order)


@lru_cache(maxsize=64)
def _cached_order(hardware: Hardware) -> tuple[int, ...]:
    return best_cycle(shared_links(hardware))


def cross_order(hardware: Hardware) -> tuple[int, ...]:
    """The GPU cycle of the cross mapping for this hardware (cached when the hardware is hashable)."""
    try:
        return _cached_order(hardware)
    except TypeError:  # an unhashable field: compute without the cache
        return best_cycle(shared_links(hardware))


def cross(num_packs: int, hardware: Hardware) -> tuple[int, ...]:
    """Pack s on the (s mod G)-th GPU of `cross_order`: neighbouring packs share the least PCIe path."""
    order = cross_order(hardware)
    return tuple(order[s % len(order)] for s in range(num_packs))
