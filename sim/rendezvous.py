"""Pairing of SEND and RECV halves: between two GPUs, the k-th SEND matches the k-th RECV in list order."""

from __future__ import annotations

from collections import defaultdict, deque

from tinypipe.errors import ScheduleError
from tinypipe.schedule import Action, Kind, Schedule, resource_gpu


def sender_receiver(action: Action) -> tuple[int, int]:
    """(sending GPU, receiving GPU) of a SEND or RECV half."""
    g = resource_gpu(action.resource)
    if g is None or action.peer is None:
        raise ScheduleError(f"`{action}` (action {action.id}) must run on a GPU send/recv stream and name its peer")
    return (g, action.peer) if action.kind is Kind.SEND else (action.peer, g)


def pair_sends(schedule: Schedule) -> dict[int, int]:
    """Map each SEND / RECV id to the id of its other half; unmatched halves are a ScheduleError."""
    sends: dict[tuple[int, int], deque[int]] = defaultdict(deque)
    recvs: dict[tuple[int, int], deque[int]] = defaultdict(deque)
    for a in schedule.actions:
        if a.kind is Kind.SEND:
            sends[sender_receiver(a)].append(a.id)
        elif a.kind is Kind.RECV:
            recvs[sender_receiver(a)].append(a.id)
    partner: dict[int, int] = {}
    for key in sends.keys() | recvs.keys():
        s, r = sends[key], recvs[key]
        if len(s) != len(r):
            extra = s[len(r)] if len(s) > len(r) else r[len(s)]
            raise ScheduleError(
                f"g{key[0]} -> g{key[1]}: {len(s)} SEND but {len(r)} RECV; `{schedule.actions[extra]}` "
                f"(action {extra}) has no other half")
        for x, y in zip(s, r):
            partner[x] = y
            partner[y] = x
    return partner
