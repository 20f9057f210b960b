"""GPU memory: the one formula for the bytes a GPU holds at its peak under a packing.

The cost model (so every packer), the Mobius MILP, search's bound and `tinypipe inspect` take GPU
memory from here. The formula predicts the peak of the compiled schedule's ledger on each GPU
(`tinypipe.ir.ledger`, the buffers of docs/schedule-contract.md) at the *moments* where it peaks. A
moment is a sum of terms, each a per-layer byte vector read over one pack (summed over its layers,
or taken at its first or last layer) or summed over a GPU's first packs, plus the weights in the
prefetch window. The MILP, whose unknowns are the pack boundaries, reads the same terms as linear
constraints (`window_terms` linearises the window). With M microbatches, X the bytes a layer keeps
from its forward to its backward (its input when activations live on the GPU, its saved activations
when it does not recompute) and T what a backward holds while it runs (workspace, re-created saved
activations, the input gradient it makes, the output gradient it reads), the moments of pack s on
its GPU are:

- its forward's last op: the window, the held layers, M X of the GPU's packs up to s, the output it
  hands on, and the workspace of its last layer (and graph_w of its earlier packs: the weights the
  graphs of layers that do not recompute still hold; at the backward's moments those of s too);
- its backward's first op (one gradient), its first layer's op of microbatch 0 (every gradient of
  s; microbatch 0's X of s gone but the first layer's), and the start of microbatch 1 (every
  gradient; microbatch 0's X of s gone), and its first layer's op of microbatch 1 (microbatch 1's
  X of s gone too but the first layer's): the window, the held layers, M X up to s, and T (at
  microbatch 1, Ta: a later backward adds its fresh gradients into the accumulator, ws.acc).

The window follows the compiler's swap pass (`window_span`): layer swapping holds the largest use's
window layers plus `prefetch_depth`, pack swapping `prefetch_depth` + 1 uses, counted from the use
at hand and stopping at the first layer it would hold twice (a layer's next LOAD waits for its EVICT
and uploads run in order). Layers held for the whole iteration (`pinned`) and layers kept across
other uses sit outside the window.

Being free of time, the formula cannot know: gradients that wait on the GPU because their copies
out or the host optimizer are slower than the backward; a window that is not full because uploads
are slower than compute; an inner layer of a pack whose backward peaks above the first layer's
(activations as heavy as weights). tests/test_gpumem.py measures it against the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Protocol

from tinypipe.ir.schedule import recomputes
from tinypipe.policy.modes import ActivationHome, SwapMode

SUM, FIRST, LAST, UPTO = "sum", "first", "last", "upto"


class MemoryInputs(Protocol):
    """What the formula reads: a `tinypipe.estimate.plan.Plan` has it."""

    @property
    def weight_bytes(self) -> tuple[int, ...]: ...  # w.L
    @property
    def grad_acc_bytes(self) -> tuple[int, ...]: ...  # gr.L (0 for a frozen base)
    @property
    def gpu_state_bytes(self) -> tuple[int, ...]: ...  # held on the owner GPU all run (LoRA adapters)
    @property
    def input_bytes(self) -> tuple[int, ...]: ...  # x.L.m and dx.L.m
    @property
    def saved_bytes(self) -> tuple[int, ...]: ...  # a.L.m
    @property
    def layer_workspace_bytes(self) -> tuple[int, ...]: ...  # ws of each FWD / first BWD
    @property
    def accumulate_workspace_bytes(self) -> tuple[int, ...]: ...  # ws.acc of each later BWD
    @property
    def microbatches(self) -> int: ...
    @property
    def swap(self) -> SwapMode: ...
    @property
    def prefetch_depth(self) -> int: ...
    @property
    def activation_home(self) -> ActivationHome: ...
    @property
    def recompute(self) -> bool: ...


def window_span(largest_use: int, prefetch_depth: int, swap: SwapMode) -> int:
    """What a GPU's weights window holds at once: layer swapping, window layers (the largest use's plus
    the prefetch depth; the LOAD of window layer k waits for the EVICT of k - span); pack swapping, uses
    (a use's LOADs wait for the EVICTs of the use prefetch_depth + 1 back)."""
    return largest_use + prefetch_depth if not swap.whole_packs else prefetch_depth + 1


@dataclass(frozen=True)
class Term:
    """`factor` x a per-layer byte vector (`vectors`' name) read over packs: SUM over pack `pack`'s layers,
    FIRST / LAST at its first / last layer, or UPTO: summed over the packs of GPU `gpu` up to its
    `pack`-th (0-based, in order)."""

    how: str
    pack: int
    vector: str
    factor: int = 1
    gpu: int = -1


@dataclass(frozen=True)
class Moment:
    """Bytes on GPU `gpu` at one point of its iteration: `shared` + `terms` plus the weights in the window
    counted from the GPU's use `anchor` (an index into `uses(mapping)[gpu]`). `shared`: the terms every
    moment of one pack has (the held layers and the activations kept so far), one tuple for them all."""

    gpu: int
    what: str
    shared: tuple[Term, ...]
    terms: tuple[Term, ...]
    anchor: int


def gpu_packs(mapping: tuple[int, ...], num_gpus: int) -> tuple[tuple[int, ...], ...]:
    """The packs of each GPU, in order."""
    out: list[list[int]] = [[] for _ in range(num_gpus)]
    for s, g in enumerate(mapping):
        out[g].append(s)
    return tuple(tuple(p) for p in out)


def uses(packs: tuple[int, ...]) -> tuple[tuple[int, bool], ...]:
    """One GPU's uses of its packs in stream order, (pack, forward?): forward ascending, backward descending."""
    return tuple((s, True) for s in packs) + tuple((s, False) for s in reversed(packs))


def vectors(m: MemoryInputs, *, kept: frozenset[int] = frozenset(),
            pinned: frozenset[int] = frozenset()) -> dict[str, tuple[int, ...]]:
    """The per-layer byte vectors the terms read (each layer l):

    w: weights; gr: its gradient accumulator (0 for a frozen base); static: what stays on the owner GPU
    for the whole run (a LoRA layer's adapters and their AdamW state); pinned_w: w of pinned layers;
    kept_w: w of kept ones (held from forward to backward; in the window on the GPU's last pack); graph_w: w
    of the other layers that do not recompute (their graph holds the forward's copy until the backward, which
    loads another); win / win_n: window weights / 1 of layers neither pinned nor kept, win_last / win_last_n: not
    pinned (the last pack's forward);
    x: input; a: saved activations kept from forward (no recompute); X: x (activations on the GPU, or
    a layer that keeps its graph, which holds its input) + a; T: a backward's transient, workspace +
    re-created a + dx.L + dx.L+1; Ta: T of a later backward (into the gradient accumulator: its
    workspace is ws.acc); ws: workspace.
    """
    n = len(m.weight_bytes)
    w, x, ws = m.weight_bytes, m.input_bytes, m.layer_workspace_bytes
    redo = [recomputes(m.recompute, layer, n) for layer in range(n)]
    a = tuple(0 if redo[i] else m.saved_bytes[i] for i in range(n))
    on_gpu = not m.activation_home.on_host
    held = [i in pinned or i in kept for i in range(n)]
    rest = [(m.saved_bytes[i] if redo[i] else 0) + x[i] + (x[i + 1] if i + 1 < n else 0) for i in range(n)]
    return {
        "w": w, "ws": ws, "x": x, "a": a, "gr": m.grad_acc_bytes, "static": m.gpu_state_bytes,
        "pinned_w": tuple(w[i] if i in pinned else 0 for i in range(n)),
        "kept_w": tuple(w[i] if i in kept and i not in pinned else 0 for i in range(n)),
        "graph_w": tuple(0 if redo[i] or held[i] else w[i] for i in range(n)),
        "win": tuple(0 if held[i] else w[i] for i in range(n)),
        "win_n": tuple(0 if held[i] else 1 for i in range(n)),
        "win_last": tuple(0 if i in pinned else w[i] for i in range(n)),
        "win_last_n": tuple(0 if i in pinned else 1 for i in range(n)),
        "X": tuple(a[i] + (x[i] if on_gpu or not redo[i] else 0) for i in range(n)),  # a kept graph keeps x
        "T": tuple(ws[i] + rest[i] for i in range(n)),
        "Ta": tuple(m.accumulate_workspace_bytes[i] + rest[i] for i in range(n)),
    }


def _window_vectors(use: int, n_uses: int) -> tuple[str, str]:
    """(bytes, count) vector names of a use's window layers: the GPU's last pack's forward opens the
    segments of its kept layers too (they stay to its backward); every other use, neither pinned nor kept."""
    return ("win_last", "win_last_n") if 2 * use + 2 == n_uses else ("win", "win_n")


@lru_cache(maxsize=256)
def moments(mapping: tuple[int, ...], num_gpus: int, microbatches: int, activation_home: ActivationHome,
            kept_last: tuple[bool, ...] = ()) -> tuple[Moment, ...]:
    """Every moment of every GPU (module docstring). `kept_last`: per GPU, whether its last pack keeps
    layers from forward to backward (then its backward's window starts at its forward's)."""
    out: list[Moment] = []
    big_m = microbatches
    host = activation_home.on_host
    n_packs = len(mapping)
    for g, packs in enumerate(gpu_packs(mapping, num_gpus)):
        k = len(packs)
        for i, s in enumerate(packs):
            held: tuple[Term, ...] = (Term(UPTO, k - 1, "pinned_w", gpu=g), Term(UPTO, k - 1, "static", gpu=g))
            if min(i, k - 2) >= 0:  # kept layers outside the last pack are held from forward to backward
                held += (Term(UPTO, min(i, k - 2), "kept_w", gpu=g),)
            base = held + (Term(UPTO, i, "X", big_m, gpu=g),)
            out_x = ((Term(FIRST, s + 1, "x", big_m if mapping[s + 1] == g else 1),) if s + 1 < n_packs else ())
            fwd_x = (Term(LAST, s, "x"),) if host else ()
            graph_f = (Term(UPTO, i - 1, "graph_w", gpu=g),) if i else ()  # graphs of the GPU's earlier packs
            out.append(Moment(g, f"forward of pack {s}", base, graph_f + fwd_x + out_x + (Term(LAST, s, "ws"),), i))
            turn = i == k - 1 and bool(kept_last) and kept_last[g]  # the last pack kept: not evicted at the turn
            anchor = i if turn else 2 * k - 1 - i
            x_in = ((Term(SUM, s, "x"),) if host else ()) + (graph_f if turn else (Term(UPTO, i, "graph_w", gpu=g),))
            gone = (Term(SUM, s, "X", -1),)
            out.append(Moment(g, f"backward of pack {s}, first op", base, x_in + (
                Term(LAST, s, "gr"), Term(LAST, s, "T")), anchor))
            out.append(Moment(g, f"backward of pack {s}, first layer of microbatch 0", base, x_in + gone + (
                Term(SUM, s, "gr"), Term(FIRST, s, "X"), Term(FIRST, s, "T")), anchor))
            if big_m > 1:
                out.append(Moment(g, f"backward of pack {s}, microbatch 1", base, x_in + gone + (
                    Term(SUM, s, "gr"), Term(LAST, s, "Ta")), anchor))
                out.append(Moment(g, f"backward of pack {s}, first layer of microbatch 1", base, x_in + (
                    Term(SUM, s, "X", -2), Term(SUM, s, "gr"), Term(FIRST, s, "X"), Term(FIRST, s, "Ta")), anchor))
    return tuple(out)


class Evaluator:
    """Bytes of terms and moments for one packing (`sizes`: layers per pack)."""

    def __init__(self, m: MemoryInputs, vec: dict[str, tuple[int, ...]], sizes: tuple[int, ...],
                 mapping: tuple[int, ...], num_gpus: int) -> None:
        self.m, self.vec = m, vec
        self.starts = (0, *accumulate(sizes))
        self.packs = gpu_packs(mapping, num_gpus)
        self._tables: dict[tuple[str, str, int], list[int]] = {}  # (how, vector, gpu) -> value per pack
        self._windows: dict[int, list[int]] = {}  # gpu -> window bytes per anchor use

    def _table(self, how: str, name: str, gpu: int) -> list[int]:
        v, st = self.vec[name], self.starts
        if how == SUM or how == UPTO:
            sums = self._tables.get((SUM, name, -1))
            if sums is None:
                pre = (0, *accumulate(v))
                sums = self._tables[SUM, name, -1] = [pre[b] - pre[a] for a, b in zip(st, st[1:])]
            tab = sums if how == SUM else list(accumulate(sums[s] for s in self.packs[gpu]))
        elif how == FIRST:
            tab = [v[a] for a in st[:-1]]
        else:
            tab = [v[b - 1] for b in st[1:]]
        self._tables[how, name, gpu] = tab
        return tab

    def term(self, t: Term) -> int:
        tab = self._tables.get((t.how, t.vector, t.gpu))
        if tab is None:
            tab = self._table(t.how, t.vector, t.gpu)
        return t.factor * tab[t.pack]

    def window(self, g: int, anchor: int) -> int:
        """Window weights of GPU g counted from its use `anchor` (module docstring): its window layers in
        load order from that use on, at most `window_span` of them (layer swapping) or of the uses that
        have any (pack swapping); from a forward use, never into the backward, which would load a layer
        the forward holds (a layer's next LOAD waits for its EVICT, and uploads run in order)."""
        win = self._windows.get(g)
        if win is None:
            win = self._windows[g] = self._gpu_windows(g)
        return win[anchor]

    def _gpu_windows(self, g: int) -> list[int]:
        packs, st = self.packs[g], self.starts
        k, n_uses = len(packs), 2 * len(packs)

        def layers(s: int, use: int) -> list[int]:  # weights of the window layers of pack s at a use
            wv, nv = (self.vec[x] for x in _window_vectors(use, n_uses))
            a, b = st[s], st[s + 1]
            return [x for x, n in zip(wv[a:b], nv[a:b]) if n]

        fwd = [layers(s, u) for u, s in enumerate(packs)]
        bwd = [x[::-1] for x in fwd[:-1]][::-1]
        segs = fwd + [layers(packs[-1], k)[::-1]] + bwd  # per use, in load order
        span = window_span(max(len(x) for x in segs), self.m.prefetch_depth, self.m.swap)
        # from forward use a, the walk stops at the first backward use with window layers of a pack it
        # walked (the GPU's packs a.. are backward uses k..2k-1-a); from a backward use, at the end
        v = next((v for v in range(k, n_uses) if segs[v]), n_uses)
        stop = [v if v <= n_uses - 1 - u else n_uses for u in range(k)] + [n_uses] * k
        if not self.m.swap.whole_packs:
            first = list(accumulate((len(x) for x in segs), initial=0))  # first layer of each use
            pre = list(accumulate((b for x in segs for b in x), initial=0))
            return [pre[min(first[u] + span, first[stop[u]])] - pre[first[u]] for u in range(n_uses)]
        return [sum([sum(x) for x in segs[u:stop[u]] if x][:span]) for u in range(n_uses)]

    def moment(self, mo: Moment) -> int:
        return self.window(mo.gpu, mo.anchor) + sum(self.term(t) for t in (*mo.shared, *mo.terms))

    def peaks(self, prog: Program) -> list[int]:
        """The largest moment of each GPU: `moment` over a `Program`'s compiled moments, at speed."""
        tables = [self._tables.get(key) or self._table(*key) for key in prog.keys]
        shared = [sum(tables[ti][p] * f for ti, p, f in code) for code in prog.shared]
        windows = [self._gpu_windows(g) if p else [] for g, p in enumerate(self.packs)]
        out = [0] * len(self.packs)
        for g, anchor, si, code in prog.moments:
            b = shared[si] + windows[g][anchor] + sum(tables[ti][p] * f for ti, p, f in code)
            if b > out[g]:
                out[g] = b
        return out


@dataclass(frozen=True)
class Program:
    """`moments(...)` compiled for evaluation: the (how, vector, gpu) tables they read, and per moment
    its GPU, anchor, shared part (an index into `shared`) and own terms, each (table, pack, factor)."""

    keys: tuple[tuple[str, str, int], ...]
    shared: tuple[tuple[tuple[int, int, int], ...], ...]
    moments: tuple[tuple[int, int, int, tuple[tuple[int, int, int], ...]], ...]


@lru_cache(maxsize=256)
def program(mapping: tuple[int, ...], num_gpus: int, microbatches: int, activation_home: ActivationHome,
            kept_last: tuple[bool, ...] = ()) -> Program:
    """`moments` with the same arguments, compiled (`Program`)."""
    keys: dict[tuple[str, str, int], int] = {}
    shared: dict[int, int] = {}
    shared_code: list[tuple[tuple[int, int, int], ...]] = []

    def code(terms: tuple[Term, ...]) -> tuple[tuple[int, int, int], ...]:
        return tuple((keys.setdefault((t.how, t.vector, t.gpu), len(keys)), t.pack, t.factor) for t in terms)

    out = []
    for mo in moments(mapping, num_gpus, microbatches, activation_home, kept_last):
        si = shared.get(id(mo.shared))
        if si is None:
            si = shared[id(mo.shared)] = len(shared_code)
            shared_code.append(code(mo.shared))
        out.append((mo.gpu, mo.anchor, si, code(mo.terms)))
    return Program(tuple(keys), tuple(shared_code), tuple(out))


def gpu_peak_bytes(m: MemoryInputs, sizes: tuple[int, ...], mapping: tuple[int, ...], num_gpus: int, *,
                   kept: frozenset[int] = frozenset(), pinned: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """Peak bytes per GPU (0 for a GPU without packs): the largest of its moments (module docstring)."""
    vec = vectors(m, kept=kept, pinned=pinned)
    ev = Evaluator(m, vec, sizes, mapping, num_gpus)
    starts = ev.starts
    kept_last = tuple(bool(p) and any(starts[p[-1]] <= x < starts[p[-1] + 1] for x in kept) for p in ev.packs)
    return tuple(ev.peaks(program(mapping, num_gpus, m.microbatches, m.activation_home,
                                  kept_last if any(kept_last) else ())))


def window_terms(mo: Moment, mapping: tuple[int, ...], num_gpus: int, prefetch_depth: int, swap: SwapMode,
                 kept_last: tuple[bool, ...] = ()) -> tuple[Term, ...]:
    """The window of a moment as linear terms, for the MILP, which knows no layer sets: only the last
    packs kept whole (`kept_last`, as `auto` keeps them; their backward opens no window layers).
    Pack swapping: the packs of the next prefetch_depth + 1 uses, up to the first repeated one (exact
    unless a pack is wholly pinned). Layer swapping: the use's pack plus prefetch_depth x the first
    layer the next use loads (exact for equal packs; the compiler lets a smaller use prefetch up to the
    largest use's size more)."""
    packs = gpu_packs(mapping, num_gpus)[mo.gpu]
    us = [(u, s) for u, (s, fwd) in enumerate(uses(packs))
          if fwd or s != packs[-1] or not (kept_last and kept_last[mo.gpu])]
    ahead = [(u, s) for u, s in us if u >= mo.anchor]
    out: tuple[Term, ...] = ()
    if not swap.whole_packs:
        (u, s), nxt = ahead[0], ahead[1:2]
        out = (Term(SUM, s, _window_vectors(u, 2 * len(packs))[0]),)
        if nxt and nxt[0][1] != s and prefetch_depth:
            v, t = nxt[0]
            out += (Term(FIRST if v < len(packs) else LAST, t, _window_vectors(v, 2 * len(packs))[0], prefetch_depth),)
        return out
    seen: list[int] = []
    for u, s in ahead[:window_span(0, prefetch_depth, swap)]:
        if s in seen:
            break
        seen.append(s)
        out += (Term(SUM, s, _window_vectors(u, 2 * len(packs))[0]),)
    return out


def least_peak_bytes(m: MemoryInputs) -> int:
    """A floor under any packing's GPU peak: what the first backward op of a layer holds at its start
    (its weights and gradient, input, saved activations, the moment's transient T), for the layer
    where that is largest. Every schedule has these buffers at once, so no GPU can peak below this."""
    v = vectors(m)
    return max((v["w"][i] + v["gr"][i] + v["static"][i] + v["x"][i] + v["a"][i] + v["T"][i]
                for i in range(len(v["w"]))), default=0)
