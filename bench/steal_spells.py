"""Were a run's slow iterations the host's stolen CPU time? (issue 10: the lent H200s' slow spells.)

    python bench/steal_spells.py --stat STAT_TXT TRACE [TRACE ...] [--out FILE]

STAT_TXT: the host's /proc/stat `cpu` line once a second, each after its wall-clock time
(`bench/device/fidelity_h200.sh` writes it as $OUT/stat.txt while its runs go). TRACE: a `tinypipe run
--trace` of the same machine, which records the wall-clock time of its zero (otherData.origin_unix_s).
For each iteration of each trace: its time (the end of its last action after the end of the one
before, as `tinypipe replay` counts it), the mean of its block OPT_STEPs (the host optimizer's step,
what a spell slows first), and the share of the host's CPU time stolen by the hypervisor over the
samples that fall within it (interpolated between the two samples around each end). A table per
trace on stdout, and the correlation over all iterations after the warm-up ones between steal and
the block step; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from bisect import bisect_left
from pathlib import Path

from tinypipe.backends.cpustat import cpu_line_jiffies

from tinypipe.replay import load_run_trace
from tinypipe.timeline import Timeline

WARMUP = 2  # iterations left out of the correlation (compile, the settled heap), as bench/fidelity.py


def read_stat(path: Path) -> list[tuple[float, int, int]]:
    """(unix s, all ticks, stolen ticks) per sample line `<unix s> cpu ...`, in time order."""
    out = []
    for line in path.read_text().splitlines():
        when, _, rest = line.partition(" ")
        got = cpu_line_jiffies(rest)
        if got is not None:
            out.append((float(when), *got))
    return sorted(out)


def ticks_at(samples: list[tuple[float, int, int]], t: float) -> tuple[float, float] | None:
    """(all, stolen) ticks at wall time `t`, interpolated between the samples around it; None outside."""
    i = bisect_left([s[0] for s in samples], t)
    if i == 0 or i == len(samples):
        return None
    (t0, a0, s0), (t1, a1, s1) = samples[i - 1], samples[i]
    f = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
    return a0 + f * (a1 - a0), s0 + f * (s1 - s0)


def steal_between(samples: list[tuple[float, int, int]], t0: float, t1: float) -> float | None:
    a, b = ticks_at(samples, t0), ticks_at(samples, t1)
    if a is None or b is None or b[0] <= a[0]:
        return None
    return (b[1] - a[1]) / (b[0] - a[0])


def iterations(path: Path, samples: list[tuple[float, int, int]]) -> list[dict]:
    """Per iteration of the trace at `path`: its time, its block OPT_STEPs' mean, the steal during it."""
    trace = load_run_trace(path)
    origin = trace.meta.get("origin_unix_s")
    if not isinstance(origin, (int, float)):
        raise SystemExit(f"{path}: the trace does not record origin_unix_s (written by tinypipe run --trace "
                         "since 2026-12-01's sixth session); it cannot be lined up with the samples")
    tl = Timeline(trace.records, source=trace.source)
    ends = tl.iteration_ends_s()
    times = tl.iteration_times_s()
    layers = trace.run.get("model_config", {}).get("num_hidden_layers")
    rows = []
    for k, (end, took) in enumerate(zip(ends, times)):
        steps = [r.end_s - r.start_s for r in trace.records if r.kind == "OPT_STEP" and r.iteration == k
                 and r.layer is not None and layers and 1 <= r.layer <= layers]
        rows.append({"iteration": k, "iteration_s": took,
                     "block_step_ms": 1e3 * statistics.fmean(steps) if steps else None,
                     "steal": steal_between(samples, origin + end - took, origin + end)})
    return rows


def correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--stat", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    samples = read_stat(a.stat)
    out: dict[str, list[dict]] = {}
    pairs = []
    for path in a.traces:
        rows = iterations(path, samples)
        out[path.name] = rows
        print(f"{path.name}\n  iteration    s    block step ms  steal")
        for r in rows:
            step = "-" if r["block_step_ms"] is None else f"{r['block_step_ms']:.1f}"
            steal = "-" if r["steal"] is None else f"{100 * r['steal']:.2f}%"
            print(f"  {r['iteration']:9d} {r['iteration_s']:6.3f} {step:>14s} {steal:>6s}")
            if r["iteration"] >= WARMUP and r["steal"] is not None and r["block_step_ms"] is not None:
                pairs.append((r["steal"], r["block_step_ms"]))
    corr = correlation([p[0] for p in pairs], [p[1] for p in pairs])
    print(f"{len(pairs)} iterations after the first {WARMUP} of each run: correlation of steal with the block "
          f"step {'-' if corr is None else f'{corr:+.2f}'}; steal at most "
          f"{100 * max((p[0] for p in pairs), default=0):.2f}%")
    if a.out:
        a.out.write_text(json.dumps({"stat": str(a.stat), "iterations": out, "correlation": corr}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
