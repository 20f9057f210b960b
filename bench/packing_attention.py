"""Packed sequences: one decoder block's forward + backward tokens/s unpacked, packed under an [s, s] mask and packed
per document (backends/model/doc_attention.py), and the longest sequence each fits in a memory budget.

    python bench/packing_attention.py                  # CPU: a 1,024-wide Llama block, fp32, 512..2,048 tokens
    python bench/packing_attention.py --device cuda    # CUDA: TinyLlama-1.1B's block, bf16, 4k..32k tokens

Each mode runs one window of s tokens (a microbatch of one sequence) through one block, forward and backward:

    unpacked   one document per window: plain causal attention (SDPA, no mask)
    mask       a window packed with documents, under a [1, 1, s, s] boolean mask (`layers.document_mask`)
    segments   packed, one causal SDPA call per document (the path packed windows take on the CPU)
    flex       packed, FlexAttention with the documents' block mask (the path on CUDA; no backward on the CPU)

The packed windows' documents have lengths drawn (seed 0) uniformly from [d/2, 3d/2], d = --doc-tokens.
tokens/s: s over the fastest of --repeat timed calls (the one other load on the machine disturbed least), after
--warmup calls (which compile the flex kernels); the modes' timed calls take turns.
peak: the bytes allocated at the call's peak above those allocated before it (the block's weights, their
gradients and the input are already there): `torch.cuda.max_memory_allocated` on CUDA; on the CPU the running
sum of the allocator's events that `torch.profiler` records with `profile_memory`, in one more, untimed call.
longest fitting: peak(s) = a s + c s^2 through each mode's peaks at its two longest lengths (c >= 0; the shorter
lengths hold fixed-size buffers that a line through them would misread), and the largest s, a multiple of 128,
with peak(s) <= --budget-gib.

Writes bench/results/packing_attention.json: one entry per device type (cpu, cuda); the other one is kept.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from _common import RESULTS, machine

from tinypipe.backends.model.hf import build_model
from tinypipe.backends.model.layers import Block
from tinypipe.common.table import human_bytes, render
from tinypipe.common.units import GIB

RESULT = RESULTS / "packing_attention.json"
ALIGN = 128  # the longest fitting sequence is rounded down to a multiple of this
# per device type: the block's shapes (TinyLlama-1.1B's on CUDA; half its width on 2 CPU cores), dtype, lengths
SHAPES: dict[str, dict[str, Any]] = {
    "cpu": {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4,
            "dtype": "float32", "seq_lens": [512, 1024, 2048], "modes": ["unpacked", "mask", "segments"]},
    "cuda": {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
             "dtype": "bfloat16", "seq_lens": [4096, 16384, 32768], "modes": ["unpacked", "mask", "segments", "flex"]},
}


def block_of(shape: dict[str, Any], device: torch.device) -> Block:
    """One Llama decoder block of `shape`, seeded random weights, on `device` in the shape's dtype."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
              "vocab_size": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
              **{k: shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads")}}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(config))
        stack = build_model(str(path), seed=0, only={1}, dtype=getattr(torch, shape["dtype"]))
    block = stack.layers[1]
    assert isinstance(block, Block)
    return block.to(device)


def documents_of(seq_len: int, doc_tokens: int, device: torch.device) -> torch.Tensor:
    """[1, s] document ids of a packed window: lengths uniform in [d/2, 3d/2], seed 0, the last one cut."""
    g = torch.Generator().manual_seed(0)
    ids: list[int] = []
    while len(ids) < seq_len:
        n = int(torch.randint(doc_tokens // 2, doc_tokens * 3 // 2 + 1, (1,), generator=g))
        ids += [len(set(ids))] * max(1, n)
    return torch.tensor([ids[:seq_len]], device=device)


def call(block: Block, x: torch.Tensor, docs: torch.Tensor | None, grad: torch.Tensor) -> None:
    """One forward + backward of the block."""
    block(x, docs).backward(grad)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(fn: Any, device: torch.device) -> int:
    """Bytes allocated at `fn()`'s peak above those allocated before it (see the module docstring)."""
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measure(block: Block, modes: list[str], seq_len: int, hidden: int, args: argparse.Namespace,
            device: torch.device) -> list[dict[str, Any]]:
    """Every mode at one length: tokens/s, step time and peak bytes. The timed calls take turns between the
    modes (a machine whose load drifts slows them alike)."""
    dtype = next(block.parameters()).dtype
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, seq_len, hidden, device=device, dtype=dtype, generator=g).requires_grad_()
    grad = torch.randn(x.shape, device=device, dtype=dtype, generator=g)
    packed = documents_of(seq_len, args.doc_tokens, device)
    docs = {m: None if m == "unpacked" else packed for m in modes}

    def run(mode: str) -> None:
        block.packed_attention = None if mode == "unpacked" else mode
        call(block, x, docs[mode], grad)

    for mode in modes:
        for _ in range(args.warmup):
            run(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeat):
        for mode in modes:
            sync(device)
            t0 = time.perf_counter()
            run(mode)
            sync(device)
            times[mode].append(time.perf_counter() - t0)
    rows = []
    for mode in modes:
        step = min(times[mode])
        rows.append({"mode": mode, "seq_len": seq_len, "step_s": step, "tokens_per_s": seq_len / step,
                     "peak_bytes": peak_bytes(functools.partial(run, mode), device),
                     "documents": 1 if docs[mode] is None else len(packed[0].unique())})
    return rows


def longest_fitting(rows: list[dict[str, Any]], budget_bytes: float) -> dict[str, Any]:
    """peak(s) = a s + c s^2 through one mode's two longest measured lengths (c >= 0: with none, the line through
    the longest), and the largest s that keeps it within `budget_bytes`."""
    (s1, p1), (s2, p2) = sorted((float(r["seq_len"]), float(r["peak_bytes"])) for r in rows)[-2:]
    c = (p2 / s2 - p1 / s1) / (s2 - s1)  # p / s = a + c s
    a = p1 / s1 - c * s1
    if c <= 0:
        a, c = p2 / s2, 0.0
    longest = budget_bytes / a if c == 0 else (-a + math.sqrt(a * a + 4 * c * budget_bytes)) / (2 * c)
    return {"bytes_per_token": a, "bytes_per_token_squared": c, "longest_seq": int(longest // ALIGN * ALIGN)}


def describe(device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return f"{where}; torch {torch.__version__}, transformers {transformers.__version__}"


def report(entry: dict[str, Any]) -> None:
    rows = entry["rows"]
    base = {r["seq_len"]: r["tokens_per_s"] for r in rows if r["mode"] == "unpacked"}
    print(render(["seq len", "mode", "documents", "tokens/s", "vs unpacked", "step", "peak"],
                 [[r["seq_len"], r["mode"], r["documents"], f"{r['tokens_per_s']:,.0f}",
                   f"{r['tokens_per_s'] / base[r['seq_len']]:.2f}x" if r["seq_len"] in base else "-",
                   f"{r['step_s'] * 1e3:,.1f} ms", human_bytes(r["peak_bytes"])] for r in rows]))
    print(f"\nlongest sequence whose block forward + backward fits {entry['budget_gib']:g} GiB "
          "(peak = a s + c s^2 through the two longest lengths' peaks):")
    print(render(["mode", "a (B/token)", "c (B/token^2)", "longest s"],
                 [[m, f"{f['bytes_per_token']:,.0f}", f"{f['bytes_per_token_squared']:.2f}", f"{f['longest_seq']:,}"]
                  for m, f in entry["fits"].items()]))
    print(f"\npacked windows here take the `{entry['auto_path']}` path; 1-minute load average "
          f"{entry['load_avg_1min'][0]:.1f} at the start, {entry['load_avg_1min'][1]:.1f} at the end")


def save(kind: str, entry: dict[str, Any]) -> None:
    """Write this device type's entry into RESULT, keeping the other's."""
    old = json.loads(RESULT.read_text()) if RESULT.is_file() else {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({**old, kind: entry}, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--seq-lens", type=int, nargs="+", help="sequence lengths (default: the device's, see SHAPES)")
    ap.add_argument("--modes", nargs="+", choices=("unpacked", "mask", "segments", "flex"),
                    help="modes (default: the device's; flex needs CUDA)")
    ap.add_argument("--doc-tokens", type=int, default=512, help="mean document length in a packed window")
    ap.add_argument("--budget-gib", type=float, default=24.0, help="memory budget of the longest-sequence column")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per mode and length (the fastest is reported)")
    ap.add_argument("--warmup", type=int, help="untimed calls per mode first (default: 1 on the CPU, 2 on CUDA, "
                    "where the first compiles flex)")
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = 2 if args.device == "cuda" else 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("packing_attention: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if "flex" in (args.modes or []) and args.device == "cpu":
        print("packing_attention: flex has no backward on the CPU; run it with --device cuda", file=sys.stderr)
        return 2
    if args.doc_tokens < 2 or args.repeat < 1 or args.warmup < 0 or min(args.seq_lens or [1]) < 1:
        print("packing_attention: --doc-tokens >= 2, --repeat >= 1, --warmup >= 0, --seq-lens >= 1", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    shape = SHAPES[args.device]
    seq_lens, modes = args.seq_lens or shape["seq_lens"], args.modes or shape["modes"]
    if len(set(seq_lens)) < 2:
        print("packing_attention: --seq-lens needs two lengths or more (the memory fit)", file=sys.stderr)
        return 2
    print(f"packing_attention on {describe(device)}: a Llama block, hidden {shape['hidden_size']}, "
          f"{shape['num_attention_heads']} heads ({shape['num_key_value_heads']} kv), {shape['dtype']}")
    start = time.perf_counter()
    block = block_of(shape, device)
    load = os.getloadavg()[0]
    rows = []
    for s in seq_lens:
        rows += measure(block, modes, s, shape["hidden_size"], args, device)
        print(f"  {s:,} tokens measured, {time.perf_counter() - start:.0f} s", flush=True)
    block.packed_attention = None
    entry = {"machine": machine(), "device": describe(device), "torch": torch.__version__,
             "transformers": transformers.__version__, "shape": shape, "doc_tokens": args.doc_tokens,
             "repeat": args.repeat, "warmup": args.warmup, "budget_gib": args.budget_gib,
             "auto_path": block.attention_path(device), "rows": rows, "load_avg_1min": [load, os.getloadavg()[0]],
             "fits": {m: longest_fitting([r for r in rows if r["mode"] == m], args.budget_gib * GIB) for m in modes},
             "wall_s": time.perf_counter() - start}
    report(entry)
    save(args.device, entry)
    print(f"\n{time.perf_counter() - start:.0f} s; wrote {RESULT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
