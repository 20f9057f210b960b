"""The executor's issue-loop rules as data (tinypipe/ir/issueloop.py): what a rank issues, what each waits for."""

from __future__ import annotations

from tinypipe.ir.issueloop import issue_rules
from tinypipe.ir.schedule import Action, Kind, Schedule, rank_actions


def _schedule() -> Schedule:
    a = [Action(0, Kind.LOAD, "g0.h2d", 0),
         Action(1, Kind.FWD, "g0.compute", 0, microbatch=0, deps=(0,)),
         Action(2, Kind.EVICT, "g0.compute", 0, deps=(1,)),
         Action(3, Kind.LOAD, "g0.h2d", 1, deps=(2,)),
         Action(4, Kind.FWD, "g0.compute", 1, microbatch=0, deps=(3,)),
         Action(5, Kind.GRAD_OUT, "g0.d2h", 1, deps=(4,)),
         Action(6, Kind.OPT_STEP, "host.optim", 1, deps=(5,)),
         Action(7, Kind.OPT_STEP, "host.optim", 2),
         Action(8, Kind.FWD, "g1.compute", 2, microbatch=0)]
    return Schedule(tuple(a), num_gpus=2, num_layers=3, iterations=1, microbatches=1, tokens_per_microbatch=16,
                    recompute=True, pack_layers=((0,), (1,), (2,)), pack_gpu=(0, 0, 1), host_memory="replicated")


def test_a_rank_issues_its_gpus_actions_and_its_layers_steps() -> None:
    """Rank 0 issues g0's actions and the OPT_STEP of layer 1 (its pack); rank 1 g1's and layer 2's step."""
    s = _schedule()
    assert [a.id for a in rank_actions(s, 0)] == [0, 1, 2, 3, 4, 5, 6]
    assert [a.id for a in rank_actions(s, 1)] == [7, 8]


def test_rules_list_the_queues_the_cross_resource_needs_and_a_loads_evicts() -> None:
    """Queues per resource in list order; `needs` only the predecessors on the rank's other resources (the
    list order covers its own: FWD L1 needs LOAD L1, not EVICT L0 before it on compute); a LOAD's EVICTs."""
    r = issue_rules(rank_actions(_schedule(), 0))
    assert r.queues == ((0, 3), (1, 2, 4), (5,), (6,))
    assert r.needs == {0: (), 1: (0,), 2: (), 3: (2,), 4: (3,), 5: (4,), 6: (5,)}
    assert r.evicts == {0: (), 3: (2,)}
