"""The compiler's passes, each a list-to-list function tested alone (docs/schedule-contract.md).

compute_ops -> swap_pass -> transfer_pass -> gradient_pass -> optimizer_pass (optimizer.py) -> memory_pass.
"""

from __future__ import annotations

from collections import defaultdict

from tinypipe.compiler.ops import (
    BWD,
    EVICT,
    FETCH,
    FWD,
    GRAD_OUT,
    LOAD,
    OFFLOAD,
    ON_HOST,
    OPT_STEP,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Op,
    _splice,
)
from tinypipe.describe.hardware import HOST
from tinypipe.estimate.gpumem import window_span
from tinypipe.estimate.plan import Plan
from tinypipe.ir.kinds import Carries, Kind
from tinypipe.ir.schedule import Mem

# ---- 1. compute plan ----------------------------------------------------------------------------

def compute_ops(plan: Plan) -> list[Op]:
    """Per iteration: FWD over packs in order, BWD over packs in reverse; microbatch-major in a pack.

    Deps: FWD L m on FWD L-1 m (its input); BWD L m on FWD L m (its saved input) and BWD L+1 m
    (its incoming gradient). Cross-GPU deps are rewritten by `transfer_pass`.
    """
    n, mbs = plan.num_layers, plan.microbatches
    ops: list[Op] = []
    for it in range(plan.iterations):
        fwd: dict[tuple[int, int], Op] = {}
        for s, layers in enumerate(plan.pack_layers):
            g = plan.pack_gpu[s]
            for m in range(mbs):
                for lay in layers:
                    op = Op(FWD, g, lay, s, m, it, deps=[fwd[lay - 1, m]] if lay else [])
                    fwd[lay, m] = op
                    ops.append(op)
        bwd: dict[tuple[int, int], Op] = {}
        for s in range(len(plan.pack_layers) - 1, -1, -1):
            g = plan.pack_gpu[s]
            layers = plan.pack_layers[s]
            for m in range(mbs):
                for lay in reversed(layers):
                    deps = [fwd[lay, m], bwd[lay + 1, m]] if lay + 1 < n else [fwd[lay, m]]
                    op = Op(BWD, g, lay, s, m, it, deps=deps)
                    bwd[lay, m] = op
                    ops.append(op)
    return ops


# ---- 2. swapping --------------------------------------------------------------------------------

class _Seg:
    """A residency segment: layer `layer` stays on its GPU from `first` to `last` (compute ops)."""

    __slots__ = ("layer", "first", "last", "first_use", "last_use", "load", "evict")

    def __init__(self, layer: int, op: Op, use: int) -> None:
        self.layer = layer
        self.first = self.last = op
        self.first_use = self.last_use = use
        self.load: Op | None = None
        self.evict: Op | None = None


def swap_pass(plan: Plan, ops: list[Op]) -> list[Op]:
    """LOAD before and EVICT after every residency segment of a layer on its GPU.

    A *use* is a run of one pack's compute ops on its GPU (its forward, or its backward, of one
    iteration). A layer gets one segment per use; `kept` layers one from their forward to their
    backward; `pinned` layers one per iteration. Swap `layer`: the LOAD feeds the layer's first op
    and the EVICT follows its last. Swap `pack`: all LOADs feed the use's first op and all EVICTs
    follow its last. Memory stays bounded by a window over the segments of each GPU (pinned ones
    and kept ones spanning other uses aside), `gpumem.window_span`, which the GPU-memory formula
    reads too: layer mode, LOAD k waits for EVICT k - W with W = the most segments in a use +
    prefetch_depth; pack mode, a use's LOADs wait for the EVICTs of the use prefetch_depth + 1
    uses back. A LOAD also waits for the EVICT of the layer's previous
    segment (one buffer per layer).
    """
    n_gpus = max(plan.pack_gpu) + 1
    segs, use_first, use_last = _segments(plan, ops, n_gpus)
    before: dict[Op, list[Op]] = {}
    after: dict[Op, list[Op]] = {}
    layer_mode = not plan.swap.whole_packs
    for g in range(n_gpus):
        prev: dict[int, Op] = {}
        window: list[_Seg] = []
        for seg in segs[g]:
            lay = seg.layer
            nb = plan.load_bytes[lay]  # what the copy carries (its allocation is w.L, `memory_pass`)
            ld = seg.load = Op(LOAD, g, lay, plan.pack_of[lay], None, seg.first.it, nbytes=nb)
            ev = seg.evict = Op(EVICT, g, lay, plan.pack_of[lay], None, seg.last.it)
            if layer_mode:
                first, last = seg.first, seg.last
            else:
                first, last = use_first[g][seg.first_use], use_last[g][seg.last_use]
            before.setdefault(first, []).append(ld)
            first.deps.append(ld)
            after.setdefault(last, []).append(ev)
            if lay in prev:
                ld.deps.append(prev[lay])
            prev[lay] = ev
            if lay not in plan.pinned and seg.last_use - seg.first_use <= 1:
                window.append(seg)
        if window:
            _window_deps(plan, window)
    return _splice(ops, before, after)


def _segments(plan: Plan, ops: list[Op], n_gpus: int) -> tuple[list[list[_Seg]], list[list[Op]], list[list[Op]]]:
    """Per GPU: its residency segments in order, and the first and the last compute op of each of its uses."""
    cur: list[tuple[int, Kind, int | None] | None] = [None] * n_gpus
    use_first: list[list[Op]] = [[] for _ in range(n_gpus)]
    use_last: list[list[Op]] = [[] for _ in range(n_gpus)]
    segs: list[list[_Seg]] = [[] for _ in range(n_gpus)]
    open_: dict[int, _Seg] = {}
    pinned, kept = plan.pinned, plan.kept
    for op in ops:
        if op.kind is not FWD and op.kind is not BWD:
            continue
        g = op.gpu
        key = (op.it, op.kind, op.pack)
        if key != cur[g]:
            cur[g] = key
            use_first[g].append(op)
            use_last[g].append(op)
        else:
            use_last[g][-1] = op
        u = len(use_first[g]) - 1
        lay = op.layer
        seg = open_.get(lay)
        if seg is not None and (seg.last_use == u or (seg.first.it == op.it and (
                lay in pinned or (lay in kept and seg.first.kind is FWD and op.kind is BWD)))):
            seg.last, seg.last_use = op, u
        else:
            seg = open_[lay] = _Seg(lay, op, u)
            segs[g].append(seg)
    return segs, use_first, use_last


def _window_deps(plan: Plan, window: list[_Seg]) -> None:
    """The window over one GPU's segments (`gpumem.window_span`): layer mode, LOAD k waits for EVICT k - W; pack
    mode, a use's LOADs wait for the EVICTs of the use W uses back."""
    groups: list[list[_Seg]] = []
    for seg in window:
        if groups and groups[-1][0].first_use == seg.first_use:
            groups[-1].append(seg)
        else:
            groups.append([seg])
    span = window_span(max(len(grp) for grp in groups), plan.prefetch_depth, plan.swap)  # layers, or uses by pack
    if not plan.swap.whole_packs:
        for k in range(span, len(window)):
            load, gone = window[k].load, window[k - span].evict
            assert load is not None and gone is not None  # every segment of the window has both
            load.deps.append(gone)
    else:
        for j in range(span, len(groups)):
            evict = max(groups[j - span], key=lambda sg: sg.last_use).evict
            assert evict is not None
            for seg in groups[j]:
                assert seg.load is not None
                seg.load.deps.append(evict)


# ---- 3. transfers -------------------------------------------------------------------------------

def transfer_pass(plan: Plan, ops: list[Op]) -> list[Op]:
    """SEND/RECV pairs for boundary activations and gradients between GPUs; offload when asked.

    A cross-GPU dep of FWD L m (on FWD L-1 m) becomes SEND_F x.L{L} (after the producer, on its
    GPU) + RECV_F (on the consumer's GPU, the consumer's new dep); of BWD L m (on BWD L+1 m)
    likewise SEND_B / RECV_B for dx.L{L+1}. `layer` of a SEND/RECV is the L of the buffer it moves. Both halves
    sit right after the producer, so the send and recv streams order pairs by producer, the same
    on both sides. activation_home=host: OFFLOAD_ACT L m after FWD L m (the input's last forward
    reader); FETCH_ACT L m before BWD L m, after the offload and after BWD L m-1 (inputs come
    back one microbatch ahead). Only for layers that recompute: a layer that keeps its forward's graph
    (the head) keeps its input in it, so an offload would free nothing on the GPU and the fetch would
    make a second copy (an H200, Qwen3-1.7B 4 x 2048, `run --trace-memory`: the peak at the
    head's second backward was the ledger's plus its 8 inputs, 0.25 GiB, when they were offloaded).
    """
    before: dict[Op, list[Op]] = {}
    after: dict[Op, list[Op]] = {}
    offload = plan.activation_home.on_host
    offloads: dict[tuple[int, int, int], Op] = {}
    last_bwd: dict[tuple[int, int], Op] = {}
    for op in ops:
        kind = op.kind
        if kind is not FWD and kind is not BWD:
            continue
        deps = op.deps
        for j, d in enumerate(deps):
            if d.gpu != op.gpu and (d.kind is FWD or d.kind is BWD):
                grad = kind is BWD
                lay = d.layer if grad else op.layer
                nb = plan.input_bytes[lay]
                send = Op(SEND_B if grad else SEND_F, d.gpu, lay, None, op.mb, op.it, nb, op.gpu, [d])
                recv = Op(RECV_B if grad else RECV_F, op.gpu, lay, None, op.mb, op.it, nb, d.gpu, [])
                deps[j] = recv
                after.setdefault(d, []).extend((send, recv))
        if offload and op.layer > 0 and plan.recomputes(op.layer):
            key = (op.layer, op.mb or 0, op.it)
            nb = plan.input_bytes[op.layer]
            if kind is FWD:
                off = offloads[key] = Op(OFFLOAD, op.gpu, op.layer, op.pack, op.mb, op.it, nb, deps=[op])
                after.setdefault(op, []).append(off)
            else:
                fdeps = [offloads[key]]
                prev = last_bwd.get((op.layer, op.it))
                if prev is not None:
                    fdeps.append(prev)
                fetch = Op(FETCH, op.gpu, op.layer, op.pack, op.mb, op.it, nb, deps=fdeps)
                before.setdefault(op, []).append(fetch)
                deps.append(fetch)
        if kind is BWD:
            last_bwd[op.layer, op.it] = op
    return _splice(ops, before, after)


# ---- 4. gradients -------------------------------------------------------------------------------

def gradient_pass(plan: Plan, ops: list[Op]) -> list[Op]:
    """GRAD_OUT L (gr.L{L} to the host, on the owner's d2h) right after L's last BWD of the iteration.

    The first BWD of L in the next iteration (which allocates gr.L{L} again) waits for it. A frozen base
    (LoRA) has no gradient to hand out: none (the optimizer pass steps its adapters on the GPU).
    """
    if plan.lora is not None:
        return ops
    first: dict[tuple[int, int], Op] = {}
    last: dict[tuple[int, int], Op] = {}
    for op in ops:
        if op.kind is BWD:
            first.setdefault((op.layer, op.it), op)
            last[op.layer, op.it] = op
    after: dict[Op, list[Op]] = {}
    for (lay, it), b in last.items():
        go = Op(GRAD_OUT, b.gpu, lay, b.pack, None, it, plan.grad_out_bytes[lay], deps=[b])
        after.setdefault(b, []).append(go)
        nxt = first.get((lay, it + 1))
        if nxt is not None:
            nxt.deps.append(go)
    return _splice(ops, {}, after)


# ---- 6. memory effects --------------------------------------------------------------------------

def memory_pass(plan: Plan, ops: list[Op]) -> list[Op]:
    """Set each op's allocs (at start) and frees (at end) per the contract's buffer table.

    Buffers of 0 bytes are left out (the first layer's input is token ids). Equal effects share
    one Mem object (they are immutable), which keeps this pass cheap.
    """
    effects = _Effects(plan)
    for op in ops:
        k = op.kind
        if k is FWD:
            effects.forward(op)
        elif k is BWD:
            effects.backward(op)
        else:
            effects.other(op)
    return ops


class _Effects:
    """`memory_pass`'s buffers (made once per device, name and size) and what it tracks op by op.

    A layer that keeps its forward's graph (no recompute) keeps its weights with it: its saved tensors
    reference them. An EVICT between its FWDs and its BWDs frees nothing, and the LOAD before the BWDs
    makes a second copy (wr.L), freed with the graphs at the layer's last BWD of the step; the first
    copy (w.L) goes at the EVICT after the BWDs. Measured on an H200 (Qwen3-1.7B, resident none,
    `run --trace-memory`): the tied head's 0.58 GiB twice from its re-LOAD to its BWDs.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.cache: dict[tuple[int, str, int, int | None], tuple[Mem, ...]] = {}
        self.devs = {g: (HOST if g == ON_HOST else f"g{g}") for g in {*plan.pack_gpu, ON_HOST}}
        self.sizes = {"x": plan.input_bytes, "dx": plan.input_bytes, "a": plan.saved_bytes, "w": plan.weight_bytes,
                      "gr": plan.grad_acc_bytes, "ws": plan.layer_workspace_bytes,
                      "ws.acc": plan.accumulate_workspace_bytes, "wr": plan.weight_bytes, "act": plan.input_bytes,
                      "gring": plan.host_grad_bytes}
        self.n = plan.num_layers
        self.grad_ring = plan.host_memory.grad_ring
        self.seen: set[tuple[int, int]] = set()  # (layer, step): its first BWD ran
        self.graphs: set[tuple[int, int]] = set()  # (layer, step): FWDs kept a graph, no BWD yet
        self.held: dict[tuple[int, int], int] = {}  # (layer, step) -> 1 when its EVICT kept the weights, 2 re-LOADed
        self.bwds: dict[tuple[int, int], int] = defaultdict(int)
        self.redo = [plan.recomputes(lay) for lay in range(self.n)]

    def mem(self, g: int, kind: str, lay: int, m: int | None = None) -> tuple[Mem, ...]:
        key = (g, kind, lay, m)
        hit = self.cache.get(key)
        if hit is None:
            nbytes = self.sizes[kind][lay] if 0 <= lay < self.n else 0
            name = kind if kind.startswith("ws") else f"{kind}.L{lay}" if m is None else f"{kind}.L{lay}.m{m}"
            hit = self.cache[key] = (Mem(self.devs[g], name, nbytes),) if nbytes > 0 else ()
        return hit

    def forward(self, op: Op) -> None:
        mem, g, lay, m, redo = self.mem, op.gpu, op.layer, op.mb, self.redo[op.layer]
        if not redo:
            self.graphs.add((lay, op.it))
        ws = mem(g, "ws", lay)
        op.allocs = mem(g, "x", lay + 1, m) + (() if redo else mem(g, "a", lay, m)) + ws
        op.frees = ws

    def backward(self, op: Op) -> None:
        mem, g, lay, m = self.mem, op.gpu, op.layer, op.mb
        self.graphs.discard((lay, op.it))
        self.bwds[lay, op.it] += 1
        # the layer's first BWD of the step allocates its gradient accumulator; a later one holds
        # the weights' fresh gradients until it has added them in (ws.acc)
        gr: tuple[Mem, ...] = ()
        ws = mem(g, "ws.acc", lay)
        if (lay, op.it) not in self.seen:
            self.seen.add((lay, op.it))
            ws, gr = mem(g, "ws", lay), mem(g, "gr", lay)
        # Recomputing, the backward re-creates the forward's saved activations and holds them
        # while it runs (trace.KindProfile); kept from the forward, it frees them at its end.
        a = mem(g, "a", lay, m)
        rec = a if self.redo[lay] else ()
        op.allocs = mem(g, "dx", lay, m) + gr + ws + rec
        op.frees = mem(g, "x", lay, m) + a + mem(g, "dx", lay + 1, m) + ws
        if self.bwds[lay, op.it] == self.plan.microbatches and self.held.pop((lay, op.it), 0) == 2:
            op.frees += mem(g, "wr", lay)

    def other(self, op: Op) -> None:
        """Every kind but FWD and BWD."""
        mem, k, g, lay, m = self.mem, op.kind, op.gpu, op.layer, op.mb
        if k is LOAD:
            reload = self.held.get((lay, op.it)) == 1
            if reload:
                self.held[lay, op.it] = 2
            op.allocs = mem(g, "wr" if reload else "w", lay)
        elif k is EVICT:
            if (lay, op.it) in self.graphs:
                self.held[lay, op.it] = 1
            else:
                op.frees = mem(g, "w", lay)
        elif k.info.is_half:  # the sender frees the buffer it moves (x, or dx for a gradient); the receiver takes it
            moved = mem(g, "dx" if k.info.carries is Carries.GRADIENT else "x", lay, m)
            if k.info.stream == "send":
                op.frees = moved
            else:
                op.allocs = moved
        elif k is OFFLOAD:
            op.allocs, op.frees = mem(ON_HOST, "act", lay, m), mem(g, "x", lay, m)
        elif k is FETCH:
            op.allocs, op.frees = mem(g, "x", lay, m), mem(ON_HOST, "act", lay, m)
        elif k is GRAD_OUT:
            op.frees = mem(g, "gr", lay)
            if self.grad_ring:
                op.allocs = mem(ON_HOST, "gring", lay)
        elif k is OPT_STEP and self.grad_ring:
            op.frees = mem(ON_HOST, "gring", lay)
