"""This host's memory bandwidth (GB/s moved: bytes read + bytes written), printed by every device script.

Host speed differs between machines of one kind, and the host optimizer is memory-bandwidth bound, so each
device run records the bandwidth of the machine it ran on: compare systems only within one machine. Two
measurements of `tinypipe.backends.profile.rates`: a memcpy (`host_copy_gbps`, whose
writes also read each line first, uncounted) and an in-place pass as the optimizer's kernel moves bytes
(`host_mem_gbps`, what a run's calibration gives the simulator).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tinypipe.backends.profile.rates import host_copy_gbps, host_mem_gbps


def copy_gbps(nbytes: int = 2 << 30, repeat: int = 5, threads: int | None = None) -> float:
    """`host_copy_gbps` of `nbytes` on `threads` threads (default: all cores)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    return host_copy_gbps(nbytes, repeat)


def mem_gbps(nbytes: int = 2 << 30, repeat: int = 3, threads: int | None = None) -> float:
    """`host_mem_gbps` of `nbytes` on `threads` threads (default: all cores)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    return host_mem_gbps(nbytes, repeat)


if __name__ == "__main__":
    got = {"host_copy_gbps": round(copy_gbps(), 1), "host_mem_gbps": round(mem_gbps(), 1), "threads": os.cpu_count(),
           "host_copy_gbps_1_thread": round(copy_gbps(threads=1), 1)}
    print("host copy bandwidth:", json.dumps(got))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(got, f)
