"""What the compiler passes work on: mutable Ops, the Plan they read, and lowering to Actions."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypipe.hostmem import DEFAULT_GRAD_RING_SLOTS
from tinypipe.schedule import HOST_OPTIM, KIND_STREAM, Action, Kind, Mem, gpu_resource, recomputes

FWD, BWD, LOAD, EVICT = Kind.FWD, Kind.BWD, Kind.LOAD, Kind.EVICT
SEND, RECV, OFFLOAD, FETCH = Kind.SEND, Kind.RECV, Kind.OFFLOAD_ACT, Kind.FETCH_ACT
GRAD_OUT, OPT_STEP = Kind.GRAD_OUT, Kind.OPT_STEP
ON_HOST = -1  # the `gpu` of an op that runs on the host (OPT_STEP, on `host.optim`); not a device name


class Op:
    """An action under construction: mutable, deps are Op references; `lower` freezes it."""

    __slots__ = ("kind", "gpu", "layer", "pack", "mb", "it", "nbytes", "peer", "deps", "grad",
                 "allocs", "frees", "id")

    def __init__(self, kind: Kind, gpu: int, layer: int, pack: int | None, mb: int | None, it: int,
                 nbytes: int = 0, peer: int | None = None, deps: list[Op] | None = None,
                 grad: bool = False) -> None:
        self.kind = kind
        self.gpu = gpu
        self.layer = layer
        self.pack = pack
        self.mb = mb
        self.it = it
        self.nbytes = nbytes
        self.peer = peer
        self.deps: list[Op] = deps if deps is not None else []
        self.grad = grad  # SEND/RECV: True for a gradient (dx), False for an activation (x)
        self.allocs: tuple[Mem, ...] = ()
        self.frees: tuple[Mem, ...] = ()
        self.id = -1

    def __repr__(self) -> str:
        where = "host" if self.gpu == ON_HOST else f"g{self.gpu}"
        mb = "" if self.mb is None else f" m{self.mb}"
        return f"<{where} {self.kind.value} L{self.layer}{mb} i{self.it}>"


@dataclass(frozen=True)
class Plan:
    """What the passes need: packs and their GPUs, byte sizes per layer, and the policy's switches."""

    pack_layers: tuple[tuple[int, ...], ...]
    pack_gpu: tuple[int, ...]
    microbatches: int
    iterations: int
    weight_bytes: tuple[int, ...]  # w.L{l} on the GPU (compute dtype); also gr.L{l} and GRAD_OUT
    input_bytes: tuple[int, ...]  # x.L{l}.m and dx.L{l}.m (0 for the first layer: token ids)
    saved_bytes: tuple[int, ...]  # a.L{l}.m (kept without recompute)
    workspace_bytes: tuple[int, ...]  # ws of each FWD / BWD
    host_grad_bytes: tuple[int, ...]  # host gring.L{l} slot (compute dtype), compact layout only
    master_bytes: tuple[int, ...]  # OPT_STEP nbytes: fp32 master of the layer's own parameters
    swap: str = "layer"
    prefetch_depth: int = 1
    kept: frozenset[int] = frozenset()  # held from their forward to their backward
    pinned: frozenset[int] = frozenset()  # held for the whole iteration
    activation_home: str = "gpu"
    optimizer: str = "sync"
    host_memory: str = "compact"
    recompute: bool = True
    tied: bool = False  # the last layer (head) uses the first layer's (embedding's) matrix
    ring_slots: int = DEFAULT_GRAD_RING_SLOTS
    num_layers: int = field(init=False)
    owner: tuple[int, ...] = field(init=False)  # GPU of each layer
    pack_of: tuple[int, ...] = field(init=False)  # pack of each layer

    def __post_init__(self) -> None:
        owner: list[int] = []
        pack_of: list[int] = []
        for s, layers in enumerate(self.pack_layers):
            if layers != tuple(range(len(owner), len(owner) + len(layers))):
                raise ValueError(f"pack {s} is not the next run of consecutive layers: {layers}")
            owner += [self.pack_gpu[s]] * len(layers)
            pack_of += [s] * len(layers)
        object.__setattr__(self, "num_layers", len(owner))
        object.__setattr__(self, "owner", tuple(owner))
        object.__setattr__(self, "pack_of", tuple(pack_of))

    def recomputes(self, layer: int) -> bool:
        """Whether BWD of `layer` recomputes its forward (`schedule.recomputes`)."""
        return recomputes(self.recompute, layer, self.num_layers)

    @classmethod
    def toy(cls, sizes: tuple[int, ...], gpus: tuple[int, ...], microbatches: int, *,
            iterations: int = 1, **kw: object) -> Plan:
        """A plan with small made-up byte sizes, for testing one pass alone."""
        n = sum(sizes)
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        packs = tuple(tuple(range(a, a + k)) for a, k in zip(starts, sizes))
        base: dict[str, object] = dict(
            weight_bytes=(100,) * n, input_bytes=(0,) + (10,) * (n - 1), saved_bytes=(30,) * n,
            workspace_bytes=(5,) * n, host_grad_bytes=(200,) * n, master_bytes=(200,) * n)
        base.update(kw)
        return cls(pack_layers=packs, pack_gpu=gpus, microbatches=microbatches, iterations=iterations,
                   **base)  # type: ignore[arg-type]


def _splice(ops: list[Op], before: dict[Op, list[Op]], after: dict[Op, list[Op]]) -> list[Op]:
    """A new list with `before[op]` inserted just before and `after[op]` just after each op."""
    out: list[Op] = []
    for op in ops:
        b = before.get(op)
        if b:
            out.extend(b)
        out.append(op)
        a = after.get(op)
        if a:
            out.extend(a)
    return out



def lower(ops: list[Op]) -> tuple[Action, ...]:
    """Freeze ops into Actions: ids are list positions, deps sorted ids (all smaller than the id)."""
    names: dict[tuple[int, Kind], str] = {}
    for i, op in enumerate(ops):
        op.id = i
    out: list[Action] = []
    append = out.append
    for i, op in enumerate(ops):
        res = names.get((op.gpu, op.kind))
        if res is None:
            res = names[op.gpu, op.kind] = (HOST_OPTIM if op.gpu == ON_HOST
                                            else gpu_resource(op.gpu, KIND_STREAM[op.kind]))
        dl = op.deps
        nd = len(dl)
        if nd == 1:
            deps: tuple[int, ...] = (dl[0].id,)
        elif nd == 2:
            a, b = dl[0].id, dl[1].id
            deps = (a, b) if a < b else (b, a) if b < a else (a,)
        else:
            deps = tuple(sorted({d.id for d in dl}))
        if deps and (deps[-1] >= i or deps[0] < 0):
            raise AssertionError(f"compiler bug: {op!r} depends on a later or missing op")
        append(Action(i, op.kind, res, op.layer, op.pack, op.mb, op.it, op.nbytes, op.peer, deps,
                      op.allocs, op.frees))
    return tuple(out)
