"""Memory ledgers per device (`g0`, ..., `host`): allocations at action start, frees at action end, peaks.

Each ledger holds the static bytes of its device from time 0, applies an action's `allocs` when the
action starts and its `frees` when it ends, records every change as a (time, bytes) sample and keeps
the peak. When an allocation would exceed the device's capacity it raises `CapacityError` naming the
device, the action, the bytes needed and the bytes free — or, when asked to record, notes the first
violation and carries on so that a search can still compare candidates that do not fit.
"""

from __future__ import annotations

from collections.abc import Mapping

from tinypipe.errors import CapacityError, ScheduleError
from tinypipe.hardware import HOST
from tinypipe.schedule import Action


def capacity_message(device: str, action: Action, needed: int, free: int, capacity: int,
                     buffers: list[str], t_s: float) -> str:
    """The one-line error for an allocation that does not fit."""
    what = ", ".join(buffers)
    hint = ("lower the prefetch depth or microbatch size, swap layer by layer, or use more GPUs"
            if device != HOST else "use the compact host layout if not in use, or a host with more memory")
    return (f"{device} out of memory at `{action}` (action {action.id}, t={t_s:.6f} s): needs {needed:,} bytes "
            f"({what}), only {free:,} of {capacity:,} bytes free; {hint}")


class Ledger:
    """Bytes in use on one device over time."""

    __slots__ = ("device", "capacity_bytes", "used_bytes", "peak_bytes", "samples")

    def __init__(self, device: str, capacity_bytes: int, static_bytes: int = 0) -> None:
        self.device = device
        self.capacity_bytes = capacity_bytes
        self.used_bytes = static_bytes
        self.peak_bytes = static_bytes
        self.samples: list[tuple[float, int]] = [(0.0, static_bytes)]


class Memory:
    """All ledgers of one simulation. `on_capacity`: "raise" (CapacityError) or "record" (first violation).

    `capacity_bytes` per device is what the run may use: the hardware's memory, or a limit the
    caller sets in its place (e.g. 24 GiB of an 80 GiB card).
    """

    def __init__(self, capacity_bytes: Mapping[str, int], static_bytes: Mapping[str, int], *,
                 on_capacity: str = "raise") -> None:
        if on_capacity not in ("raise", "record"):
            raise ValueError(f"on_capacity must be 'raise' or 'record', got {on_capacity!r}")
        self.ledgers = {d: Ledger(d, c, static_bytes.get(d, 0)) for d, c in capacity_bytes.items()}
        self.on_capacity = on_capacity
        self.violation: str | None = None
        for d, led in self.ledgers.items():
            if led.used_bytes > led.capacity_bytes:
                msg = (f"{d} out of memory before the first action: static {led.used_bytes:,} bytes exceed "
                       f"the capacity of {led.capacity_bytes:,} bytes; use a device with more memory, or a "
                       "layout that holds less (the compact host layout, if not in use)")
                self._violate(msg)

    def _violate(self, message: str) -> None:
        if self.on_capacity == "raise":
            raise CapacityError(message)
        if self.violation is None:
            self.violation = message

    def alloc(self, action: Action, t_s: float) -> None:
        """Apply `action.allocs` at its start (time `t_s`)."""
        allocs = action.allocs
        if len(allocs) == 1:
            m = allocs[0]
            self._take(m.device, m.nbytes, action, t_s, (m.buffer,))
            return
        per: dict[str, int] = {}
        names: dict[str, list[str]] = {}
        for m in allocs:
            per[m.device] = per.get(m.device, 0) + m.nbytes
            names.setdefault(m.device, []).append(m.buffer)
        for dev, n in per.items():
            self._take(dev, n, action, t_s, tuple(names[dev]))

    def _take(self, device: str, nbytes: int, action: Action, t_s: float, buffers: tuple[str, ...]) -> None:
        led = self.ledgers.get(device)
        if led is None:
            raise ScheduleError(f"`{action}` (action {action.id}) allocates on unknown device {device!r}; "
                                f"devices: {', '.join(self.ledgers)}")
        used = led.used_bytes + nbytes
        if used > led.capacity_bytes and nbytes > 0 and self.violation is None:  # only the first is kept
            free = led.capacity_bytes - led.used_bytes
            self._violate(capacity_message(device, action, nbytes, free, led.capacity_bytes, list(buffers), t_s))
        led.used_bytes = used
        if used > led.peak_bytes:
            led.peak_bytes = used
        led.samples.append((t_s, used))

    def free(self, action: Action, t_s: float) -> None:
        """Apply `action.frees` at its end (time `t_s`)."""
        ledgers = self.ledgers
        for m in action.frees:
            led = ledgers.get(m.device)
            if led is None:
                raise ScheduleError(f"`{action}` (action {action.id}) frees on unknown device {m.device!r}; "
                                    f"devices: {', '.join(ledgers)}")
            led.used_bytes -= m.nbytes
            led.samples.append((t_s, led.used_bytes))

    def peaks(self) -> dict[str, int]:
        return {d: led.peak_bytes for d, led in self.ledgers.items()}

    def samples(self) -> dict[str, tuple[tuple[float, int], ...]]:
        return {d: tuple(led.samples) for d, led in self.ledgers.items()}
