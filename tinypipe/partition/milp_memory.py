"""The Mobius MILP's GPU-memory rows: each moment of the GPU-memory formula (`tinypipe.estimate.gpumem`) as a
linear expression in the MILP's c[l,s] (layer l lies in a pack <= s), in GiB, at most the GPU's capacity
less the reserve (`tinypipe.partition.mobius.mobius_milp`)."""

from __future__ import annotations

import math

import numpy as np

from tinypipe.common.units import GIB
from tinypipe.estimate import gpumem
from tinypipe.estimate.cost import policy_pinned
from tinypipe.estimate.plan import Plan
from tinypipe.policy.modes import ResidentMode


def memory_rows(w: Plan, mapping: tuple[int, ...]) -> list[tuple[dict[int, float], float, float]]:
    """One row per moment of the GPU-memory formula: its terms as linear expressions in c[l,s] (GiB)
    <= the GPU's capacity less the reserve. FIRST of pack s >= 1 reads v_l (c[l-1,s-1] - c[l,s-1]),
    1 only where pack s starts; LAST of pack s < last, v_l (c[l,s] - c[l+1,s])."""
    coefs, caps = memory_matrix(w, mapping)
    return [({int(i): float(row[i]) for i in np.flatnonzero(row)}, -math.inf, cap) for row, cap in zip(coefs, caps)]


def memory_matrix(w: Plan, mapping: tuple[int, ...]) -> tuple[np.ndarray, list[float]]:
    """`memory_rows` as a dense matrix (a row per moment, a column per c[l,s]) and each row's upper bound.

    Each coefficient is summed term by term in the moments' order, as a dictionary of the row's terms would
    sum it (a term that lacks a variable adds 0.0, which changes no sum), so the MILP gets the same numbers
    to the last bit; a term is made once (`moments` repeat a pack's shared terms), a GPU's UPTO sums grow
    pack by pack, and the shared terms' sum is made once per pack."""
    n, s_n, g_n = w.num_layers, len(mapping), w.num_gpus
    nc = n * (s_n - 1)
    pinned = policy_pinned(w)
    kept_last = (True,) * g_n if w.resident == ResidentMode.AUTO else ()
    vec = {k: [b / GIB for b in v] for k, v in gpumem.vectors(w, pinned=pinned).items()}
    arrays = {k: np.array(v) for k, v in vec.items()}
    packs = gpumem.gpu_packs(mapping, g_n)
    first_var = np.arange(n) * (s_n - 1)  # c[l,0] of each layer
    sums: dict[tuple[str, int], tuple[np.ndarray, float]] = {}
    uptos: dict[tuple[str, int, int], tuple[np.ndarray, float]] = {}
    terms: dict[gpumem.Term, tuple[np.ndarray, float]] = {}

    def pack_sum(name: str, s: int) -> tuple[np.ndarray, float]:  # linear_pack_sum of vector `name`, dense
        hit = sums.get((name, s))
        if hit is None:
            c, k = np.zeros(nc), 0.0
            if s <= s_n - 2:
                c[first_var + s] = arrays[name]
            else:
                for x in vec[name]:
                    if x != 0.0:
                        k += x
            if s >= 1:
                c[first_var + s - 1] = -arrays[name]
            hit = sums[name, s] = (c, k)
        return hit

    def upto(name: str, g: int, i: int) -> tuple[np.ndarray, float]:  # the sum over GPU g's packs 0..i
        hit = uptos.get((name, g, i))
        if hit is None:
            c, k = pack_sum(name, packs[g][i])
            before, k0 = upto(name, g, i - 1) if i else (np.zeros(nc), 0.0)
            hit = uptos[name, g, i] = (before + c, k0 + 1.0 * k)
        return hit

    def term(t: gpumem.Term) -> tuple[np.ndarray, float]:
        hit = terms.get(t)
        if hit is not None:
            return hit
        v = vec[t.vector]
        if t.how == gpumem.SUM:
            c, k = pack_sum(t.vector, t.pack)
        elif t.how == gpumem.UPTO:
            c, k = upto(t.vector, t.gpu, t.pack)
        elif t.how == gpumem.FIRST and t.pack == 0:
            c, k = np.zeros(nc), v[0]
        elif t.how == gpumem.LAST and t.pack == s_n - 1:
            c, k = np.zeros(nc), v[n - 1]
        else:  # between layer and layer + 1: +x at c[layer,s], then -x at c[layer+1,s]
            s = t.pack - 1 if t.how == gpumem.FIRST else t.pack
            x = arrays[t.vector][1:] if t.how == gpumem.FIRST else arrays[t.vector][:-1]
            per = np.zeros(n)
            per[1:] -= x
            per[:-1] += x
            c, k = np.zeros(nc), 0.0
            c[first_var + s] = per
        hit = terms[t] = (t.factor * c, t.factor * k)
        return hit

    def total(ts: tuple[gpumem.Term, ...], start: tuple[np.ndarray, float]) -> tuple[np.ndarray, float]:
        c, k = start
        for t in ts:
            tc, tk = term(t)
            c, k = c + tc, k + 1.0 * tk
        return c, k

    shared: dict[tuple[gpumem.Term, ...], tuple[np.ndarray, float]] = {}
    rows, caps = [], []
    for mo in gpumem.moments(mapping, g_n, w.microbatches, w.activation_home, kept_last):
        base = shared.get(mo.shared)
        if base is None:
            base = shared[mo.shared] = total(mo.shared, (np.zeros(nc), 0.0))
        coef, const = total(mo.terms + gpumem.window_terms(mo, mapping, g_n, w.prefetch_depth, w.swap, kept_last),
                            base)
        rows.append(coef)
        caps.append((w.gpu_memory_bytes[mo.gpu] - w.cost.gpu_reserve_bytes) / GIB - const)
    return (np.array(rows) if rows else np.zeros((0, nc))), caps
