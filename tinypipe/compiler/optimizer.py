"""The optimizer pass: where each layer's host OPT_STEP goes, and what waits for it (sync and async,
tied embeddings, the compact layout's gradient ring, clipping's norm barrier); docs/schedule-contract.md."""

from __future__ import annotations

from tinypipe.compiler.ops import ADAPT_STEP, BWD, GRAD_OUT, LOAD, ON_HOST, OPT_STEP, Op, _splice
from tinypipe.estimate.plan import Plan


def optimizer_pass(plan: Plan, ops: list[Op]) -> list[Op]:
    """OPT_STEP L on host.optim after GRAD_OUT L; the next iterations' LOADs wait for it.

    sync: the first LOAD of L in iteration i waits for OPT_STEP L of i-1. async (staleness 1):
    on the one of i-2; OPT_STEP L of i-1 runs as soon as its gradient has landed, and the uploads
    of iteration i that come after it read the previous version from a snapshot the host state
    takes first (backends/host/state.py; one bf16 copy of the model at most, counted in
    `hostmem.host_bytes`), so all uploads of one iteration read one weight version and no
    gradient waits on the host for the next iteration. Tied embeddings: OPT_STEP of layer 0
    also waits for GRAD_OUT of the head (its gradient share) and, under async, for the head's
    last LOAD (and only the embedding's first LOAD: its backward reads no weights); the head's
    first LOAD waits for that OPT_STEP as for its own. GRAD_OUT L of
    iteration i waits for OPT_STEP L of i-1 (the host gradient of L is consumed). compact: a
    ring of `ring_slots` host gradient slots per GPU: the k-th GRAD_OUT on a GPU waits for the
    (k - ring_slots)-th OPT_STEP of its layers in host.optim order (the step that frees a slot).

    sync, untied head: the head's OPT_STEP goes after the other steps of its GPU's iteration. Its
    gradient lands first, but the next forward reads the head last, so stepping it first delays
    every other layer's update by the head's step (0.35 s for Llama-3.1-8B's 525 M-parameter head
    on an H200 host): the optimizer runs behind the backward, and the embedding's
    update, which the next forward waits for, finishes that much later.

    Clipping by the global gradient norm (`plan.grad_clip`): every OPT_STEP of iteration i waits for
    every GRAD_OUT of i, on every GPU (the backend meets the other GPUs' with an all-reduce of the
    norm), so the host optimizer no longer overlaps the backward. Behind that barrier each GPU's
    steps go in layer order, the order the next forward reads them (sync: the forward starts once
    the embedding has stepped, not once every layer has). compact: a gradient region per layer
    instead of the ring (`hostmem.compact_grad_elems`), since all of an iteration's gradients wait
    on the host at once; a ring could never free a slot before the barrier.
    """
    if plan.lora is not None:
        return adapter_pass(plan, ops)
    pos = {op: i for i, op in enumerate(ops)}
    grad_out, first_load, last_load = _by_layer(ops)
    head = plan.num_layers - 1
    tied = plan.tied and head > 0
    lag = 1 if not plan.optimizer.is_async else 2
    last_grad_out: dict[tuple[int, int], Op] = {}  # (GPU, iteration) -> its last GRAD_OUT
    for go in grad_out.values():
        last_grad_out[go.gpu, go.it] = go
    after: dict[Op, list[Op]] = {}
    deferred: list[tuple[Op, Op]] = []  # (anchor, OPT_STEP) placed after the anchor's own step
    opt: dict[tuple[int, int], Op] = {}
    outs: dict[int, list[Op]] = {}  # iteration -> its GRAD_OUTs in list order (the clipping barrier)
    for go in grad_out.values():
        outs.setdefault(go.it, []).append(go)
    for (lay, it), go in grad_out.items():
        o = opt[lay, it] = Op(OPT_STEP, ON_HOST, lay, plan.pack_of[lay], None, it, plan.master_bytes[lay], deps=[go])
        anchor = go
        if plan.grad_clip:  # the global norm needs every gradient of the iteration, on every GPU
            o.deps = list(outs[it])
            anchor = max(outs[it], key=pos.__getitem__)
        elif not plan.optimizer.is_async and lay == head and head > 0 and not tied:
            deferred.append((last_grad_out[go.gpu, it], o))
            continue
        if tied and lay == 0:
            o.deps.append(grad_out[head, it])
        if plan.optimizer.is_async and tied and lay == 0 and it + 1 < plan.iterations:
            # tied: the embedding's own backward reads no weights, so its step need only follow the
            # embedding's first upload and the head's last one (which carries the shared matrix)
            for ld in (first_load[lay, it + 1], last_load[head, it + 1]):
                o.deps.append(ld)
                if pos[ld] > pos[anchor]:
                    anchor = ld
        after.setdefault(anchor, []).append(o)
    if plan.grad_clip:  # behind the barrier, the steps go in the order the next forward reads the layers
        for steps in after.values():
            steps.sort(key=lambda o: (o.it, o.layer))
    _wait_for_steps(grad_out, first_load, opt, lag, head if tied else None)
    for anchor, o in deferred:
        after.setdefault(anchor, []).append(o)
    out = _splice(ops, {}, after)
    if plan.host_memory.grad_ring and not plan.grad_clip:  # clipping: a region per layer, no ring
        _ring_deps(out, plan.ring_slots, {o: grad_out[o.layer, o.it].gpu for o in opt.values()})
    return out


def _by_layer(ops: list[Op]) -> tuple[dict[tuple[int, int], Op], dict[tuple[int, int], Op], dict[tuple[int, int], Op]]:
    """By (layer, iteration): its GRAD_OUT, its first LOAD and its last LOAD."""
    grad_out: dict[tuple[int, int], Op] = {}
    first_load: dict[tuple[int, int], Op] = {}
    last_load: dict[tuple[int, int], Op] = {}
    for op in ops:
        if op.kind is GRAD_OUT:
            grad_out[op.layer, op.it] = op
        elif op.kind is LOAD:
            first_load.setdefault((op.layer, op.it), op)
            last_load[op.layer, op.it] = op
    return grad_out, first_load, last_load


def _wait_for_steps(grad_out: dict[tuple[int, int], Op], first_load: dict[tuple[int, int], Op],
                    opt: dict[tuple[int, int], Op], lag: int, tied_head: int | None) -> None:
    """GRAD_OUT L of iteration i waits for OPT_STEP L of i-1 (the gradient slot/buffer of L is free again); the
    first LOAD of L in i for OPT_STEP L of i - `lag`. `tied_head`: the head, whose GRAD_OUT and LOAD also wait
    for the embedding's step (the shared matrix)."""
    for (lay, it), go in grad_out.items():
        if it >= 1:
            go.deps.append(opt[lay, it - 1])
            if lay == tied_head:
                go.deps.append(opt[0, it - 1])
    for (lay, it), ld in first_load.items():
        if it >= lag:
            ld.deps.append(opt[lay, it - lag])
            if lay == tied_head:
                ld.deps.append(opt[0, it - lag])


def adapter_pass(plan: Plan, ops: list[Op]) -> list[Op]:
    """LoRA on a frozen base: ADAPT_STEP L (the adapters' fused AdamW, `nbytes` their fp32 weights) on the
    owner GPU's compute stream right after L's last BWD of the iteration, for each layer with adapters.

    The stream's order is the whole dependency: the step follows the backward that made its last
    gradient and precedes the next iteration's FWD of the layer, so every optimizer mode reads the
    adapters of the previous step (nothing is left for an asynchronous step to hide; no host step
    exists). No LOAD waits for it: the base does not change.

    Clipping by the global gradient norm (`plan.grad_clip`): the norm needs every adapter gradient of the
    iteration, on every GPU, so each GPU's steps go after the iteration's last BWD (in list order, after every
    other GPU's BWDs and SEND_Bs), in layer order, each waiting for every GPU's last BWD (the backend meets the
    other GPUs' with an all-reduce of the norm at a rank's first step). A GPU whose layers have no adapters gets
    an empty step (0 bytes) of its first layer, so that every rank joins that all-reduce.
    """
    if plan.grad_clip:
        return _clipped_adapter_steps(plan, ops)
    last: dict[tuple[int, int], Op] = {}
    for op in ops:
        if op.kind is BWD:
            last[op.layer, op.it] = op
    after: dict[Op, list[Op]] = {}
    for (lay, it), b in last.items():
        if plan.master_bytes[lay] > 0:
            after.setdefault(b, []).append(Op(ADAPT_STEP, b.gpu, lay, b.pack, None, it, plan.master_bytes[lay],
                                              deps=[b]))
    return _splice(ops, {}, after)


def _clipped_adapter_steps(plan: Plan, ops: list[Op]) -> list[Op]:
    """`adapter_pass` under clipping (its docstring): the steps of an iteration behind its last BWD."""
    last: dict[tuple[int, int], Op] = {}  # (GPU, iteration) -> its last BWD
    anchor: dict[int, Op] = {}  # iteration -> its last BWD in list order
    for op in ops:
        if op.kind is BWD:
            last[op.gpu, op.it] = anchor[op.it] = op
    after: dict[Op, list[Op]] = {}
    for it, end in anchor.items():
        barrier = [b for (_, i), b in sorted(last.items()) if i == it]
        for g in sorted({g for g, i in last if i == it}):
            owned = [lay for lay in range(plan.num_layers) if plan.owner[lay] == g]
            layers = [lay for lay in owned if plan.master_bytes[lay] > 0] or owned[:1]
            after.setdefault(end, []).extend(
                Op(ADAPT_STEP, g, lay, plan.pack_of[lay], None, it, plan.master_bytes[lay], deps=list(barrier))
                for lay in layers)
    return _splice(ops, {}, after)


def _ring_deps(ops: list[Op], slots: int, gpu_of_step: dict[Op, int]) -> None:
    """The k-th GRAD_OUT on a GPU waits for the (k - slots)-th OPT_STEP of that GPU's layers in
    list (host.optim) order: the steps free their gradient slots in that order."""
    steps: dict[int, list[Op]] = {}
    outs: dict[int, int] = {}
    for op in ops:
        if op.kind is OPT_STEP:
            steps.setdefault(gpu_of_step[op], []).append(op)
        elif op.kind is GRAD_OUT:
            k = outs[op.gpu] = outs.get(op.gpu, -1) + 1
            if k >= slots:
                lane = steps.get(op.gpu, [])
                if len(lane) <= k - slots:  # a compiler bug: the slot would never be freed
                    raise AssertionError(f"GRAD_OUT of layer {op.layer} (iteration {op.it}) would wait for a "
                                         f"gradient slot no earlier OPT_STEP frees")
                op.deps.append(lane[k - slots])
