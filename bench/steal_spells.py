"""Were a run's slow iterations the host's stolen CPU time? (issue 10: the lent H200s' slow spells.)

    python bench/steal_spells.py --stat STAT_TXT [--vmstat VMSTAT_TXT] TRACE [TRACE ...] [--out FILE]

STAT_TXT: the host's /proc/stat `cpu` line once a second, each after its wall-clock time
(`bench/device/fidelity_h200.sh` writes it as $OUT/stat.txt while its runs go). TRACE: a `tinypipe run
--trace` of the same machine, which records the wall-clock time of its zero (otherData.origin_unix_s).
For each iteration of each trace: its time (the end of its last action after the end of the one
before, as `tinypipe replay` counts it), the mean of its block OPT_STEPs (the host optimizer's step,
what a spell slows first), and the share of the host's CPU time stolen by the hypervisor over the
samples that fall within it (interpolated between the two samples around each end). A table per
trace on stdout, and the correlation over all iterations after the warm-up ones between steal and
the block step; JSON to --out. With VMSTAT_TXT (the same script's $OUT/vmstat.txt: `<unix s> name value
...` once a second, page faults, NUMA balancing, huge pages), each counter's rate per second in each
iteration too, and its correlation with the block step: what else might slow a host step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from bisect import bisect_left
from pathlib import Path

from tinypipe.backends.cpustat import cpu_line_jiffies, stolen_share

from tinypipe.ir.timeline import Timeline
from tinypipe.replay.trace_match import load_run_trace

WARMUP = 2  # iterations left out of the correlation (compile, the settled heap), as bench/fidelity.py


Samples = list[tuple[float, dict[str, int]]]  # (unix s, counter -> value), in time order


def read_stat(path: Path) -> Samples:
    """Per sample line `<unix s> cpu ...`: its time and the host's `all` and `stolen` CPU ticks."""
    out = []
    for line in path.read_text().splitlines():
        when, _, rest = line.partition(" ")
        got = cpu_line_jiffies(rest)
        if got is not None:
            out.append((float(when), {"all": got[0], "stolen": got[1]}))
    return sorted(out, key=lambda x: x[0])


def read_vmstat(path: Path) -> Samples:
    """Per sample line `<unix s> name value name value ...`: its time and its counters."""
    out = []
    for line in path.read_text().splitlines():
        when, *rest = line.split()
        out.append((float(when), {name: int(v) for name, v in zip(rest[::2], rest[1::2])}))
    return sorted(out, key=lambda x: x[0])


def value_at(samples: Samples, name: str, t: float) -> float | None:
    """Counter `name` at wall time `t`, interpolated between the samples around it; None outside them or
    where either lacks it."""
    i = bisect_left(samples, t, key=lambda x: x[0])
    if i == 0 or i == len(samples) or name not in samples[i - 1][1] or name not in samples[i][1]:
        return None
    (a, va), (b, vb) = samples[i - 1], samples[i]
    f = (t - a) / (b - a) if b > a else 0.0
    return va[name] + f * (vb[name] - va[name])


def steal_between(samples: Samples, t0: float, t1: float) -> float | None:
    """The stolen share of the host's CPU time between wall times `t0` and `t1` (`read_stat` samples)."""
    def reading(t: float) -> tuple[float, float] | None:
        a, s = value_at(samples, "all", t), value_at(samples, "stolen", t)
        return None if a is None or s is None else (a, s)

    return stolen_share(reading(t0), reading(t1))


def rate_between(samples: Samples, name: str, t0: float, t1: float) -> float | None:
    """Counter `name`'s increase per second between wall times `t0` and `t1`; None outside the samples."""
    x, y = value_at(samples, name, t0), value_at(samples, name, t1)
    return None if x is None or y is None or t1 <= t0 else (y - x) / (t1 - t0)


def iterations(path: Path, samples: Samples, vm: Samples | None = None) -> list[dict]:
    """Per iteration of the trace at `path`: its time, its block OPT_STEPs' mean, the steal during it, and
    with `vm` each counter's rate per second (`vmstat_per_s`)."""
    trace = load_run_trace(path)
    origin = trace.meta.get("origin_unix_s")
    if not isinstance(origin, (int, float)):
        raise SystemExit(f"{path}: the trace does not record origin_unix_s (written by tinypipe run --trace "
                         "since 2026-12-01's sixth session); it cannot be lined up with the samples")
    tl = Timeline(trace.records, source=trace.source)
    ends = tl.iteration_ends_s()
    times = tl.iteration_times_s()
    layers = trace.run.get("model_config", {}).get("num_hidden_layers") or 0
    steps_by_iteration: dict[int, list[float]] = {}
    for r in trace.records:
        if r.kind == "OPT_STEP" and r.layer is not None and 1 <= r.layer <= layers:
            steps_by_iteration.setdefault(r.iteration, []).append(r.end_s - r.start_s)
    rows = []
    for k, (end, took) in enumerate(zip(ends, times)):
        steps = steps_by_iteration.get(k)
        t0, t1 = origin + end - took, origin + end
        row = {"iteration": k, "iteration_s": took, "block_step_ms": 1e3 * statistics.fmean(steps) if steps else None,
               "steal": steal_between(samples, t0, t1)}
        if vm:
            row["vmstat_per_s"] = {name: rate_between(vm, name, t0, t1) for name in sorted(vm[0][1])}
        rows.append(row)
    return rows


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _corr(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}"


def correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--stat", type=Path, required=True)
    ap.add_argument("--vmstat", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    samples = read_stat(a.stat)
    vm = read_vmstat(a.vmstat) if a.vmstat else None
    out: dict[str, list[dict]] = {}
    steady = []
    for path in a.traces:
        rows = iterations(path, samples, vm)
        out[path.name] = rows
        names = sorted(rows[0].get("vmstat_per_s", {})) if rows else []
        print(f"{path.name}\n  iteration    s    block step ms  steal" + "".join(f"  {n}/s" for n in names))
        for r in rows:
            step = "-" if r["block_step_ms"] is None else f"{r['block_step_ms']:.1f}"
            steal = "-" if r["steal"] is None else f"{100 * r['steal']:.2f}%"
            rates = "".join(f"  {_num(r['vmstat_per_s'][n]):>{len(n) + 2}s}" for n in names)
            print(f"  {r['iteration']:9d} {r['iteration_s']:6.3f} {step:>14s} {steal:>6s}{rates}")
            if r["iteration"] >= WARMUP and r["steal"] is not None and r["block_step_ms"] is not None:
                steady.append(r)
    steps = [r["block_step_ms"] for r in steady]
    corr = correlation([r["steal"] for r in steady], steps)
    print(f"{len(steady)} iterations after the first {WARMUP} of each run: correlation of steal with the block "
          f"step {_corr(corr)}; steal at most {100 * max((r['steal'] for r in steady), default=0):.2f}%")
    by_counter = {}
    for name in sorted(vm[0][1]) if vm else []:
        got = [(r["vmstat_per_s"][name], r["block_step_ms"]) for r in steady if r["vmstat_per_s"][name] is not None]
        by_counter[name] = correlation([g[0] for g in got], [g[1] for g in got])
        print(f"  {name}: correlation with the block step {_corr(by_counter[name])}")
    if a.out:
        a.out.write_text(json.dumps({"stat": str(a.stat), "vmstat": str(a.vmstat) if a.vmstat else None,
                                     "iterations": out, "correlation": corr, "vmstat_correlation": by_counter},
                                    indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
