"""When an action may run: its predecessors (stream order, dependencies, the other half of a copy) and the
SEND / RECV pairs. One definition for the validator, the simulator, its critical path and the backend.

The rule (docs/schedule-contract.md, like CUDA streams + events): each resource runs its actions in
list order; an action starts when the previous action on its resource and all its dependencies have
finished. A SEND and its RECV are the two halves of one copy: it starts once *both* halves are ready,
and both end when it ends. So the halves do not wait for each other's end (that would deadlock); what
a half's copy waits for is its own predecessors and its other half's (`predecessors(..., partner=)`).

Lanes (`run_lanes`): the queues a run executes a schedule's actions on. Each resource is one, except
`host.optim`: every rank has an optimizer thread of its own (backends/rank/hostwork.py), which runs the
OPT_STEPs of the layers the rank owns in list order, so the steps of different ranks overlap.

Pairs: between two GPUs, the k-th SEND (SEND_F or SEND_B) from the sender to the receiver matches the
k-th RECV on the receiver from the sender, in list order, whatever they carry (NCCL / gloo match
point-to-point messages in issue order). That the halves agree (layer, microbatch, bytes, direction)
is the validator's to check.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence

from tinypipe.common.errors import ScheduleError
from tinypipe.ir.schedule import HOST_OPTIM, Action, Schedule, resource_gpu


class UnpairedError(ScheduleError):
    """A SEND or RECV without its other half; `action` is the id of the first one left over."""

    def __init__(self, message: str, action: int) -> None:
        super().__init__(message)
        self.action = action

    def __reduce__(self) -> tuple[type[UnpairedError], tuple[str, int]]:  # pickled back from a worker process
        return type(self), (str(self), self.action)


def sender_receiver(action: Action) -> tuple[int, int]:
    """(sending GPU, receiving GPU) of a SEND or RECV half."""
    g = resource_gpu(action.resource)
    if g is None or action.peer is None:
        raise ScheduleError(f"`{action}` (action {action.id}) must run on a GPU send/recv stream and name its peer")
    return (g, action.peer) if action.kind.info.stream == "send" else (action.peer, g)


def pair_halves(actions: Iterable[Action]) -> dict[int, int]:
    """Map each SEND / RECV id to the id of its other half; a half left over raises UnpairedError."""
    sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for a in actions:
        info = a.kind.info
        if info.is_half:
            (sends if info.stream == "send" else recvs)[sender_receiver(a)].append(a)
    partner: dict[int, int] = {}
    for key in sorted(sends.keys() | recvs.keys()):
        ss, rs = sends[key], recvs[key]
        if len(ss) != len(rs):
            s, r = key
            counts = f"g{s} -> g{r}: {len(ss)} SEND but {len(rs)} RECV"
            if len(ss) > len(rs):
                x = ss[len(rs)]
                raise UnpairedError(f"unpaired SEND: action {x.id} ({x}) has no matching RECV on g{r} ({counts})",
                                    x.id)
            x = rs[len(ss)]
            raise UnpairedError(f"unpaired RECV: action {x.id} ({x}) has no matching SEND on g{s} ({counts})", x.id)
        for a, b in zip(ss, rs):
            partner[a.id] = b.id
            partner[b.id] = a.id
    return partner


class Predecessors(Mapping[int, tuple[int, ...]]):
    """Action id -> the ids it waits for (see `predecessors`), each tuple made when it is asked for:
    a critical path walks a few hundred of tens of thousands."""

    __slots__ = ("_acts", "_prev", "_partner")

    def __init__(self, acts: dict[int, Action], prev: dict[int, int], partner: Mapping[int, int]) -> None:
        self._acts = acts
        self._prev = prev
        self._partner = partner

    def _own(self, a: Action) -> tuple[int, ...]:
        p = self._prev.get(a.id)
        return a.deps if p is None else (p, *a.deps)

    def __getitem__(self, aid: int) -> tuple[int, ...]:
        a = self._acts[aid]
        other = self._acts.get(self._partner.get(aid, -1)) if self._partner else None
        return self._own(a) if other is None else self._own(a) + self._own(other)

    def __iter__(self) -> Iterator[int]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)


def predecessors(actions: Sequence[Action], *, partner: Mapping[int, int] | None = None,
                 lanes: Mapping[str, Sequence[int]] | None = None) -> Predecessors:
    """Per action id, what it waits for: the previous action on its resource, then its dependencies.

    With `partner` (from `pair_halves`), a SEND / RECV half also waits for its other half's own
    predecessors: together they are what the copy waits for. `lanes` (lane -> ids in order) replaces
    the resources' lists where the actions really ran on other queues (replay: one optimizer lane per
    rank); the ids in `lanes` index `actions` by position. Without it, the resources' lists are the
    actions' order per resource. Dependencies outside `actions` are listed too: what counts as met is
    the caller's to say (the backend runs one rank's window and counts them as met).
    """
    prev: dict[int, int] = {}
    if lanes is None:
        last: dict[str, int] = {}
        for a in actions:
            p = last.get(a.resource)
            if p is not None:
                prev[a.id] = p
            last[a.resource] = a.id
    else:
        for ids in lanes.values():
            for x, y in zip(ids, ids[1:]):
                prev[actions[y].id] = actions[x].id
    return Predecessors({a.id: a for a in actions}, prev, partner or {})


def layer_owner(schedule: Schedule) -> dict[int, int]:
    """The GPU (rank) that owns each layer: the one its pack runs on, whose host state and optimizer thread
    hold the layer."""
    return {layer: g for p, g in enumerate(schedule.pack_gpu) for layer in schedule.pack_layers[p]}


def optimizer_lane(rank: int) -> str:
    """The name of rank `rank`'s optimizer lane (`host.optim.g0`)."""
    return f"{HOST_OPTIM}.g{rank}"


def run_lanes(schedule: Schedule) -> dict[str, tuple[int, ...]]:
    """Lane -> action ids in order (see the module docstring): every resource's list, with `host.optim`
    split into one lane per rank that owns a layer (`optimizer_lane`). An OPT_STEP of a layer that no
    pack holds stays on `host.optim` (the validator reports such a schedule)."""
    owner = layer_owner(schedule)
    out: dict[str, list[int]] = {}
    for res, ids in schedule.by_resource().items():
        for i in ids:
            g = owner.get(schedule.actions[i].layer) if res == HOST_OPTIM else None
            out.setdefault(res if g is None else optimizer_lane(g), []).append(i)
    return {k: tuple(v) for k, v in out.items()}
