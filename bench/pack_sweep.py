"""The pack-size sweep (docs/performance.md): simulated tokens/s and peak GPU memory against pack size.

For llama-3.1-8b on rtx4090x8-pcie4 (default), the `tinypipe` preset with uniform packs of k
blocks for each k, then the preset as shipped (holistic packer) for comparison. Writes a table,
bench/results/pack_sweep.json and bench/results/pack_sweep.png.

    python bench/pack_sweep.py [--model M] [--hardware H] [--seq-len 2048] [--microbatches 32]
"""

from __future__ import annotations

import argparse
import time

from _common import RESULTS, write_json

from tinypipe.common.table import gib, render
from tinypipe.common.units import GIB
from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.policy import PRESETS
from tinypipe.sim import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--hardware", default="rtx4090x8-pcie4")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()
    model, hw = load_model(args.model), load_hardware(args.hardware)
    base = PRESETS["tinypipe"].replace(microbatches=args.microbatches)
    trace = trace_for(model, hw.gpus[0], microbatch_size=base.microbatch_size, seq_len=args.seq_len)
    rows = []
    for k in range(1, model.num_blocks + 1):
        if model.num_blocks % k and k not in (3, 5, 6, 7):
            continue
        p = base.replace(packing="uniform", pack_size=k)
        t0 = time.perf_counter()
        sched = compile_schedule(p, model, hw, trace, iterations=args.iterations)
        res = simulate(sched, model, hw, trace, on_capacity="record")
        rows.append({"pack_size": k, "packs": len(sched.pack_layers), "tokens_per_s": res.tokens_per_s,
                     "iteration_s": res.iteration_s, "peak_gpu_bytes": res.peak_gpu_bytes, "fits": res.fits,
                     "bottleneck": res.critical_path.bottleneck, "wall_s": time.perf_counter() - t0})
    sched = compile_schedule(base, model, hw, trace, iterations=args.iterations)
    res = simulate(sched, model, hw, trace, on_capacity="record")
    holistic = {"pack_sizes": [len(p) for p in sched.pack_layers], "tokens_per_s": res.tokens_per_s,
                "peak_gpu_bytes": res.peak_gpu_bytes, "fits": res.fits}
    best = max((r for r in rows if r["fits"]), key=lambda r: r["tokens_per_s"])
    ratio = holistic["tokens_per_s"] / best["tokens_per_s"]
    print(f"{model.name} on {hw.name}, {args.microbatches} x {args.seq_len} tokens per step, simulated "
          f"({args.iterations} iterations, steady state)\n")
    print(render(["pack size", "packs", "tokens/s", "iteration s", "peak GPU", "fits", "bottleneck"],
                 [[r["pack_size"], r["packs"], round(r["tokens_per_s"]), round(r["iteration_s"], 3),
                   gib(r["peak_gpu_bytes"]), r["fits"], r["bottleneck"]] for r in rows], align="rrrrrll"))
    print(f"\nbest uniform: k={best['pack_size']} at {best['tokens_per_s']:,.0f} tokens/s")
    print(f"holistic packer: packs {holistic['pack_sizes']} at {holistic['tokens_per_s']:,.0f} tokens/s "
          f"= {ratio:.3f} x the best uniform point")
    write_json("pack_sweep.json", {"model": model.name, "hardware": hw.name, "seq_len": args.seq_len,
                                   "microbatches": args.microbatches, "sweep": rows, "holistic": holistic,
                                   "best_uniform": best, "holistic_over_best": ratio})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ks = [r["pack_size"] for r in rows]
    ax.plot(ks, [r["tokens_per_s"] for r in rows], "o-", label="tokens/s (uniform packs)")
    ax.axhline(holistic["tokens_per_s"], color="C2", ls="--", label="holistic packer")
    ax.set_xlabel("layers per pack")
    ax.set_ylabel("tokens/s (simulated)")
    ax2 = ax.twinx()
    ax2.plot(ks, [r["peak_gpu_bytes"] / GIB for r in rows], "s:", color="C1", label="peak GPU GiB")
    ax2.set_ylabel("peak GPU memory, GiB")
    ax.set_title(f"{model.name} on {hw.name}: pack size sweep")
    fig.legend(loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(RESULTS / "pack_sweep.png", dpi=110)
    print(f"wrote {RESULTS / 'pack_sweep.png'}")


if __name__ == "__main__":
    main()
