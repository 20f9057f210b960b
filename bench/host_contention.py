"""What slows the host optimizer step inside a run: the same OPT_STEP timed beside each kind of work
that a run's main thread does, at two GIL switch intervals and two thread counts.

    python bench/host_contention.py [--layers 28] [--hidden 2048] [--intermediate 6144] [--steps 6]
                                    [--threads 15 8] [--switch 0.005 0.0002] [--out host_contention.json]

The host state is a run's (`hostlayouts.make_host_state`, compact, bf16 gradients, pinned on CUDA, with
the async optimizer's snapshot regions) of `--layers` layers shaped like one transformer block (Qwen3-1.7B's
by default: about 50M parameters each). Each cell is the median of `--steps` timed `HostState.step`s on a
`HostWorker` thread, as an OPT_STEP runs, with the gradients delivered before each (not timed):

  layers   one: the same layer every step (what `tinypipe profile` times); cycle: the layers in turn
           (a run's steps: its whole host state, not one layer's, passes through the caches)
  mode     sync: `step(keep_previous=False)`; async: `keep_previous=True` (copies the snapshot first)
  beside   none: the main thread waits; python: a thread runs pure Python (holds the GIL but for the
           interpreter's switches); issue: a thread calls small torch ops back to back (an eager run's
           issuing thread; on the GPU when there is one); poll: the executor's idle loop (a little
           Python, then `time.sleep(5e-4)`); h2d (CUDA only): a thread copies 256 MiB pinned -> GPU
           in a loop (the copy engines read host memory)
  switch   `sys.setswitchinterval` during the cell
  threads  `torch.set_num_threads` during the cell

Prints one table (ms per step, and the ratio to the `none` cell of the same row) and writes
bench/results/<out> with every step's time. Cells run in a fixed order; repeat the script to see the noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _common import write_json
from tinypipe.backends.hostlayouts import make_host_state
from tinypipe.backends.hoststate import AdamWConfig, HostState
from tinypipe.backends.hostwork import HostWorker

BESIDES = ("none", "python", "issue", "poll", "h2d")


def block_shapes(hidden: int, intermediate: int, kv: int) -> dict[str, tuple[int, ...]]:
    """One transformer block's parameters (Llama / Qwen3 names; kv: the key / value projections' rows)."""
    return {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden),
            "gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate),
            "norm1": (hidden,), "norm2": (hidden,)}


@contextmanager
def beside(kind: str, device: torch.device) -> Iterator[None]:
    """Run `kind`'s side work on a thread for the duration of the block."""
    stop = threading.Event()
    body: Callable[[], None]
    if kind == "none":
        yield
        return
    if kind == "python":
        def body() -> None:
            n = 0
            while not stop.is_set():
                for i in range(2000):
                    n += i * i
    elif kind == "issue":
        x = torch.zeros(256, device=device)

        def body() -> None:
            while not stop.is_set():
                for _ in range(200):
                    x.add_(1.0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    elif kind == "poll":
        def body() -> None:
            queues = {f"r{i}": list(range(8)) for i in range(6)}
            while not stop.is_set():
                _ = [q[0] for q in queues.values() if q and q[0] >= 0]
                time.sleep(5e-4)
    elif kind == "h2d":
        src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        dst = torch.empty_like(src, device=device)
        stream = torch.cuda.Stream(device)

        def body() -> None:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    dst.copy_(src, non_blocking=True)
                    stream.synchronize()
    else:
        raise ValueError(f"unknown side work {kind!r}")
    t = threading.Thread(target=body, daemon=True)
    t.start()
    time.sleep(0.02)  # under way before the first step
    try:
        yield
    finally:
        stop.set()
        t.join()


def time_steps(state: HostState, worker: HostWorker, layers: list[int], grads: dict[str, torch.Tensor], *,
               steps: int, keep_previous: bool, budget_s: float = float("inf")) -> list[float]:
    """`steps` timed steps (fewer, at least one, once `budget_s` has passed), layer `layers[k % len(layers)]`
    at the k-th, each after its gradients' delivery."""
    out: list[float] = []
    start = time.perf_counter()
    for k in range(steps):
        if out and time.perf_counter() - start > budget_s:
            break
        layer = layers[k % len(layers)]
        fut = worker.submit(lambda layer=layer: state.receive_grads(layer, grads),
                            lambda layer=layer: state.step(layer, keep_previous=keep_previous))
        t0, t1 = fut.result()
        if keep_previous:
            state.drop_stale(layer)
        out.append(t1 - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--kv", type=int, default=1024, help="rows of the key and value projections")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per cell (after one untimed warm-up per layer)")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default: cores - 1, and half the cores")
    ap.add_argument("--switch", type=float, nargs="+", default=[0.005, 0.0002])
    ap.add_argument("--beside", nargs="+", default=list(BESIDES), choices=BESIDES)
    ap.add_argument("--cell-s", type=float, default=2.0, help="a cell stops timing after this long (at least one step)")
    ap.add_argument("--out", default="host_contention.json")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cores = os.cpu_count() or 1
    threads = a.threads or sorted({max(1, cores - 1), max(1, cores // 2)}, reverse=True)
    besides = [b for b in a.beside if cuda or b != "h2d"]
    shapes = block_shapes(a.hidden, a.intermediate, a.kv)
    t0 = time.perf_counter()
    masters = {i: {n: torch.zeros(s) for n, s in shapes.items()} for i in range(a.layers)}
    state = make_host_state(masters, layout="compact", compute_dtype=torch.bfloat16, optim=AdamWConfig(),
                            pin=cuda, snapshots=True)
    del masters
    grads = {n: torch.full(s, 1e-3, dtype=torch.bfloat16) for n, s in shapes.items()}
    worker = HostWorker(name="contention")
    built_s = time.perf_counter() - t0
    params = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"{a.layers} layers of {params / 1e6:.1f}M parameters, built in {built_s:.1f} s; device {device}; "
          f"threads {threads}; switch intervals {a.switch}")
    time_steps(state, worker, list(range(a.layers)), grads, steps=a.layers, keep_previous=True)  # warm-up
    before_switch, before_threads = sys.getswitchinterval(), torch.get_num_threads()
    cells: list[dict[str, Any]] = []
    print(f"\n{'switch ms':>9} {'thr':>4} {'mode':>6} {'layers':>6} " + " ".join(f"{b:>14}" for b in besides))

    def save() -> Path:
        return write_json(a.out, {"command": "python bench/host_contention.py " + " ".join(argv or sys.argv[1:]),
                                  "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                                  "params_per_layer": params, "layers": a.layers, "cells": cells})

    try:
        for switch in a.switch:
            sys.setswitchinterval(switch)
            for th in threads:
                torch.set_num_threads(th)
                for mode in ("sync", "async"):
                    for which in ("one", "cycle"):
                        layers = [0] if which == "one" else list(range(a.layers))
                        row = []
                        for side in besides:
                            with beside(side, device):
                                got = time_steps(state, worker, layers, grads, steps=a.steps,
                                                 keep_previous=mode == "async", budget_s=a.cell_s)
                            row.append({"switch_s": switch, "threads": th, "mode": mode, "layers": which,
                                        "beside": side, "steps_s": got, "median_ms": statistics.median(got) * 1e3})
                        cells.extend(row)
                        print_row(row)
                        save()  # a call cut short keeps the rows done
    finally:
        sys.setswitchinterval(before_switch)
        torch.set_num_threads(before_threads)
        worker.close()
    print(f"\nwrote {save()}")
    return 0


def print_row(row: list[dict[str, Any]]) -> None:
    """One table row: each side work's median ms, and its ratio to the row's `none` cell."""
    base = row[0]["median_ms"] if row[0]["beside"] == "none" else None
    c = row[0]
    text = " ".join(f"{r['median_ms']:7.1f}" + (f" x{r['median_ms'] / base:4.2f}" if base else "      ") for r in row)
    print(f"{c['switch_s'] * 1e3:9.2f} {c['threads']:4d} {c['mode']:>6} {c['layers']:>6} {text}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
