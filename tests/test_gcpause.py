"""The cyclic garbage collector is held off within `collector_paused` and left as it was after."""

from __future__ import annotations

import gc

from tinypipe.common.gcpause import collector_paused


def test_the_collector_is_off_within_and_as_before_after() -> None:
    """Enabled before: off within, on after (an inner pause leaves it off); disabled before: stays off."""
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
