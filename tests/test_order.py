"""Execution order: what each action waits for, and which SEND pairs with which RECV (tinypipe/ir/order.py)."""

from __future__ import annotations

import pytest

from tinypipe.ir.kinds import Kind
from tinypipe.ir.order import UnpairedError, pair_halves, predecessors
from tinypipe.ir.schedule import Action


def acts() -> list[Action]:
    """g0 runs FWD L0 m0, m1 and sends both inputs of L1 to g1; g1 receives them, then sends one gradient back."""
    return [
        Action(0, Kind.FWD, "g0.compute", 0, microbatch=0),
        Action(1, Kind.SEND_F, "g0.send", 1, microbatch=0, peer=1, deps=(0,)),
        Action(2, Kind.FWD, "g0.compute", 0, microbatch=1),
        Action(3, Kind.SEND_F, "g0.send", 1, microbatch=1, peer=1, deps=(2,)),
        Action(4, Kind.RECV_F, "g1.recv", 1, microbatch=0, peer=0),
        Action(5, Kind.RECV_F, "g1.recv", 1, microbatch=1, peer=0),
        Action(6, Kind.FWD, "g1.compute", 1, microbatch=0, deps=(4,)),
        Action(7, Kind.SEND_B, "g1.send", 1, microbatch=0, peer=0, deps=(6,)),
        Action(8, Kind.RECV_B, "g0.recv", 1, microbatch=0, peer=1),
    ]


def test_pairs_match_in_list_order_per_direction_of_travel() -> None:
    """The k-th SEND from g to h pairs with the k-th RECV on h from g; the backward pair goes the other way."""
    assert pair_halves(acts()) == {1: 4, 4: 1, 3: 5, 5: 3, 7: 8, 8: 7}


def test_an_unpaired_half_names_itself_and_the_counts() -> None:
    """A SEND whose RECV is missing: the SEND left over is named, with both counts."""
    with pytest.raises(UnpairedError, match=r"^unpaired SEND: action 3 \(g0.send SEND_F L1 m1 >g1\) has no matching "
                                            r"RECV on g1 \(g0 -> g1: 2 SEND but 1 RECV\)$") as info:
        pair_halves([a for a in acts() if a.id != 5])
    assert info.value.action == 3


def test_predecessors_stream_then_deps_and_the_other_half() -> None:
    """Own predecessors: the previous action on the resource, then the deps. With the pairs, a half also
    waits for its other half's predecessors (the copy needs both ready), never for the other half itself."""
    a = acts()
    own = predecessors(a)
    assert dict(own) == {0: (), 1: (0,), 2: (0,), 3: (1, 2), 4: (), 5: (4,), 6: (4,), 7: (6,), 8: ()}
    joint = predecessors(a, partner=pair_halves(a))
    assert joint[4] == (0,) and joint[1] == (0,)
    assert joint[5] == (4, 1, 2) and joint[3] == (1, 2, 4)
    assert joint[8] == (6,) and joint[6] == (4,)


def test_lanes_replace_the_resources_lists() -> None:
    """With lanes (replay's), the previous action is the previous one on the lane, not on the resource."""
    a = acts()
    p = predecessors(a, lanes={"g0.thread": (2, 0), "g0.send": (1, 3)})
    assert p[0] == (2,) and p[2] == () and p[3] == (1, 2)
