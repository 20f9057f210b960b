"""Append a GPU machine's run records to bench/results/cuda_h200.jsonl, naming the machine and its profile.

    python bench/device/ingest.py RECORDS --call TEXT [--profile-root DIR] [--not-fidelity CASE=WHY ...]
                                  [--into FILE]

RECORDS: the cuda_h200.jsonl that bench/device/fidelity_h200.sh writes under $OUT. Each record gains
`machine_call` (--call: which machine ran it, and when) and, with --profile-root, `profile_root`: the
folder, relative to the repository root, holding the profile taken on that machine just before, from
which bench/fidelity.py predicts the record. --not-fidelity CASE=WHY: the record of that case gains
`not_fidelity` (why), and bench/fidelity.py leaves it out (a run made for another question, e.g. planned
from another machine's profile to look at something else in its trace).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records")
    ap.add_argument("--call", required=True, help="which machine ran them, and when")
    ap.add_argument("--profile-root", help="the profile folder they were planned from")
    ap.add_argument("--not-fidelity", action="append", default=[], metavar="CASE=WHY",
                    help="leave this case's record out of bench/fidelity.py, saying why")
    ap.add_argument("--into", default=str(ROOT / "bench" / "results" / "cuda_h200.jsonl"))
    a = ap.parse_args()
    if a.profile_root and not (ROOT / a.profile_root).is_dir():
        raise SystemExit(f"--profile-root {a.profile_root}: no such folder under {ROOT}")
    excluded = dict(x.split("=", 1) for x in a.not_fidelity if "=" in x)
    if len(excluded) != len(a.not_fidelity):
        raise SystemExit("--not-fidelity: give CASE=WHY")
    lines = []
    for line in Path(a.records).read_text().splitlines():
        rec = json.loads(line)
        rec["machine_call"] = a.call
        if rec.get("case") in excluded:
            rec["not_fidelity"] = excluded.pop(rec["case"])
        if a.profile_root:
            rec["profile_root"] = a.profile_root
        lines.append(json.dumps(rec) + "\n")
    if excluded:
        raise SystemExit(f"--not-fidelity: no record of case {', '.join(excluded)} in {a.records}")
    with open(a.into, "a") as f:
        f.writelines(lines)
    print(f"appended {len(lines)} records to {a.into}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
