"""Python's cyclic garbage collector held off while a phase builds tens of thousands of objects that live on.

Compiling a schedule and simulating it allocate an object or more per action (ops, actions, memory
effects, SimPy events, records) and keep most of them, so the collector runs its generations over and
over on objects that are not garbage: about a fifth of `tinypipe simulate`'s time (70B on 8 RTX 4090,
32 microbatches) before it was held off. Neither phase leaves more than a few hundred objects in
reference cycles (ops point at earlier ops only), so little waits to be freed; the collector's state is
restored on the way out.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector disabled within, re-enabled after if it was enabled before (nesting is fine)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
