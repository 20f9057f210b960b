"""The simulator's memory: one `tinypipe.ir.ledger.Ledger` for all devices, checked against capacities.

The ledger holds each device's static bytes from time 0, applies an action's `allocs` when the
action starts and its `frees` when it ends, and keeps the peaks and a (time, bytes) sample per
change. What is the simulator's own: when an allocation exceeds the device's capacity it raises
`CapacityError` naming the device, the action, the bytes needed and the bytes free — or, when asked
to record, notes the first violation and carries on so that a search can still compare candidates
that do not fit.
"""

from __future__ import annotations

from collections.abc import Mapping

from tinypipe.common.errors import CapacityError
from tinypipe.describe.hardware import HOST
from tinypipe.ir.ledger import Ledger
from tinypipe.ir.schedule import Action


def capacity_message(device: str, action: Action, needed: int, free: int, capacity: int,
                     buffers: list[str], t_s: float) -> str:
    """The one-line error for an allocation that does not fit."""
    what = ", ".join(buffers)
    hint = ("lower the prefetch depth or microbatch size, swap layer by layer, or use more GPUs"
            if device != HOST else "use the compact host memory layout if not in use, or a host with more memory")
    return (f"{device} out of memory at `{action}` (action {action.id}, t={t_s:.6f} s): needs {needed:,} bytes "
            f"({what}), only {free:,} of {capacity:,} bytes free; {hint}")


class Memory:
    """All devices of one simulation. `on_capacity`: "raise" (CapacityError) or "record" (first violation).

    `capacity_bytes` per device is what the run may use: the hardware's memory, or a limit the
    caller sets in its place (e.g. 24 GiB of an 80 GiB card).
    """

    def __init__(self, capacity_bytes: Mapping[str, int], static_bytes: Mapping[str, int], *,
                 on_capacity: str = "raise") -> None:
        if on_capacity not in ("raise", "record"):
            raise ValueError(f"on_capacity must be 'raise' or 'record', got {on_capacity!r}")
        self.capacity_bytes = dict(capacity_bytes)
        self.ledger = Ledger(static_bytes, devices=self.capacity_bytes, samples=True)
        self.on_capacity = on_capacity
        self.violation: str | None = None
        for d, used in self.ledger.used_bytes.items():
            if used > self.capacity_bytes[d]:
                msg = (f"{d} out of memory before the first action: static {used:,} bytes exceed "
                       f"the capacity of {self.capacity_bytes[d]:,} bytes; use a device with more memory, or a "
                       "layout that holds less (the compact host memory layout, if not in use)")
                self._violate(msg)

    def _violate(self, message: str) -> None:
        if self.on_capacity == "raise":
            raise CapacityError(message)
        if self.violation is None:
            self.violation = message

    def alloc(self, action: Action, t_s: float) -> None:
        """Apply `action.allocs` at its start (time `t_s`); check the capacities it allocates on."""
        self.ledger.start(action, t_s)
        if self.violation is not None:  # only the first violation is kept
            return
        used, cap = self.ledger.used_bytes, self.capacity_bytes
        for m in action.allocs:
            if used[m.device] > cap[m.device]:
                self._over(action, m.device, t_s)
                return

    def _over(self, action: Action, device: str, t_s: float) -> None:
        mine = [m for m in action.allocs if m.device == device]
        needed = sum(m.nbytes for m in mine)
        if needed <= 0:
            return
        used, cap = self.ledger.used_bytes[device], self.capacity_bytes[device]
        self._violate(capacity_message(device, action, needed, cap - (used - needed), cap,
                                       [m.buffer for m in mine], t_s))

    def free(self, action: Action, t_s: float) -> None:
        """Apply `action.frees` at its end (time `t_s`)."""
        self.ledger.end(action, t_s)

    def peaks(self) -> dict[str, int]:
        return self.ledger.peaks()

    def samples(self) -> dict[str, tuple[tuple[float, int], ...]]:
        assert self.ledger.samples is not None  # kept: built with samples=True
        return {d: tuple(s) for d, s in self.ledger.samples.items()}
