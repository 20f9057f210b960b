"""The Mobius partition (Feng et al., "Mobius: Fine Tuning Large-Scale Models on Commodity GPU
Servers", ASPLOS'23, §4): a MILP that minimises the pipeline's iteration time under the GPU-memory
bound that a pack plus the next one being prefetched must fit. One MILP per candidate pack count.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate
from typing import TYPE_CHECKING

from tinypipe.common.units import GIB
from tinypipe.estimate.cost import gpu_peak_bytes
from tinypipe.estimate.plan import Plan

from .mapping import round_robin
from .packing import Mapper, Partitioner, balanced, uniform

if TYPE_CHECKING:
    import numpy as np

# HiGHS stops each MILP after its root node (presolve, the root LP, its heuristics and cuts): the partition is
# the same on any machine under any load (a time limit would make it depend on both). On Llama-3.1-70B x 8
# RTX 4090 the root node's objectives (32, 40, 48 packs: 10.416, 10.144, 9.084 s) are within 0.9% of what
# 10 s of branching reaches (10.337, 10.085, 9.006), at 1.1-1.7 s each; a 0.67 s limit each reaches
# 10.416, 13.574, 9.362.
MOBIUS_NODE_LIMIT = 1
# The first MILP of each pack count lets each boundary move one layer from the balanced-by-time partition: the
# root node's objective there equals or beats the default window's on Llama-3.1-70B x 8 RTX 4090 (10.416,
# 10.144, 9.006 against 10.416, 10.144, 9.084) and on Llama-3.1-8B and Qwen2-7B x 4 RTX 3090 (the same), in
# 0.3-2 s where the default window takes 0.9-4.9 s.
MOBIUS_WINDOW = 1
MOBIUS_TIME_LIMIT_S = 30.0  # per MILP, a safety net only (a limit reached makes the result machine-dependent)
MOBIUS_MIP_GAP = 0.02  # stop a MILP within 2% of optimal: the model is no more exact than that


def mobius_counts(w: Plan, mapper: Mapper | None = None) -> list[int]:
    """Pack counts Mobius tries: the three smallest multiples of the GPU count at which packs balanced by
    time fit every GPU by the GPU-memory formula (`cost.gpu_peak_bytes`); the largest multiple when none
    does. `mapper`: the GPU of each pack (round-robin when None)."""
    g, n = w.num_gpus, w.num_layers
    if n <= g:
        return [n]
    caps = w.usable_gpu_bytes
    part = Partitioner(w.layer_time_s)
    k0 = n - n % g
    for k in range(g, n + 1, g):
        sizes = part(k)
        peaks = gpu_peak_bytes(w, sizes, mapper(k) if mapper else round_robin(k, g))
        if all(p <= c for p, c in zip(peaks, caps)):
            k0 = k
            break
    return [k for k in range(k0, k0 + 3 * g, g) if k <= n]


def mobius(w: Plan, mapper: Mapper, *, counts: Sequence[int] | None = None,
           time_limit_s: float | None = None) -> tuple[int, ...]:
    """The Mobius partition: a MILP per candidate pack count, best objective wins (cached).

    Fallback (stated): when no MILP finds a feasible partition within the time limit (or none
    exists because nothing fits), the balanced-by-time partition into the smallest candidate
    count is returned. The MILP's objective is coarser than the simulator (no wrap-around
    bubbles, no host DMA cap, HiGHS stops at a 2% gap), so its pick can be slower there than the
    uniform partitions with the same pack count (`same_count_uniform`); `tinypipe.sim.guard`
    simulates those beside it and keeps the fastest.
    """
    if time_limit_s is None:
        time_limit_s = MOBIUS_TIME_LIMIT_S
    ns = [n for n in (counts or mobius_counts(w, mapper)) if 1 <= n <= w.num_layers]
    maps = tuple(mapper(n) for n in ns)
    key = (w, maps, time_limit_s)
    hit = _MOBIUS_CACHE.get(key)
    if hit is None:
        hit = _MOBIUS_CACHE[key] = _mobius(w, ns, maps, time_limit_s)
        if len(_MOBIUS_CACHE) > 64:
            _MOBIUS_CACHE.pop(next(iter(_MOBIUS_CACHE)))
    return hit


def same_count_uniform(n: int, k: int) -> list[tuple[int, ...]]:
    """The uniform partitions of `n` layers into exactly `k` packs: `uniform(n, size)` for every size that
    gives k packs, and the even split (sizes differing by one) with its larger packs first and last."""
    q, r = divmod(n, k)
    out = [uniform(n, size) for size in range(1, n + 1) if len(uniform(n, size)) == k]
    if q:
        out += [(q + 1,) * r + (q,) * (k - r), (q,) * (k - r) + (q + 1,) * r]
    return list(dict.fromkeys(out))


_MOBIUS_CACHE: dict[tuple[Plan, tuple[tuple[int, ...], ...], float], tuple[int, ...]] = {}


def _mobius(w: Plan, ns: list[int], maps: tuple[tuple[int, ...], ...], time_limit_s: float) -> tuple[int, ...]:
    best: tuple[float, tuple[int, ...]] | None = None
    for k, n in enumerate(ns):
        # boundaries within one layer of the balanced partition's first (MOBIUS_WINDOW), the default window
        # where nothing there is feasible
        got = (mobius_milp(w, n, maps[k], time_limit_s=time_limit_s, window=MOBIUS_WINDOW)
               or mobius_milp(w, n, maps[k], time_limit_s=time_limit_s))
        if got is not None and (best is None or got[0] < best[0]):
            best = got
    if best is None:
        return balanced(w.layer_time_s, ns[0] if ns else 1)
    return best[1]


@contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null for the duration (our `--json` output must stay clean)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


Linear = tuple[dict[int, float], float]  # coefficients by variable index, constant


def linear_pack_sum(n: int, s_n: int, s: int, v: Sequence[float], scale: float = 1.0) -> Linear:
    """scale x the sum of v over pack s's layers: v_l (c[l,s] - c[l,s-1]), c[l,last] = 1, c[l,-1] = 0."""
    coef: dict[int, float] = {}
    const = 0.0
    for layer in range(n):
        x = v[layer] * scale
        if x == 0.0:
            continue
        if s <= s_n - 2:
            coef[layer * (s_n - 1) + s] = coef.get(layer * (s_n - 1) + s, 0.0) + x
        else:
            const += x
        if s >= 1:
            coef[layer * (s_n - 1) + s - 1] = coef.get(layer * (s_n - 1) + s - 1, 0.0) - x
    return coef, const


def _add(*terms: tuple[dict[int, float], float, float]) -> Linear:
    """The sum of (coefficients, constant, factor) terms."""
    coef: dict[int, float] = {}
    const = 0.0
    for c, k, f in terms:
        for i, x in c.items():
            coef[i] = coef.get(i, 0.0) + f * x
        const += f * k
    return coef, const


def mobius_milp(w: Plan, num_packs: int, mapping: tuple[int, ...], *, time_limit_s: float,
                window: int | None = None) -> tuple[float, tuple[int, ...]] | None:
    """Solve the Mobius MILP for a fixed pack count; (objective seconds, sizes) or None.

    Variables: c[l,s] = 1 iff layer l lies in a pack <= s (monotone in l and s, so packs are
    contiguous and ordered), stage times t[s], makespan T, pipeline step B. Stage time covers the
    pack's compute plus overhead and the upload of the next pack on the same GPU (prefetch). T
    covers each GPU's stages plus its first, unhidden upload; B is at least every pack's compute
    per microbatch. Memory: every moment of the GPU-memory formula (`tinypipe.estimate.gpumem.moments`, its
    window linearised by `gpumem.window_terms`) <= the GPU's capacity less the reserve; pack
    swapping with one pack prefetched reads as Mobius's own bound, a pack plus the next one being
    prefetched (and the pack's gradients, the activations its GPU keeps, the transients).
    Objective: min T + (GPUs - 1) B, the GPipe-style makespan. Bytes are in GiB for the solver.

    `window`: each boundary may move at most this many layers from the balanced-by-time
    partition's (None: max(2, ceil(layers / packs))). This keeps HiGHS fast on 80-layer models
    (the full problem finds no feasible point in seconds there); it is exact whenever the best
    partition lies within the window.
    """
    import numpy as np  # numpy and scipy: ~1 s to import, only when a MILP is solved
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    from .milp_memory import memory_matrix

    n, m, s_n = w.num_layers, w.microbatches, num_packs
    if s_n == 1:
        return (0.0, (n,))
    nc = n * (s_n - 1)
    tT, tB = nc + s_n, nc + s_n + 1
    nvar = nc + s_n + 2
    comp = [m * (f + b) for f, b in zip(w.fwd_s, w.bwd_s)]
    rows = _order_rows(n, s_n) + _time_rows(w, s_n, mapping, comp)
    data, ri, ci, lb, ub = [], [], [], [], []
    for r, (coef, lo, hi) in enumerate(rows):
        for i, x in coef.items():
            if x:
                ri.append(r)
                ci.append(i)
                data.append(x)
        lb.append(lo)
        ub.append(hi)
    mem, caps = memory_matrix(w, mapping)  # the memory rows (`milp_memory.memory_rows`), nonzeros at once
    mr, mc = np.nonzero(mem)
    a_mat = coo_matrix((np.concatenate([np.array(data, dtype=float), mem[mr, mc]]),
                        (np.concatenate([np.array(ri, dtype=np.int64), mr + len(rows)]),
                         np.concatenate([np.array(ci, dtype=np.int64), mc]))),
                       shape=(len(rows) + len(caps), nvar)).tocsr()
    lb += [-math.inf] * len(caps)
    ub += caps
    obj = np.zeros(nvar)
    obj[tT] = 1.0
    obj[tB] = min(len(set(mapping)), s_n) - 1  # pipeline fill: (GPUs - 1) steps of the slowest pack
    integrality = np.zeros(nvar)
    integrality[:nc] = 1
    lo_b, hi_b = _bounds(n, s_n, nvar, comp, window)
    with _quiet_stdout():  # HiGHS prints some debug lines straight to fd 1, even with disp off
        res = milp(obj, constraints=LinearConstraint(a_mat, np.array(lb), np.array(ub)),
                   integrality=integrality, bounds=Bounds(lo_b, hi_b),
                   options={"time_limit": max(0.05, time_limit_s), "disp": False, "mip_rel_gap": MOBIUS_MIP_GAP,
                            "node_limit": MOBIUS_NODE_LIMIT})
    if res.x is None:
        return None
    x = res.x
    cum = [int(round(sum(x[layer * (s_n - 1) + s] for layer in range(n)))) for s in range(s_n - 1)]
    bounds = [0, *cum, n]
    sizes = tuple(bounds[k + 1] - bounds[k] for k in range(s_n))
    if any(k < 1 for k in sizes):
        return None
    return (float(res.fun), sizes)


Row = tuple[dict[int, float], float, float]  # coefficients by variable index, lower bound, upper bound


def _order_rows(n: int, s_n: int) -> list[Row]:
    """c[l,s] <= c[l,s+1] and c[l+1,s] <= c[l,s]: packs contiguous and ordered; and every pack non-empty."""
    rows: list[Row] = []
    for layer in range(n):
        for s in range(s_n - 2):  # c[l,s] <= c[l,s+1]
            rows.append(({layer * (s_n - 1) + s: 1.0, layer * (s_n - 1) + s + 1: -1.0}, -math.inf, 0.0))
        if layer + 1 < n:
            for s in range(s_n - 1):  # c[l+1,s] <= c[l,s]
                rows.append(({(layer + 1) * (s_n - 1) + s: 1.0, layer * (s_n - 1) + s: -1.0}, -math.inf, 0.0))
    ones = [1.0] * n
    for s in range(s_n):
        coef, const = linear_pack_sum(n, s_n, s, ones)
        rows.append((coef, 1.0 - const, math.inf))  # non-empty
    return rows


def _time_rows(w: Plan, s_n: int, mapping: tuple[int, ...], comp: Sequence[float]) -> list[Row]:
    """Stage times t[s] (the pack's compute plus overhead, and the upload of the next pack on its GPU), the
    pipeline step B (every pack's compute per microbatch) and the makespan T (each GPU's stages plus its first,
    unhidden upload), as `mobius_milp` says."""
    n, m = w.num_layers, w.microbatches
    nc = n * (s_n - 1)
    t0, tT, tB = nc, nc + s_n, nc + s_n + 1
    wts = [b / GIB for b in w.weight_bytes]
    rows: list[Row] = []

    def pack_sum(s: int, v: Sequence[float], scale: float = 1.0) -> Linear:
        return linear_pack_sum(n, s_n, s, v, scale)

    by_gpu: dict[int, list[int]] = {}
    for s, g in enumerate(mapping):
        by_gpu.setdefault(g, []).append(s)
    for g, packs in by_gpu.items():
        rate = w.h2d_gbps[g] * 1e9 * w.cost.h2d_efficiency / GIB  # GiB/s
        for i, s in enumerate(packs):
            cc, ck = pack_sum(s, comp)
            rows.append((_add(({t0 + s: 1.0}, 0.0, 1.0), (cc, ck, -1.0))[0], w.cost.pack_overhead_s + ck, math.inf))
            rows.append((_add(({tB: 1.0}, 0.0, 1.0), (cc, ck, -1.0 / m))[0], ck / m, math.inf))
            if i + 1 < len(packs):
                nx, nk = pack_sum(packs[i + 1], wts)
                rows.append((_add(({t0 + s: 1.0}, 0.0, 1.0), (nx, nk, -1.0 / rate))[0], nk / rate, math.inf))
        fx, fk = pack_sum(packs[0], wts)
        span: dict[int, float] = {tT: 1.0}
        for s in packs:
            span[t0 + s] = -1.0
        coef, const = _add((span, 0.0, 1.0), (fx, fk, -1.0 / rate))
        rows.append((coef, -const, math.inf))
    return rows


def _bounds(n: int, s_n: int, nvar: int, comp: Sequence[float], window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The variables' bounds: c[l,s] in [0, 1], fixed outside `window` layers of the balanced partition's
    boundaries (`mobius_milp`); the times unbounded above."""
    import numpy as np

    lo_b = np.zeros(nvar)
    hi_b = np.full(nvar, np.inf)
    hi_b[: n * (s_n - 1)] = 1.0
    delta = window if window is not None else max(2, math.ceil(n / s_n))
    seed = [0, *accumulate(balanced(comp, s_n))]
    for s in range(s_n - 1):
        for layer in range(n):
            if layer < seed[s + 1] - delta:
                lo_b[layer * (s_n - 1) + s] = 1.0
            elif layer >= seed[s + 1] + delta:
                hi_b[layer * (s_n - 1) + s] = 0.0
    return lo_b, hi_b
