"""Packers: split the layer sequence into packs of consecutive layers; each returns the pack sizes.

- `uniform`: k layers per pack (the last takes the rest).
- `balanced`: the contiguous partition into n packs that minimises the largest pack cost (the
  "linear partition" / min-bottleneck chain partition; Bokhari, "Partitioning problems in
  parallel, pipelined, and distributed computing", IEEE Trans. Computers 37(1), 1988). Solved
  exactly: binary search over the O(L^2) candidate bottlenecks (every contiguous sum) with a
  greedy left-to-right feasibility test.
- `per_gpu`: one balanced pack per GPU.
- `mobius`: the Mobius partition, a MILP (`mobius.py`).
- `holistic`: tinypipe's packer: the number of packs and the boundaries chosen together by the
  full analytic cost model (`tinypipe.estimate.cost.estimate`) of the policy that will run, trading time
  against GPU memory footprint, under the GPU and host memory limits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate

from tinypipe.estimate.cost import Estimate, estimate
from tinypipe.estimate.plan import Plan

Mapper = Callable[[int], tuple[int, ...]]  # number of packs -> the GPU of each pack



def uniform(num_layers: int, pack_size: int) -> tuple[int, ...]:
    """Packs of `pack_size` layers in order; the last pack holds the remainder."""
    if num_layers < 1 or pack_size < 1:
        raise ValueError("uniform packing needs num_layers >= 1 and pack_size >= 1")
    full, rest = divmod(num_layers, pack_size)
    return (pack_size,) * full + ((rest,) if rest else ())


class Partitioner:
    """Exact min-bottleneck contiguous partitions of one cost sequence, for any number of packs."""

    def __init__(self, costs: Sequence[float]) -> None:
        self.n = len(costs)
        self.pre = [0.0, *accumulate(float(max(0.0, c)) for c in costs)]
        self.eps = 1e-12 * max(1.0, self.pre[-1])
        pre = self.pre
        big = max(costs, default=0.0)
        self.cands = sorted({pre[j] - pre[i] for i in range(self.n) for j in range(i + 1, self.n + 1)
                             if pre[j] - pre[i] >= big - self.eps})

    def _greedy(self, bound: float, parts: int) -> list[int]:
        """Left to right, each pack as long as `bound` allows while leaving a layer for every pack
        still to come; at most `parts` packs, or more when `bound` is too small."""
        pre, n, i = self.pre, self.n, 0
        out: list[int] = []
        while i < n:
            last = max(i + 1, n - max(0, parts - len(out) - 1))  # leave a layer per later pack
            j = i + 1
            while j < last and pre[j + 1] - pre[i] <= bound + self.eps:
                j += 1
            out.append(j - i)
            i = j
        return out

    def __call__(self, num_packs: int) -> tuple[int, ...]:
        if not 1 <= num_packs <= self.n:
            raise ValueError(f"cannot split {self.n} layers into {num_packs} non-empty packs")
        lo, hi = 0, len(self.cands) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._greedy(self.cands[mid], num_packs)) <= num_packs:
                hi = mid
            else:
                lo = mid + 1
        return self._spread(self.cands[lo], num_packs)

    def _spread(self, bound: float, parts: int) -> tuple[int, ...]:
        """Exactly `parts` packs, each within `bound`, each cut as close to an even share of the
        remaining cost as the bound and the packs still to come allow (O(layers))."""
        pre, n, eps = self.pre, self.n, self.eps
        need = [0] * (n + 1)  # need[j]: fewest packs within `bound` covering layers j..n-1
        reach = n
        for j in range(n - 1, -1, -1):
            while pre[reach] - pre[j] > bound + eps:
                reach -= 1
            need[j] = 1 + need[max(reach, j + 1)]
        out: list[int] = []
        i = 0
        for left in range(parts, 0, -1):
            if left == 1:
                out.append(n - i)
                break
            target = (pre[n] - pre[i]) / left
            best_j, best_gap = -1, math.inf
            j = i + 1
            while j <= n - (left - 1) and pre[j] - pre[i] <= bound + eps:
                if need[j] <= left - 1:
                    gap = abs(pre[j] - pre[i] - target)
                    if gap < best_gap - eps:
                        best_j, best_gap = j, gap
                j += 1
            out.append(best_j - i)
            i = best_j
        return tuple(out)


def balanced(costs: Sequence[float], num_packs: int) -> tuple[int, ...]:
    """The partition into `num_packs` packs of consecutive layers minimising the largest pack cost."""
    return Partitioner(costs)(num_packs)


def per_gpu(costs: Sequence[float], num_gpus: int) -> tuple[int, ...]:
    """One pack per GPU, balanced by cost (fewer packs when there are fewer layers than GPUs)."""
    return balanced(costs, min(num_gpus, len(costs)))


# ---- scoring shared by the packers that choose a pack count ------------------------------------

def score(e: Estimate, memory_weight: float) -> tuple[float, float, float]:
    """Smaller is better: GPU overflow first, then host overflow (both 0 when they fit), then the
    iteration time inflated by how full the fullest GPU is (`memory_weight` for a full GPU)."""
    gpu = max(0.0, max(p / max(1, c) for p, c in zip(e.gpu_peak_bytes, e.gpu_capacity_bytes)) - 1.0)
    host = max(0.0, e.host_peak_bytes / max(1, e.host_capacity_bytes) - 1.0)
    return (gpu, host, e.iteration_s * (1.0 + memory_weight * min(1.0, e.gpu_fill_fraction)))


def best_of(w: Plan, mapper: Mapper, candidates: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    """The candidate packing the cost model likes best (first on ties)."""
    best: tuple[tuple[float, float, float], tuple[int, ...]] | None = None
    for sizes in candidates:
        key = score(estimate(w, sizes, mapper(len(sizes))), w.cost.memory_weight)
        if best is None or key < best[0]:
            best = (key, sizes)
    if best is None:
        raise ValueError("no packing to choose from")
    return best[1]


def _counts(w: Plan, counts: Sequence[int] | None) -> list[int]:
    return [n for n in (counts or range(1, w.num_layers + 1)) if 1 <= n <= w.num_layers]


# ---- holistic -----------------------------------------------------------------------------------

def holistic(w: Plan, mapper: Mapper, *, counts: Sequence[int] | None = None,
             max_rounds: int = 25) -> tuple[int, ...]:
    """Pack count and boundaries chosen together by the cost model, for memory and throughput.

    Seeds: for every pack count, the balanced partitions by compute time, by weight bytes and by
    compute + upload time. The best seed by `score` (fits GPU and host memory; then iteration
    time with a small penalty for a fuller GPU) is refined by moving single boundaries one layer
    while that improves the score.
    """
    ns = _counts(w, counts)
    rate = min(w.h2d_gbps) * 1e9
    comp = w.layer_time_s
    vectors = (comp, tuple(float(b) for b in w.weight_bytes),
               tuple(c + 2 * b / rate for c, b in zip(comp, w.weight_bytes)))
    cache: dict[tuple[int, ...], tuple[float, float, float]] = {}
    maps: dict[int, tuple[int, ...]] = {}

    def key(sizes: tuple[int, ...]) -> tuple[float, float, float]:
        hit = cache.get(sizes)
        if hit is None:
            mp = maps.get(len(sizes))
            if mp is None:
                mp = maps[len(sizes)] = mapper(len(sizes))
            hit = cache[sizes] = score(estimate(w, sizes, mp), w.cost.memory_weight)
        return hit

    seeds = {p(n) for p in map(Partitioner, vectors) for n in ns}
    best = min(seeds, key=lambda s: (key(s), s))
    for _ in range(max_rounds):
        improved = False
        for b in range(len(best) - 1):
            for delta in (-1, 1):
                cand = list(best)
                cand[b] += delta
                cand[b + 1] -= delta
                if cand[b] < 1 or cand[b + 1] < 1:
                    continue
                t = tuple(cand)
                if key(t) < key(best):
                    best, improved = t, True
        if not improved:
            break
    return best
