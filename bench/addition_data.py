"""The addition task's sequences per step window: the byte-level fast path against the general path.

    python bench/addition_data.py [--sequences 128] [--seq-len 2048] [--rounds 5]

`AdditionSequences` (backends/data/addition.py) serves the default job's data and the H200 benchmarks'
(Qwen3-1.7B, 4 x 2048 per microbatch, 8 microbatches: 32 sequences a step, 128 a 4-step window). Times,
interleaved round by round on the same sequences: `slow_item` (each problem tokenized on its own),
`__getitem__` from a cold memo (a fresh source each round) and from a warm one (sequences the memo has
seen problems of). Medians over `--rounds`; ratios to `slow_item` from the same run. Writes
bench/results/addition_data.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import write_json
from tinypipe.backends.data.addition import AdditionSequences, AdditionTask
from tinypipe.backends.data.tokenizers import ByteTokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=128, help="sequences per timing (default: a 4-step window)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    times: dict[str, list[float]] = {"slow_item": [], "fast, cold memo": [], "fast, warm memo": []}
    ids = range(a.sequences)
    for _ in range(a.rounds):
        src = AdditionSequences(AdditionTask(), ByteTokenizer(151_936), a.seq_len)
        for name, get in (("slow_item", src.slow_item), ("fast, cold memo", src.__getitem__),
                          ("fast, warm memo", src.__getitem__)):
            t0 = time.perf_counter()
            for j in ids:
                get(j)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{a.sequences} sequences of {a.seq_len} tokens, median of {a.rounds} rounds")
    print(f"{'path':16s} {'median s':>9s} {'x slow_item':>12s}")
    for name, s in med.items():
        print(f"{name:16s} {s:9.3f} {s / med['slow_item']:12.2f}")
    path = write_json("addition_data.json", {"sequences": a.sequences, "seq_len": a.seq_len, "rounds": a.rounds,
                                             "seconds": times, "median_s": med})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
