"""The kind table: one row per kind, read by every part; a transfer half always names its direction."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinypipe.cli.plot import KIND_COLORS
from tinypipe.common.errors import InputError
from tinypipe.ir.kinds import GPU_STREAMS, KIND_STREAM, KINDS, Carries, Cost, Direction, Kind, recorded_as
from tinypipe.ir.schedule import parse_action

GOLDEN = Path(__file__).parent / "golden"


def test_every_kind_has_one_row() -> None:
    """Each Kind has a row, and `kind.info` is that row; streams are a GPU's or the host optimizer's."""
    assert list(KINDS) == list(Kind)
    for k, info in KINDS.items():
        assert k.info is info
        assert info.stream in (*GPU_STREAMS, "optim")
        assert KIND_STREAM[k] == info.stream
        assert KIND_COLORS[k.value] == info.colour


def test_the_table_literally() -> None:
    """What each kind means, as the contract's table says (docs/schedule-contract.md)."""
    rows = {k.value: (i.stream, i.direction.value, i.carries.value, i.cost.value, i.label) for k, i in KINDS.items()}
    assert rows == {
        "LOAD": ("h2d", "none", "weights", "upload", "LD"),
        "EVICT": ("compute", "none", "weights", "free", "EV"),
        "FWD": ("compute", "forward", "none", "compute", "F"),
        "BWD": ("compute", "backward", "none", "compute", "B"),
        "SEND_F": ("send", "forward", "activation", "peer", "S"),
        "SEND_B": ("send", "backward", "gradient", "peer", "S"),
        "RECV_F": ("recv", "forward", "activation", "peer", "R"),
        "RECV_B": ("recv", "backward", "gradient", "peer", "R"),
        "OFFLOAD_ACT": ("d2h", "forward", "activation", "download", "OA"),
        "FETCH_ACT": ("h2d", "backward", "activation", "upload", "FA"),
        "GRAD_OUT": ("d2h", "backward", "gradient", "download", "GO"),
        "OPT_STEP": ("optim", "none", "none", "optimizer", "OPT"),
        "ADAPT_STEP": ("compute", "none", "none", "device_optimizer", "AS"),
    }


def test_transfer_direction_is_in_the_kind() -> None:
    """A half's kind says whether it carries an activation forward or a gradient backward."""
    assert {k for k in Kind if k.info.is_half} == {Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B}
    for k in (Kind.SEND_F, Kind.RECV_F):
        assert (k.info.direction, k.info.carries) == (Direction.FORWARD, Carries.ACTIVATION)
    for k in (Kind.SEND_B, Kind.RECV_B):
        assert (k.info.direction, k.info.carries) == (Direction.BACKWARD, Carries.GRADIENT)
    assert {k for k in Kind if k.info.cost is Cost.COMPUTE} == {Kind.FWD, Kind.BWD}


def test_a_half_without_its_direction_is_an_input_error() -> None:
    """A transfer half names its direction in its kind (SEND_F / SEND_B, RECV_F / RECV_B): a bare SEND or
    RECV is a one-line error naming where, never read as either direction."""
    with pytest.raises(InputError, match=r"line 3: bad action id or kind"):
        parse_action("4 g0.send SEND L2 m0 i0 B=128 >g1 -g0:dx.L2.m0=128", "line 3")


def test_a_record_matches_only_its_own_kind() -> None:
    """A trace record names its kind exactly as the schedule does."""
    assert recorded_as("SEND_F", Kind.SEND_F) and not recorded_as("SEND_F", Kind.SEND_B)
    assert not recorded_as("SEND", Kind.SEND_F) and not recorded_as("FWD", Kind.BWD)
