"""Predicted vs measured for the runs of bench/device/trust_h200.sh: reads their summaries, prints a table, writes JSON.

    python3 bench/device/trust_report.py OUT_JSON SEARCH_JSON LABEL=SUMMARY_FILE ...

Each SUMMARY_FILE is the text `tinypipe run` printed; from it: tokens/s and step time measured (the
mean over the steady steps) and predicted, the GPU peak measured by the allocator, by the run's own
ledger and predicted, the host's predicted peak and the workers' peak RSS, and the calibration line
(which figures were measured on this machine now, or cached). SEARCH_JSON is `tinypipe search --json`:
the winner's predicted speed and GPU peak beside the fastest candidate's. Errors are measured / predicted
- 1; the bound the Show asks for is 5%.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
BOUND = 0.05

SPEED = re.compile(r"^speed\s+([\d,]+) tokens/s measured \(step ([\d.]+) ms, (.*?); ", re.M)
PREDICTED = re.compile(r"^\s+([\d,]+) tokens/s predicted by the simulator \(step ([\d.]+) ms; ([^,]+),", re.M)
DEVICE = re.compile(r"^device\s+peak g0 ([\d,.]+) MiB measured; g0 ([\d,.]+) MiB by the schedule's ledger as it "
                    r"ran; g0 ([\d,.]+) MiB predicted", re.M)
HOST = re.compile(r"predicted peak ([\d,.]+) MiB; peak RSS of the workers ([\d,.]+) MiB")
CALIBRATED = re.compile(r"^calibrated (.*)$", re.M)


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def parse_summary(text: str) -> dict[str, Any]:
    """The figures of one run's summary (KeyError-free: a missing line leaves its fields out, with `missing`)."""
    out: dict[str, Any] = {"missing": []}
    for name, rx in (("speed", SPEED), ("predicted", PREDICTED), ("device", DEVICE), ("host", HOST),
                     ("calibrated", CALIBRATED)):
        m = rx.search(text)
        if m is None:
            out["missing"].append(name)
            continue
        g = m.groups()
        if name == "speed":
            out.update(measured_tokens_per_s=_num(g[0]), measured_step_s=_num(g[1]) / 1e3, steady=g[2])
        elif name == "predicted":
            out.update(predicted_tokens_per_s=_num(g[0]), predicted_step_s=_num(g[1]) / 1e3, hardware=g[2])
        elif name == "device":
            out.update(gpu_peak_measured_bytes=_num(g[0]) * MIB, gpu_peak_ledger_bytes=_num(g[1]) * MIB,
                       gpu_peak_predicted_bytes=_num(g[2]) * MIB)
        elif name == "host":
            out.update(host_peak_predicted_bytes=_num(g[0]) * MIB, host_rss_bytes=_num(g[1]) * MIB)
        else:
            out["calibration"] = g[0]
    if "measured_step_s" in out and "predicted_step_s" in out:
        out["step_error"] = out["measured_step_s"] / out["predicted_step_s"] - 1
    if "gpu_peak_measured_bytes" in out:
        out["gpu_peak_error"] = out["gpu_peak_measured_bytes"] / out["gpu_peak_predicted_bytes"] - 1
        out["ledger_vs_predicted"] = out["gpu_peak_ledger_bytes"] / out["gpu_peak_predicted_bytes"] - 1
    return out


def search_figures(obj: dict[str, Any]) -> dict[str, Any]:
    win, fast = obj.get("winner") or {}, obj.get("fastest") or {}
    return {"rule": obj.get("rule"), "winner": win.get("policy"), "winner_tokens_per_s": win.get("tokens_per_s"),
            "winner_gpu_bytes": win.get("peak_gpu_bytes"), "winner_host_bytes": win.get("peak_host_bytes"),
            "fastest_tokens_per_s": fast.get("tokens_per_s"), "fastest_gpu_bytes": fast.get("peak_gpu_bytes"),
            "fastest": fast.get("policy")}


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{100 * v:+.1f}%"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_path, search_path, runs = Path(argv[0]), Path(argv[1]), argv[2:]
    report: dict[str, Any] = {"bound": BOUND, "runs": {}}
    if search_path.is_file():
        s = search_figures(json.loads(search_path.read_text()))
        report["search"] = s
        if s["winner_tokens_per_s"] and s["fastest_tokens_per_s"]:
            print(f"search: winner {s['winner_tokens_per_s']:,.0f} tokens/s at {s['winner_gpu_bytes'] / GIB:.2f} GiB "
                  f"GPU ({100 * s['winner_tokens_per_s'] / s['fastest_tokens_per_s']:.1f}% of the fastest, "
                  f"{s['fastest_tokens_per_s']:,.0f} tokens/s at {s['fastest_gpu_bytes'] / GIB:.2f} GiB)")
    rows = []
    for arg in runs:
        label, _, path = arg.partition("=")
        p = Path(path)
        fig = parse_summary(p.read_text()) if p.is_file() else {"missing": ["summary file"]}
        report["runs"][label] = fig
        rows.append((label, fig))
    print(f"{'run':<22} {'step measured':>13} {'predicted':>10} {'error':>7} {'GPU measured':>12} {'ledger':>8} "
          f"{'predicted':>9} {'error':>7}")
    for label, f in rows:
        if f.get("missing") and "measured_step_s" not in f:
            print(f"{label:<22} missing: {', '.join(f['missing'])}")
            continue
        print(f"{label:<22} {f.get('measured_step_s', 0):>12.3f}s {f.get('predicted_step_s', 0):>9.3f}s "
              f"{_pct(f.get('step_error')):>7} {f.get('gpu_peak_measured_bytes', 0) / GIB:>10.2f}Gi "
              f"{f.get('gpu_peak_ledger_bytes', 0) / GIB:>6.2f}Gi {f.get('gpu_peak_predicted_bytes', 0) / GIB:>7.2f}Gi "
              f"{_pct(f.get('gpu_peak_error')):>7}")
        if f.get("calibration"):
            print(f"{'':<22} calibrated {f['calibration']}")
    within = [abs(f["step_error"]) <= BOUND for _, f in rows if "step_error" in f]
    report["all_within_bound"] = bool(within) and all(within)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
