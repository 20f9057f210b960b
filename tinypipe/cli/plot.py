"""PNG pictures of a Timeline: one row per resource colored by action kind, memory per device below.

matplotlib is optional (`pip install tinypipe[plot]`) and imported only when a picture is drawn.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.common.units import GIB
from tinypipe.describe.hardware import HOST
from tinypipe.ir.kinds import KINDS
from tinypipe.ir.timeline import Timeline

KIND_COLORS: dict[str, str] = {k.value: info.colour for k, info in KINDS.items()}  # by printed name


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("plotting needs matplotlib: pip install tinypipe[plot]") from None
    return plt


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str = "", width_in: float = 14.0) -> Path:
    """Draw `timeline` to a PNG at `path` (returned): Gantt rows per resource; GPU and host memory below."""
    plt = _pyplot()
    resources = timeline.resources()
    if not resources:
        raise InputError("the timeline has no actions to plot")
    t0 = timeline.start_s
    row = {r: i for i, r in enumerate(resources)}
    bars: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for r in timeline.records:
        bars[(r.resource, r.kind)].append((r.start_s - t0, max(r.end_s - r.start_s, 0.0)))
    gpu_mem = {d: v for d, v in timeline.memory.items() if d != HOST and v}
    host_mem = {d: v for d, v in timeline.memory.items() if d == HOST and v}
    panels = [m for m in (gpu_mem, host_mem) if m]  # GPU and host memory differ by ~100x: own axes
    fig, axes = plt.subplots(1 + len(panels), 1, sharex=True, squeeze=False,
                             figsize=(width_in, 0.35 * len(resources) + 1.0 + 2.0 * len(panels)),
                             gridspec_kw={"height_ratios": [max(len(resources), 2)] + [3] * len(panels)})
    ax = axes[0][0]
    seen: set[str] = set()
    for (res, kind), spans in sorted(bars.items()):
        color = KIND_COLORS.get(kind, "#17becf")
        ax.broken_barh(spans, (row[res] - 0.4, 0.8), facecolors=color, linewidth=0,
                       label=None if kind in seen else kind)
        seen.add(kind)
    ax.set_yticks(range(len(resources)))
    ax.set_yticklabels(resources)
    ax.set_ylim(len(resources) - 0.5, -0.5)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    ax.set_title(title or f"timeline ({timeline.source}), steady iteration {timeline.steady_iteration_s():.3f} s")
    t_end = timeline.end_s
    for i, mem in enumerate(panels, start=1):
        mem_ax = axes[i][0]
        for dev, samples in mem.items():
            ts = [t - t0 for t, _ in samples] + [t_end - t0]
            gib = [b / GIB for _, b in samples] + [samples[-1][1] / GIB]
            mem_ax.step(ts, gib, where="post", label=dev)
        mem_ax.set_ylabel("host GiB" if mem is host_mem else "GPU GiB")
        mem_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    axes[-1][0].set_xlabel("time (s)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_pareto(result: Any, path: str | Path, *, title: str = "") -> Path:
    """A search's fitting candidates: tokens/s against peak GPU memory (color: peak host memory),
    with the Pareto front joined and the winner marked. `result` is a `tinypipe.search.policy_search.SearchResult`."""
    plt = _pyplot()
    fit = [e for e in result.ranked if e.fits]
    if not fit:
        raise InputError("no candidate fits: nothing to plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sc = ax.scatter([e.peak_gpu_bytes / GIB for e in fit], [e.tokens_per_s for e in fit],
                    c=[e.peak_host_bytes / GIB for e in fit], cmap="viridis", s=18, alpha=0.8)
    fig.colorbar(sc, ax=ax, label="peak host memory, GiB")
    front = sorted(result.pareto(), key=lambda e: e.peak_gpu_bytes)
    ax.scatter([e.peak_gpu_bytes / GIB for e in front], [e.tokens_per_s for e in front], s=60, facecolors="none",
               edgecolors="red", label="Pareto front (3 axes)")
    win = result.winner
    ax.plot([win.peak_gpu_bytes / GIB], [win.tokens_per_s], "k*", markersize=14, label="winner")
    ax.set_xlabel("peak GPU memory, GiB (simulated)")
    ax.set_ylabel("tokens/s (simulated)")
    w = result.workload
    ax.set_title(title or f"{w.model.name} on {w.hardware.name}: search")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
