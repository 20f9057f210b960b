"""The memory ledger: bytes in use per device under a schedule's memory effects, and their peaks.

One type for the simulator (`sim/memory.py`, which adds capacities and times) and the real backend
(`backends/rank/executor.py`, which applies the effects as it issues and finishes actions): each device
starts at its static bytes (`Schedule.static_bytes`), an action's `allocs` apply when it starts and
its `frees` when it ends (docs/schedule-contract.md), and the peak per device is kept. So the same
effects applied in the same order give the same peaks wherever they are applied.

Optionally a ledger also keeps (time, bytes) samples after every change, and the live buffers by
name, noting an allocation of a buffer that is already live or a free of one that is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tinypipe.common.errors import ScheduleError
from tinypipe.ir.schedule import Action


class Ledger:
    """Bytes in use per device. `devices`: the only devices effects may name (None: any, from 0 bytes).

    `samples`: keep a (t_s, bytes) sample per device after each change (an action's allocations on
    one device count as one change, each free as one). `buffers`: track live buffers and note
    double allocations and frees of buffers that are not live in `problems`.
    """

    __slots__ = ("used_bytes", "peak_bytes", "samples", "live", "problems", "_closed")

    def __init__(self, static_bytes: Mapping[str, int] | Iterable[tuple[str, int]] = (), *,
                 devices: Iterable[str] | None = None, samples: bool = False, buffers: bool = False) -> None:
        static = dict(static_bytes)
        names = list(devices) if devices is not None else list(static)
        self._closed = devices is not None
        self.used_bytes: dict[str, int] = {d: static.get(d, 0) for d in names}
        self.peak_bytes: dict[str, int] = dict(self.used_bytes)
        self.samples: dict[str, list[tuple[float, int]]] | None = (
            {d: [(0.0, b)] for d, b in self.used_bytes.items()} if samples else None)
        self.live: dict[tuple[str, str], int] | None = {} if buffers else None
        self.problems: list[str] = []

    def _device(self, device: str, action: Action, verb: str) -> None:
        """Make `device` known (open ledgers) or refuse it (closed ones)."""
        if self._closed:
            raise ScheduleError(f"`{action}` (action {action.id}) {verb} on unknown device {device!r}; "
                                f"devices: {', '.join(self.used_bytes)}")
        self.used_bytes[device] = self.peak_bytes[device] = 0
        if self.samples is not None:
            self.samples[device] = [(0.0, 0)]

    def start(self, action: Action, t_s: float = 0.0) -> None:
        """Apply `action.allocs`, at its start (time `t_s`)."""
        allocs = action.allocs
        if not allocs:
            return
        used, peak, samples = self.used_bytes, self.peak_bytes, self.samples
        if len(allocs) == 1:  # the common case, kept cheap: the simulator calls this for every action
            m = allocs[0]
            dev = m.device
            if dev not in used:
                self._device(dev, action, "allocates")
            u = used[dev] = used[dev] + m.nbytes
            if u > peak[dev]:
                peak[dev] = u
            if samples is not None:
                samples[dev].append((t_s, u))
        else:
            per: dict[str, int] = {}
            for m in allocs:
                per[m.device] = per.get(m.device, 0) + m.nbytes
            for dev, n in per.items():
                if dev not in used:
                    self._device(dev, action, "allocates")
                u = used[dev] = used[dev] + n
                if u > peak[dev]:
                    peak[dev] = u
                if samples is not None:
                    samples[dev].append((t_s, u))
        if self.live is not None:
            for m in allocs:
                key = (m.device, m.buffer)
                if key in self.live:
                    self.problems.append(f"action {action.id} allocates {m.device}:{m.buffer}, which is already live")
                self.live[key] = m.nbytes

    def end(self, action: Action, t_s: float = 0.0) -> None:
        """Apply `action.frees`, at its end (time `t_s`)."""
        used, samples, live = self.used_bytes, self.samples, self.live
        for m in action.frees:
            dev = m.device
            if dev not in used:
                self._device(dev, action, "frees")
            u = used[dev] = used[dev] - m.nbytes
            if samples is not None:
                samples[dev].append((t_s, u))
            if live is not None and live.pop((dev, m.buffer), None) is None:
                self.problems.append(f"action {action.id} frees {dev}:{m.buffer}, which is not live")

    def peaks(self) -> dict[str, int]:
        return dict(self.peak_bytes)

