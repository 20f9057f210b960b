"""`tinypipe run`'s options for the machine it runs on: the host memory it may take (and, with them, calibration)."""

from __future__ import annotations

import argparse

import tinypipe.cli.flags as flags


def add_machine_arguments(p: argparse.ArgumentParser) -> None:
    """Register the options on `p` (run's subparser); none is recorded in a checkpoint."""
    flags.add_host_mem(p, "host memory the run may take, e.g. 100GiB: a policy whose predicted host peak exceeds "
                          "it is refused before training (default: this machine's MemAvailable or its cgroup's memory "
                          "limit, whichever is smaller, and no more than the hardware description's)", metavar="BYTES")
    p.add_argument("--calibrate", choices=("auto", "now", "off"), default=None,
                   help="before planning, measure this host's optimizer step and copy rates (a few seconds) and "
                        "plan and predict with them: auto (default) reuses this machine's cached rates younger than "
                        "6 h on CUDA (~/.cache/tinypipe, $TINYPIPE_CACHE), now measures again, off takes the "
                        "hardware description's rates")
