"""Does the search rank its top candidates as they run? (issue 10: `tinypipe search --gpu-mem 24GiB`.)

    python bench/search_rank.py pick --model M --hardware H --profile DIR --out DIR [--n 5] [--min-gap F]
    python bench/search_rank.py score [--records bench/results/cuda_h200.jsonl] [--picked DIR] [--call TEXT ...]
                                      [--repeats] [--out FILE]

pick: runs `tinypipe search --json` (24 GiB per GPU, 65,536 tokens per step, seq 2048) and writes
the first N distinct candidates as policy files rank-1.json .. rank-N.json, with picked.json (each
one's predicted tokens/s and peak GPU memory, and the search command). Distinct: candidates with
the same predicted tokens/s, peak GPU and peak host memory compile to the same work (on one GPU
the GPU mapping, for one, changes nothing) and count once, the first in the search's order.
--min-gap F (a ladder, files ladder-K.json): each pick after the first is the search's next candidate
predicted at least F (a fraction) slower than the one picked before it. The search's own top five
often lie within 1% of each other, closer than one run's iterations vary, where a measured order says
nothing of the model; a ladder asks whether the model orders candidates it says differ.
bench/device/fidelity_h200.sh runs pick on the GPU machine right after its profile (RANK=N, RANK_GAP=F),
then runs each policy file a RUN names, recorded with a label ending `-rank-K` (`-ladder-K`).

score: each picked candidate's measured run beside its prediction (--call: records of these calls only;
with --repeats, every run of a candidate in them, its `-ab-` runs too, each run's tokens/s averaged:
an A/A repeat under a default knob measures the spread of one policy's runs on one machine); the
predicted order against the measured one (Kendall's tau-a over all pairs, which counts a pair
predicted equal as neither; each pair in the wrong order with its two gaps), whether the winner fit
the GPU cap when run, how far it ran below the best candidate as run (`winner_regret`), and the
spread of the last run's steady iterations (what a measured order between two candidates closer than
that means). A table on stdout; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def choose(top: list[dict], n: int, min_gap: float = 0.0) -> list[dict]:
    """The first `n` distinct fitting candidates of the search's list, in its order; with `min_gap`, each
    after the first predicted at least that fraction slower than the one chosen before it."""
    seen: set[tuple[float, int, int]] = set()
    chosen: list[dict] = []
    for e in top:
        key = (round(e["tokens_per_s"], 3), e["peak_gpu_bytes"], e["peak_host_bytes"])
        if not e["fits"] or key in seen:
            continue
        if chosen and e["iteration_s"] < chosen[-1]["iteration_s"] * (1 + min_gap):
            continue
        seen.add(key)
        chosen.append(e)
        if len(chosen) == n:
            break
    return chosen


def pick(a: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "tinypipe.cli", "search", "--model", a.model, "--hardware", a.hardware,
           "--profile", a.profile, "--gpu-mem", a.gpu_mem, "--seq-len", "2048", "--batch-tokens", "65536",
           "--top", "200", "--json"]
    found = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = "ladder" if a.min_gap > 0 else "rank"
    picked = []
    for rank, e in enumerate(choose(found["top"], a.n, a.min_gap), 1):
        policy = dict(e["policy"], name=f"search-{prefix}-{rank}")
        (out / f"{prefix}-{rank}.json").write_text(json.dumps(policy, indent=1) + "\n")
        picked.append({"rank": rank, "policy": policy, "predicted_tokens_per_s": e["tokens_per_s"],
                       "predicted_iteration_s": e["iteration_s"], "predicted_peak_gpu_bytes": e["peak_gpu_bytes"]})
    (out / "picked.json").write_text(json.dumps({"command": "tinypipe " + " ".join(cmd[3:]), "model": a.model,
                                                 "prefix": prefix, "min_gap": a.min_gap,
                                                 "considered": found["considered"], "picked": picked}, indent=1))
    for p in picked:
        print(f"rank {p['rank']}: {p['predicted_tokens_per_s']:,.0f} tokens/s predicted, "
              f"{p['predicted_peak_gpu_bytes'] / 2**30:.2f} GiB")
    return 0


def _tie(x: dict, y: dict) -> bool:
    """Two candidates the search predicts equally fast (within 0.1%: the same work, one option apart)."""
    return abs(x["predicted_tokens_per_s"] / y["predicted_tokens_per_s"] - 1) < 1e-3


def kendall_tau(predicted: list[float], measured: list[float]) -> float:
    """Kendall's tau-a of two orderings of the same items (1: same order, -1: reversed)."""
    signs = [(predicted[i] - predicted[j]) * (measured[i] - measured[j])
             for i, j in combinations(range(len(predicted)), 2)]
    if not signs:
        return 1.0
    return (sum(s > 0 for s in signs) - sum(s < 0 for s in signs)) / len(signs)


def score(a: argparse.Namespace) -> int:
    picked = json.loads((Path(a.picked) / "picked.json").read_text())
    prefix = picked.get("prefix", "rank")
    recs: dict[int, list[dict]] = {}
    calls = a.call or [""]
    for line in Path(a.records).read_text().splitlines():
        r = json.loads(line)
        m = re.search(rf"-{prefix}-(\d+)$", r.get("case", ""))
        if (r.get("tokens_per_s") and m and any(c in r.get("machine_call", "") for c in calls)
                and (a.repeats or "-ab-" not in r["case"])):
            if a.repeats:
                recs.setdefault(int(m.group(1)), []).append(r)
            else:  # the latest
                recs[int(m.group(1))] = [r]
    rows = []
    for p in picked["picked"]:
        runs = recs.get(p["rank"])
        if not runs:
            print(f"rank {p['rank']}: no measured run", file=sys.stderr)
            continue
        r = runs[-1]
        steady = r["iteration_s_each"][r["warmup_iterations"]:]
        each = [x["tokens_per_s"] for x in runs]
        rows.append({"rank": p["rank"], "policy": p["policy"], "predicted_tokens_per_s": p["predicted_tokens_per_s"],
                     "measured_tokens_per_s": statistics.fmean(each), "runs_tokens_per_s": each,
                     "predicted_peak_gpu_bytes": p["predicted_peak_gpu_bytes"],
                     "measured_peak_gpu_bytes": r["peak_gpu_bytes"], "gpu_cap_bytes": r["gpu_mem_cap_gib"] * 2**30,
                     "steady_iterations_s": steady,
                     "steady_spread": (max(steady) - min(steady)) / statistics.fmean(steady), "case": r["case"]})
    pred = [x["predicted_tokens_per_s"] for x in rows]
    meas = [x["measured_tokens_per_s"] for x in rows]
    by_meas = sorted(rows, key=lambda x: -x["measured_tokens_per_s"])
    wrong = [{"higher_predicted": x["rank"], "lower_predicted": y["rank"],
              "predicted_gap": x["predicted_tokens_per_s"] / y["predicted_tokens_per_s"] - 1,
              "measured_gap": x["measured_tokens_per_s"] / y["measured_tokens_per_s"] - 1}
             for x, y in combinations(rows, 2) if x["measured_tokens_per_s"] < y["measured_tokens_per_s"]
             and not _tie(x, y)]
    ties = sum(_tie(x, y) for x, y in combinations(rows, 2))
    winner = next((x for x in rows if x["rank"] == 1), None)
    fits = None if winner is None else winner["measured_peak_gpu_bytes"] <= winner["gpu_cap_bytes"]
    # what picking the search's winner cost against the best of the candidates as run
    regret = None if winner is None else 1 - winner["measured_tokens_per_s"] / max(meas)
    result = {"search": picked["command"], "candidates": rows, "measured_order": [x["rank"] for x in by_meas],
              "kendall_tau": kendall_tau(pred, meas), "pairs_in_the_wrong_order": wrong,
              "pairs_predicted_equal": ties, "winner_fits_cap": fits, "winner_regret": regret}
    print(f"{'rank':>4s} {'predicted tok/s':>15s} {'measured tok/s':>14s} {'error':>7s} {'GPU GiB':>8s} "
          f"{'steady spread':>13s} {'runs':>4s}  policy")
    for x in rows:
        p = x["policy"]
        print(f"{x['rank']:4d} {x['predicted_tokens_per_s']:15,.0f} {x['measured_tokens_per_s']:14,.0f} "
              f"{100 * (x['predicted_tokens_per_s'] / x['measured_tokens_per_s'] - 1):+6.1f}% "
              f"{x['measured_peak_gpu_bytes'] / 2**30:8.2f} {100 * x['steady_spread']:12.1f}% "
              f"{len(x['runs_tokens_per_s']):4d}  "
              f"{p['packing']} {p.get('pack_size')}, resident {p['resident']}, depth {p['prefetch_depth']}, "
              f"{p['host_memory']}, acts on {p['activation_home']}")
    print(f"measured order: {result['measured_order']}; Kendall's tau {result['kendall_tau']:+.2f}; "
          f"{len(wrong)} of {len(rows) * (len(rows) - 1) // 2} pairs in the wrong order, {ties} predicted equal"
          + "".join(f"; {w['higher_predicted']} over {w['lower_predicted']}: predicted "
                    f"{100 * w['predicted_gap']:+.1f}%, measured {100 * w['measured_gap']:+.1f}%" for w in wrong))
    print(f"winner fits its GPU cap when run: {result['winner_fits_cap']}"
          + ("" if regret is None else f"; it ran {100 * regret:.1f}% below the best candidate as run"))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pick")
    p.add_argument("--model", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--profile", required=True)
    p.add_argument("--gpu-mem", default="24GiB")
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--min-gap", type=float, default=0.0, help="a ladder: each pick at least this fraction slower")
    p.add_argument("--out", required=True)
    s = sub.add_parser("score")
    s.add_argument("--records", default=str(RESULTS / "cuda_h200.jsonl"))
    s.add_argument("--picked", default=str(RESULTS / "search_rank_h200"))
    s.add_argument("--call", action="append", help="only records whose machine_call contains this (repeatable: "
                   "any of them)")
    s.add_argument("--repeats", action="store_true", help="average every run of a candidate, its -ab- runs too")
    s.add_argument("--out", default=str(RESULTS / "search_rank_h200.json"))
    a = ap.parse_args()
    return pick(a) if a.cmd == "pick" else score(a)


if __name__ == "__main__":
    raise SystemExit(main())
