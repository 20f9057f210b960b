"""The schedule IR: actions print short, text round-trips exactly, the grid marks a cell."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinypipe.common.errors import InputError
from tinypipe.ir.schedule import Action, Kind, Mem, Schedule, grid, parse_action


def _sched(actions: tuple[Action, ...]) -> Schedule:
    return Schedule(actions=actions, num_gpus=2, num_layers=4, iterations=1, microbatches=2,
                    tokens_per_microbatch=16, recompute=True, pack_layers=((0, 1), (2, 3)), pack_gpu=(0, 1),
                    static_bytes=(("host", 1000),), meta=(("model", "tiny"),))


def test_short_strings() -> None:
    """Actions print like PyTorch pipelining's: resource, kind, layer, microbatch, peer."""
    assert str(Action(0, Kind.LOAD, "g1.h2d", layer=12)) == "g1.h2d LOAD L12"
    assert str(Action(0, Kind.FWD, "g0.compute", layer=3, microbatch=2)) == "g0.compute FWD L3 m2"
    assert str(Action(0, Kind.SEND_F, "g0.send", layer=3, microbatch=0, peer=1)) == "g0.send SEND_F L3 m0 >g1"


def test_text_round_trip_literal() -> None:
    """One action's full text form is fixed and parses back to an equal Action."""
    a = Action(7, Kind.BWD, "g1.compute", layer=3, pack=1, microbatch=1, iteration=2, nbytes=0, deps=(3, 5),
               allocs=(Mem("g1", "dx.L3.m1", 64),), frees=(Mem("g1", "x.L3.m1", 64), Mem("g1", "ws", 8)))
    assert a.text() == "7 g1.compute BWD L3 P1 m1 i2 deps=3,5 +g1:dx.L3.m1=64 -g1:x.L3.m1=64 -g1:ws=8"
    assert parse_action(a.text()) == a


kinds = st.sampled_from(list(Kind))
opt_int = st.none() | st.integers(0, 1000)
buffers = st.from_regex(r"[a-z]\.L[0-9]{1,2}", fullmatch=True)
mems = st.lists(st.builds(Mem, st.sampled_from(["g0", "g1", "host"]), buffers, st.integers(0, 10**12)),
                max_size=3).map(tuple)


@given(st.lists(st.tuples(kinds, st.sampled_from(["g0.compute", "g1.recv", "host.optim"]), st.integers(0, 1000),
                          opt_int, opt_int, st.integers(0, 5), st.integers(0, 10**10), st.none() | st.integers(0, 7),
                          st.lists(st.integers(0, 50), max_size=3).map(tuple), mems, mems), max_size=20))
def test_dumps_loads_identity(rows: list) -> None:
    """Any schedule dumps to text and loads back equal."""
    acts = tuple(Action(i, *r) for i, r in enumerate(rows))
    s = _sched(acts)
    assert Schedule.loads(s.dumps()) == s


def test_bad_text_is_input_error() -> None:
    """A malformed line is an InputError naming the line."""
    with pytest.raises(InputError, match="line 7"):
        Schedule.loads("# gpus=1\n" * 6 + "0 g0.compute FLY L1\n")


def test_action_without_layer_is_input_error() -> None:
    """Every action names its layer: a line without `L<n>` is refused, naming the line."""
    with pytest.raises(InputError, match="line 7: action without a layer"):
        Schedule.loads("# gpus=1\n" * 6 + "0 g0.compute FWD m0 i0\n")


def test_grid_marks_the_failing_cell() -> None:
    """The grid lists each resource's actions by step and marks one with >> <<."""
    acts = (Action(0, Kind.LOAD, "g0.h2d", layer=0), Action(1, Kind.FWD, "g0.compute", layer=0, microbatch=0),
            Action(2, Kind.FWD, "g0.compute", layer=1, microbatch=0))
    assert grid(_sched(acts), mark=2) == (
        "step  g0.compute  g0.h2d\n"
        "0     F0.0        LD0\n"
        "1     >>F1.0<<"
    )


def test_recompute_spares_the_head() -> None:
    """Under recompute every layer's backward re-runs its forward except the head's (the last layer),
    which keeps its small graph; without recompute none does."""
    from tinypipe.ir.schedule import recomputes

    assert [recomputes(True, i, 4) for i in range(4)] == [True, True, True, False]
    assert not any(recomputes(False, i, 4) for i in range(4))
