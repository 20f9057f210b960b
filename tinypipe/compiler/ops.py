"""What the compiler passes work on: mutable Ops, and lowering them to Actions (they read an `estimate.plan.Plan`)."""

from __future__ import annotations

from tinypipe.describe.hardware import HOST
from tinypipe.ir.kinds import HOST_OPTIM, KIND_STREAM, Kind
from tinypipe.ir.schedule import Action, Mem, gpu_resource

FWD, BWD, LOAD, EVICT = Kind.FWD, Kind.BWD, Kind.LOAD, Kind.EVICT
SEND_F, SEND_B, RECV_F, RECV_B = Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B
OFFLOAD, FETCH = Kind.OFFLOAD_ACT, Kind.FETCH_ACT
GRAD_OUT, OPT_STEP, ADAPT_STEP = Kind.GRAD_OUT, Kind.OPT_STEP, Kind.ADAPT_STEP
ON_HOST = -1  # the `gpu` of an op that runs on the host (OPT_STEP, on `host.optim`); not a device name


class Op:
    """An action under construction: mutable, deps are Op references; `lower` freezes it."""

    __slots__ = ("kind", "gpu", "layer", "pack", "mb", "it", "nbytes", "peer", "deps", "allocs", "frees", "id")

    def __init__(self, kind: Kind, gpu: int, layer: int, pack: int | None, mb: int | None, it: int,
                 nbytes: int = 0, peer: int | None = None, deps: list[Op] | None = None) -> None:
        self.kind = kind
        self.gpu = gpu
        self.layer = layer
        self.pack = pack
        self.mb = mb
        self.it = it
        self.nbytes = nbytes
        self.peer = peer
        self.deps: list[Op] = deps if deps is not None else []
        self.allocs: tuple[Mem, ...] = ()
        self.frees: tuple[Mem, ...] = ()
        self.id = -1

    def __repr__(self) -> str:
        where = HOST if self.gpu == ON_HOST else f"g{self.gpu}"
        mb = "" if self.mb is None else f" m{self.mb}"
        return f"<{where} {self.kind.value} L{self.layer}{mb} i{self.it}>"


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
