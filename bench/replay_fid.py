"""`tinypipe replay --warmup 2` of every run trace in the fidelity calls' archives (issue 10: replay with
the run's own durations within 1%). Writes bench/results/replay_fid.json and prints a table.

    python bench/replay_fid.py [ARCHIVE.tgz ...]

Default archives: bench/results/profile_h200_fid3/call*/traces.tgz, and the same of profile_h200_fid4 to _fid6.
Each trace is replayed as `tinypipe replay` does it, recompiling the run's schedule from the trace's
record (`otherData.run`). A trace whose recompiled schedule differs (recorded by an older compiler: the
host-activation runs before the head stopped being offloaded) is listed with the reason, not replayed.
`-mem-` runs sampled the allocator at every action and are replayed too, marked: their issue times
carry the sampling. `issue spans`: whether the trace records the main thread's issue (`gN.issue`);
with them the replay runs the host's issue loop (sim/issuer.py), without them it cannot.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import tempfile
from pathlib import Path

from _common import write_json
from tinypipe.sim import simulate

from tinypipe.common.errors import TinypipeError
from tinypipe.common.table import render
from tinypipe.replay.runner import add_replay_arguments, replay, settle
from tinypipe.replay.trace_match import load_run_trace

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = sorted(ROOT.glob("bench/results/profile_h200_fid[3-6]/call*/traces.tgz"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archives", nargs="*", type=Path, default=DEFAULT)
    a = ap.parse_args()
    replay_args = argparse.ArgumentParser()
    add_replay_arguments(replay_args)
    rows, out = [], []
    for archive in a.archives:
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
            for path in sorted(Path(tmp).glob("*.trace.json")):
                where = f"{archive.parent.relative_to(ROOT)}/{path.name}"
                trace = load_run_trace(path)
                spans = bool(trace.issue)
                try:
                    rep = replay(trace, settle(trace, replay_args.parse_args([str(path), "--warmup", "2"])),
                                 simulate=simulate, warmup=2)
                except TinypipeError as e:
                    out.append({"trace": where, "replayed": False, "why": str(e).split(": ", 1)[-1]})
                    rows.append([where, "-", "-", "not replayed: schedule differs", "-", "yes" if spans else "no"])
                    continue
                js = rep.to_json()
                s = js["steady_s"]
                out.append({"trace": where, "replayed": True, "issue_spans": spans, "measured_s": s["measured"],
                            "replayed_s": s["replayed"], "replay_error": js["replay_error"],
                            "predicted_s": s["predicted"], "perturbed": "-mem-" in path.name})
                sampled = " (memory sampled)" if "-mem-" in path.name else ""
                rows.append([where, round(s["measured"], 3), round(s["replayed"], 3),
                             f"{100 * js['replay_error']:+.2f}%{sampled}", round(s["predicted"], 3),
                             "yes" if spans else "no"])
    print(render(["trace", "measured s", "replayed s", "replay err", "predicted s", "issue spans"], rows,
                 align="lrrlrl"))
    ok = [r for r in out if r["replayed"] and r["issue_spans"] and not r["perturbed"]]
    if ok:
        worst = max(ok, key=lambda r: abs(r["replay_error"]))
        print(f"{len(ok)} traces with issue spans (memory not sampled): worst replay error "
              f"{100 * worst['replay_error']:+.2f}% ({worst['trace']})")
    write_json("replay_fid.json", {"command": "python bench/replay_fid.py", "warmup": 2, "traces": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
