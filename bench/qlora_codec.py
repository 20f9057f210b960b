"""NF4 through bitsandbytes beside torchao's NF4 tensor: quantise and dequantise time of one Llama-3.1-8B MLP matrix.

    python bench/qlora_codec.py [--device cpu|cuda] [--libraries bitsandbytes torchao] [--out FILE.json]

A 4096 x 14336 bf16 matrix (an 8B block's up projection), std 0.02; each library's NF4 at block 64 (torchao's
also quantises its per-block scales to int8 in blocks of 256), timed after one warm-up call, 3 repeats; the
round-trip error as ||W - dequant(quant(W))|| / ||W||, and the bytes a parameter the packed form holds. The
library that is not installed is skipped. backends/model/nf4.py says what was chosen from it and why (2-core CPU,
torch 2.13, idle: bitsandbytes 0.50.2 quantised in 2.3 s and dequantised in 33 ms; torchao 0.18.0 in 4.4 s and
334 ms; relative error 0.092 for both. With other work on the machine both took 3-4x longer, in the same ratio).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

ROWS, COLS = 4096, 14336
# (quantise, dequantise the packed form, bytes of the packed form)
Codec = tuple[Callable[[], Any], Callable[[Any], torch.Tensor], Callable[[Any], int]]


def timed(f: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    """(seconds per call, the last result) after one warm-up call."""
    out = f()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        out = f()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeat, out


def bitsandbytes_codec(w: torch.Tensor) -> Codec:
    from tinypipe.backends.model import nf4

    nf4.functional()  # ImportError here when bitsandbytes is not installed
    return (lambda: nf4.quantize(w), lambda p: nf4.dequantize(p[0], p[1], tuple(w.shape), w.dtype),
            lambda p: p[0].numel() + 4 * p[1].numel())


def torchao_codec(w: torch.Tensor) -> Codec:
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import to_nf4  # before torchao 0.15

    parts = ("quantized_data", "quantized_scalers", "quantization_factor", "nf4")
    return (lambda: to_nf4(w), lambda n: n.get_original_weight(),
            lambda n: sum(getattr(n, a).numel() * getattr(n, a).element_size() for a in parts))


def measure(name: str, w: torch.Tensor) -> dict[str, Any]:
    quant, dequant, nbytes = (bitsandbytes_codec if name == "bitsandbytes" else torchao_codec)(w)
    tq, packed = timed(quant)
    td, back = timed(lambda: dequant(packed))
    err = (back.float() - w.float()).norm() / w.float().norm()
    return {"library": name, "version": __import__(name).__version__, "quantise_s": tq, "dequantise_s": td,
            "bits_per_param": 8 * nbytes(packed) / w.numel(), "relative_error": float(err)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--libraries", nargs="+", default=["bitsandbytes", "torchao"])
    ap.add_argument("--out", default=None, help="write the rows as JSON here too")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(ROWS, COLS, generator=g) * 0.02).to(torch.bfloat16).to(args.device)
    rows = []
    for name in args.libraries:
        try:
            rows.append(measure(name, w))
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        r = rows[-1]
        print(f"{name} {r['version']}: quantise {r['quantise_s'] * 1e3:,.0f} ms, dequantise "
              f"{r['dequantise_s'] * 1e3:,.1f} ms, {r['bits_per_param']:.3f} bits/param, relative error "
              f"{r['relative_error']:.4f}")
    meta = {"device": args.device, "torch": torch.__version__, "shape": [ROWS, COLS], "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
