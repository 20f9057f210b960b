"""The executor's issue loop as data: what a rank's main thread waits for before it issues an action.

One host thread per rank issues all its actions (backends/rank/executor.py; `tinypipe.ir.schedule.rank_actions`):
it takes the lowest-id action among its resources' list heads that is ready, issues it (an eager layer's
kernels are launched while its handler runs) and loops; with nothing ready it sleeps IDLE_SLEEP_S. An
action is ready when
- each predecessor on another of the rank's resources (`tinypipe.ir.order.predecessors`) is available: a
  device action once the host issued it (its stream waits for the rest), a host OPT_STEP once it has
  finished on the optimizer thread (the loop polls its future);
- a LOAD: the device has run the EVICTs it waits for (the loop polls their end markers);
- a RECV: no FWD / BWD listed before it is still to be issued (the RECV gate);
- a FWD / BWD: fewer than RUNAHEAD_COMPUTE FWD / BWD are issued and not yet finished on the device.
The simulator replays this loop (sim/issuer.py) to start each device action no earlier than its issue.
Predecessors outside the rank are taken as met, as the backend does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tinypipe.ir.kinds import Kind
from tinypipe.ir.order import predecessors
from tinypipe.ir.schedule import Action

# FWD / BWD the host may have issued beyond the oldest one the device has not finished. Each is
# milliseconds of GPU work and under a millisecond of issuing, so 2 keeps the device fed.
RUNAHEAD_COMPUTE = 2
# The loop's pause when nothing can be issued. The host optimizer's compact step is hundreds of
# torch calls per layer, each taking the GIL back; with a 50 us poll here the step measured ~95 ms
# per 8B block in the steady state on an H200 host, where the fused-AdamW rate x 1.69
# predicts ~62 ms. A longer pause leaves the GIL free; 0.5 ms is far below a layer's GPU work.
IDLE_SLEEP_S = 5e-4


@dataclass(frozen=True)
class IssueRules:
    """What one rank's loop issues and waits for (module docstring); ids are the schedule's."""

    queues: tuple[tuple[int, ...], ...]  # per resource of the rank, its action ids in list order
    needs: dict[int, tuple[int, ...]]  # id -> predecessors on the rank's other resources
    evicts: dict[int, tuple[int, ...]]  # LOAD id -> the EVICTs among its needs


def issue_rules(actions: Sequence[Action]) -> IssueRules:
    """The rules for the loop that issues `actions` (one rank's, in schedule order)."""
    by_id = {a.id: a for a in actions}
    queues: dict[str, list[int]] = {}
    for a in actions:
        queues.setdefault(a.resource, []).append(a.id)
    before = predecessors(actions)
    needs = {a.id: tuple(d for d in before[a.id] if d in by_id and by_id[d].resource != a.resource)
             for a in actions}
    evicts = {a.id: tuple(d for d in needs[a.id] if by_id[d].kind == Kind.EVICT) for a in actions
              if a.kind == Kind.LOAD}
    return IssueRules(tuple(tuple(q) for q in queues.values()), needs, evicts)
