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
    g_n = w.num_gpus
    kept_last = (True,) * g_n if w.resident == ResidentMode.AUTO else ()
    terms = _Terms(w, mapping)
    shared: dict[tuple[gpumem.Term, ...], Dense] = {}
    rows, caps = [], []
    for mo in gpumem.moments(mapping, g_n, w.microbatches, w.activation_home, kept_last):
        base = shared.get(mo.shared)
        if base is None:
            base = shared[mo.shared] = terms.total(mo.shared, (np.zeros(terms.nc), 0.0))
        coef, const = terms.total(mo.terms + gpumem.window_terms(mo, mapping, g_n, w.prefetch_depth, w.swap,
                                                                 kept_last), base)
        rows.append(coef)
        caps.append(w.usable_gpu_bytes[mo.gpu] / GIB - const)
    return (np.array(rows) if rows else np.zeros((0, terms.nc))), caps


Dense = tuple[np.ndarray, float]  # a linear expression: a coefficient per c[l,s], constant (GiB)


class _Terms:
    """The GPU-memory formula's terms (`gpumem.Term`) as dense linear expressions in c[l,s], each made once."""

    def __init__(self, w: Plan, mapping: tuple[int, ...]) -> None:
        self.n, self.s_n = w.num_layers, len(mapping)
        self.nc = self.n * (self.s_n - 1)
        self.vec = {k: [b / GIB for b in v] for k, v in gpumem.vectors(w, pinned=policy_pinned(w)).items()}
        self.arrays = {k: np.array(v) for k, v in self.vec.items()}
        self.packs = gpumem.gpu_packs(mapping, w.num_gpus)
        self.first_var = np.arange(self.n) * (self.s_n - 1)  # c[l,0] of each layer
        self.sums: dict[tuple[str, int], Dense] = {}
        self.uptos: dict[tuple[str, int, int], Dense] = {}
        self.terms: dict[gpumem.Term, Dense] = {}

    def pack_sum(self, name: str, s: int) -> Dense:
        """`mobius.linear_pack_sum` of vector `name` over pack s, dense."""
        hit = self.sums.get((name, s))
        if hit is None:
            c, k = np.zeros(self.nc), 0.0
            if s <= self.s_n - 2:
                c[self.first_var + s] = self.arrays[name]
            else:
                for x in self.vec[name]:
                    if x != 0.0:
                        k += x
            if s >= 1:
                c[self.first_var + s - 1] = -self.arrays[name]
            hit = self.sums[name, s] = (c, k)
        return hit

    def upto(self, name: str, g: int, i: int) -> Dense:
        """The sum of vector `name` over GPU g's packs 0..i."""
        hit = self.uptos.get((name, g, i))
        if hit is None:
            c, k = self.pack_sum(name, self.packs[g][i])
            before, k0 = self.upto(name, g, i - 1) if i else (np.zeros(self.nc), 0.0)
            hit = self.uptos[name, g, i] = (before + c, k0 + 1.0 * k)
        return hit

    def term(self, t: gpumem.Term) -> Dense:
        hit = self.terms.get(t)
        if hit is not None:
            return hit
        n, nc = self.n, self.nc
        v = self.vec[t.vector]
        if t.how == gpumem.SUM:
            c, k = self.pack_sum(t.vector, t.pack)
        elif t.how == gpumem.UPTO:
            c, k = self.upto(t.vector, t.gpu, t.pack)
        elif t.how == gpumem.FIRST and t.pack == 0:
            c, k = np.zeros(nc), v[0]
        elif t.how == gpumem.LAST and t.pack == self.s_n - 1:
            c, k = np.zeros(nc), v[n - 1]
        else:  # between layer and layer + 1: +x at c[layer,s], then -x at c[layer+1,s]
            s = t.pack - 1 if t.how == gpumem.FIRST else t.pack
            x = self.arrays[t.vector][1:] if t.how == gpumem.FIRST else self.arrays[t.vector][:-1]
            per = np.zeros(n)
            per[1:] -= x
            per[:-1] += x
            c, k = np.zeros(nc), 0.0
            c[self.first_var + s] = per
        hit = self.terms[t] = (t.factor * c, t.factor * k)
        return hit

    def total(self, ts: tuple[gpumem.Term, ...], start: Dense) -> Dense:
        """`start` plus the terms `ts`, summed in order."""
        c, k = start
        for t in ts:
            tc, tk = self.term(t)
            c, k = c + tc, k + 1.0 * tk
        return c, k
