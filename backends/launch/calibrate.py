"""`tinypipe run`'s launch-time calibration: this machine's host rates, measured in seconds now or read from the cache.

Before planning, the run measures what varies between machines of one kind and moves its plan the most
(`tinypipe.estimate.hostcal`): the host optimizer's step rate under each layout at the run's thread
count, and the copy rates (`profile.rates.measure_rates`, with a small budget); the schedule is planned
and predicted with them. `--calibrate`:
- `auto` (default): on CUDA, this machine's cached rates when younger than `hostcal.MAX_AGE_S`, else
  measured now and cached; on the CPU backend the rates `prepare.cpu_hardware` measured at start-up
  (GEMM, copies, AdamW) as they are: the small budget's layout rates swung 10x between two calls on a
  loaded 2-core machine (compact step 0.55 and 6.9 M params/s) and put the default job's prediction
  at 6x its measurement, where without them it was within 10%;
- `now`: measured now (and cached on CUDA; on the CPU backend, never cached);
- `off`: the hardware description and traces as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tinypipe.describe.hardware import Hardware
from tinypipe.describe.trace import ProfileTrace
from tinypipe.estimate.hostcal import cache_file, calibrate, read_cached, write_cache

# (copy bytes, optimizer parameters, repeats): a few seconds on an H200 host, about two on 2 CPU cores. 64M
# parameters put the compact step's working set (planes, moments, gradient: 14 B a parameter, 0.9 GB) well past
# the last-level cache (up to ~300 MiB on these hosts), as a run's steps are.
CUDA_BUDGET = (64 << 20, 1 << 26, 3)
CPU_BUDGET = (4 << 20, 1 << 16, 3)


def measure_now(backend: str, *, threads: int, dtype: str) -> dict[str, Any]:
    """This machine's host rates measured now, as a rates.json object with `measured_unix_s`."""
    import torch

    from ..profile.rates import measure_rates

    copy_bytes, params, repeat = CUDA_BUDGET if backend == "cuda" else CPU_BUDGET
    device = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    rates = measure_rates(device, threads=threads, compute_dtype=dtype, repeat=repeat, copy_bytes=copy_bytes,
                          optim_params=params, when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return {**rates.to_json(), "measured_unix_s": time.time()}


def calibrate_run(mode: str, backend: str, hardware: Hardware, profiles: tuple[ProfileTrace, ...], *,
                  threads: int, dtype: str, say: Callable[[str], None] = lambda text: None
                  ) -> tuple[Hardware, tuple[ProfileTrace, ...], str | None]:
    """The hardware and profiles to plan with under `--calibrate mode`, and the summary's line (None: off)."""
    if mode == "off":
        return hardware, profiles, None
    if mode == "auto" and backend == "cpu":
        return hardware, profiles, f"at start-up (the CPU backend's own measurement): {hardware.source}"
    path = cache_file(backend, threads, dtype)
    rates = read_cached(path) if (mode == "auto" and backend == "cuda") else None
    how = f"cached {path} ({rates.get('when', '?')})" if rates is not None else "measured now"
    if rates is None:
        say(f"calibrating: this host's optimizer and copy rates on {threads} thread(s)")
        rates = measure_now(backend, threads=threads, dtype=dtype)
        if backend == "cuda":
            write_cache(path, rates)
    planned, calibrated, line = calibrate(hardware, rates, profiles)
    return planned, calibrated, f"{how}: {line}"


def calibration_lines(plan: Any) -> list[str]:
    """The summary's lines saying which figures the plan took from this machine, and when, and what stepped the
    host optimizer (the one-pass kernel, or the torch operators and why)."""
    from ..host import fused_host_adamw

    text = getattr(plan, "calibration", None)
    why = fused_host_adamw.unavailable()
    kernel = ("host      optimizer step: the one-pass kernel (backends/host/fused_host_adamw.c)" if why is None else
              f"host      optimizer step: the torch operators, 2-5x slower than the one-pass kernel, which is not "
              f"used here ({why})")
    return [f"calibrated {text}" if text else "calibrated no (--calibrate off): the hardware description's rates",
            kernel]
