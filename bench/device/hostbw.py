"""This host's memory copy bandwidth (GB/s moved: bytes read + bytes written), printed by every device script.

Host speed differs between machines of one kind, and the host optimizer is memory-bandwidth bound, so each
device run records the bandwidth of the machine it ran on: compare systems only within one machine.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def copy_gbps(nbytes: int = 2 << 30, repeat: int = 5, threads: int | None = None) -> float:
    """Median GB/s of `dst.copy_(src)` over `nbytes` of float32 on `threads` threads (default: all cores)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[len(times) // 2] / 1e9


if __name__ == "__main__":
    got = {"host_copy_gbps": round(copy_gbps(), 1), "threads": os.cpu_count(),
           "host_copy_gbps_1_thread": round(copy_gbps(threads=1), 1)}
    print("host copy bandwidth:", json.dumps(got))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(got, f)
