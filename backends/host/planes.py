"""The compact host layout's fp32 master as two 16-bit planes, and AdamW over them in cache-sized chunks.

The fp32 master of a parameter is stored as two 16-bit planes (docs/architecture.md). The high plane holds the
upper 16 bits of every fp32 value, which is the bf16 bit pattern of the value truncated toward zero,
and is uploaded to the GPU as it is (`hi_as_bf16`, no copy); the low plane holds the lower 16 bits,
so `join` restores the fp32 master exactly and `split` stores it back. Planes are `torch.int16` (or
`torch.uint16`, same bits) tensors of the master's number of elements; little-endian hosts only.

The optimizer must see the fp32 master. Joining a whole parameter, running AdamW on it and splitting
it again (`unfused_compact_adamw_step`) makes three passes over DRAM where a plain AdamW makes one:
3.4x a plain fused AdamW at 2 threads. `compact_adamw_step` does the same work chunk by chunk
(join one chunk into a small fp32 scratch, update it with torch's fused CPU AdamW kernel, split it
back), so the scratch, the chunk of the planes and the chunk of the moments stay in cache between
the three steps and DRAM is crossed once, with the bytes of a plain fused AdamW (hi + lo = an fp32
master). No compiled extension: only torch operators, each vectorized. The price is six extra
in-cache passes (three to join, three to split), each about a cycle per element in torch, so the
chunked step measures ~1.6-2x a plain fused AdamW at 16-32 threads and ~2.3x at 1-2 threads, against
~2.4-3.8x unfused (docs/performance.md); near 1x needs a compiled fused kernel.

Bit-exactness: the update equals `torch.optim.AdamW(fused=True)` (the reference's `layer_adamw`) on
the joined fp32 tensor bit for bit, provided chunks start at multiples of 64 elements from the start
of that tensor. torch's CPU kernel computes vector lanes and the scalar tail with different rounding,
and it splits work among threads on 16-element (64-byte) boundaries; aligned chunks give every
element the same path as the whole-tensor call. So call the step once per parameter tensor (its own
planes, gradient and moments), never on a slice that starts mid-tensor at an unaligned offset.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

# One chunk: 4M elements, i.e. 16 MiB of fp32 scratch + 16 MiB of int32 temporary + 16 MiB of the two
# planes (workspace: 32 MiB per optimizer thread). Measured with 64M params:
# the best chunk at 32 threads on a 32-core H200 host (2 MiB L2 a core, 300 MiB L3) and at 1-2
# threads on a 2-core VM (480 MiB L3); within ~10% of the best at 2-16 threads elsewhere (1M or 256K
# won there), ~15% behind 64K at 1 thread on the H200 host. Smaller chunks lose to the fixed cost of
# each parallel operator (7 per chunk; 64K chunks cost 7-12x a plain AdamW at 8-32 threads). On a
# host whose last-level cache is well under 48 MiB, pass chunk_elems=1 << 20.
DEFAULT_CHUNK_ELEMS = 1 << 22
# Chunk starts are multiples of this many elements, so that each element takes the same code path in
# torch's fused CPU AdamW (vector lanes vs scalar tail, 16-element thread split) as in the whole call.
CHUNK_ALIGN_ELEMS = 64
# How a chunk is joined and split (`_MOVES`). "shift": contiguous passes (bf16 widening,
# zero-extension, or; narrowing, shift, narrowing), 3 each way. "strided": 2 strided copies each way.
# On the H200 host at 15 threads the chunked step took 2.1x a plain fused AdamW with "shift" and 3.1x
# with "strided", so "shift" is the default.
BIT_MOVES = "shift"
_PLANE_DTYPES = (torch.int16, torch.uint16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # gradients as they land on the host


def split(master_fp32: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, *,
          chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> None:
    """Write the high (upper 16 bits: the truncated bf16 pattern) and low planes of fp32 `master_fp32`.

    Works through `chunk_elems` at a time so its int32 temporary stays small; any shape, contiguous.
    """
    n = _check_planes(hi, lo)
    src = _flat(master_fp32, torch.float32, n, "master_fp32")
    h, low = _i16(hi), _i16(lo)
    c = _chunk(chunk_elems, n)
    tmp = torch.empty(c, dtype=torch.int32)
    bits = src.view(torch.int32)
    for s in range(0, n, c):
        e = min(n, s + c)
        low[s:e].copy_(bits[s:e])  # int32 -> int16 keeps the low 16 bits
        h[s:e].copy_(torch.bitwise_right_shift(bits[s:e], 16, out=tmp[:e - s]))


def join(hi: torch.Tensor, lo: torch.Tensor, out_fp32: torch.Tensor, *,
         chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> torch.Tensor:
    """fp32 `out_fp32` <- the planes, bit-exact inverse of `split` (NaN payloads, denormals, -0.0 too).

    Returns `out_fp32`. Works through `chunk_elems` at a time so its int32 temporary stays small.
    """
    n = _check_planes(hi, lo)
    out = _flat(out_fp32, torch.float32, n, "out_fp32")
    h, low = _i16(hi), _i16(lo)
    c = _chunk(chunk_elems, n)
    tmp = torch.empty(c, dtype=torch.int32)
    for s in range(0, n, c):
        e = min(n, s + c)
        _join_into(h[s:e], low[s:e], out[s:e], tmp[:e - s])
    return out_fp32


def hi_as_bf16(hi: torch.Tensor) -> torch.Tensor:
    """The high plane seen as bf16 (no copy): the master truncated to bf16, what gets uploaded."""
    if hi.dtype not in _PLANE_DTYPES:
        raise TypeError(f"a plane must be int16 or uint16, got {hi.dtype}")
    return hi.view(torch.bfloat16)


def compact_adamw_step(hi: torch.Tensor, lo: torch.Tensor, grad_fp32: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
                       scratch: torch.Tensor | None = None, moves: str = BIT_MOVES) -> None:
    """One AdamW update of the fp32 master held in the planes, chunk by chunk, in place.

    `step` is the update's 1-based number (torch's `state["step"]` after its increment); `exp_avg`
    and `exp_avg_sq` are the fp32 moments, updated in place; `grad_fp32` is read only: fp32, or the
    bf16 / fp16 gradient as it left the GPU (widened to fp32 chunk by chunk, which is exact). Bit-identical
    to `torch.optim.AdamW(fused=True)` with the same hyperparameters on the joined tensor (see the
    module docstring for the alignment this needs). `scratch`: optional fp32 workspace of at least
    `workspace_elems(chunk_elems)` elements, reused across calls (one per optimizer thread).
    `moves`: how a chunk is joined and split (`BIT_MOVES`); both are exact.
    """
    if moves not in _MOVES:
        raise ValueError(f"moves must be one of {', '.join(MOVES)}, got {moves!r}")
    join_chunk, split_chunk = _MOVES[moves]
    n = _check_planes(hi, lo)
    g = _flat(grad_fp32, grad_fp32.dtype if grad_fp32.dtype in _GRAD_DTYPES else torch.float32, n, "grad_fp32")
    m = _flat(exp_avg, torch.float32, n, "exp_avg")
    v = _flat(exp_avg_sq, torch.float32, n, "exp_avg_sq")
    if step < 1:
        raise ValueError(f"step is the 1-based number of this update, got {step}")
    h, low = _i16(hi), _i16(lo)
    c = _chunk(chunk_elems, n)
    master, tmp, wide = _workspace(scratch, c)
    step_t = torch.tensor(float(step), dtype=torch.float32)  # torch's fused AdamW keeps steps as fp32
    for s in range(0, n, c):
        e = min(n, s + c)
        k = e - s
        x = master[:k]
        join_chunk(h[s:e], low[s:e], x, tmp[:k])
        gc = g[s:e] if g.dtype == torch.float32 else wide[:k].copy_(g[s:e])
        torch._fused_adamw_([x], [gc], [m[s:e]], [v[s:e]], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        split_chunk(x, h[s:e], low[s:e])


def unfused_compact_adamw_step(hi: torch.Tensor, lo: torch.Tensor, grad_fp32: torch.Tensor, exp_avg: torch.Tensor,
                               exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                               eps: float, weight_decay: float, master: torch.Tensor | None = None) -> None:
    """The same update as `compact_adamw_step` as three whole passes: join all, AdamW all, split all.

    `master`: optional fp32 buffer of the parameter's size to join into (allocated if None). For
    comparison; bit-identical to the chunked step.
    """
    n = _check_planes(hi, lo)
    if step < 1:
        raise ValueError(f"step is the 1-based number of this update, got {step}")
    x = torch.empty(n, dtype=torch.float32) if master is None else _flat(master, torch.float32, n, "master")
    join(hi, lo, x)
    torch._fused_adamw_([x], [_flat(grad_fp32, torch.float32, n, "grad_fp32")],
                        [_flat(exp_avg, torch.float32, n, "exp_avg")],
                        [_flat(exp_avg_sq, torch.float32, n, "exp_avg_sq")], [],
                        [torch.tensor(float(step), dtype=torch.float32)], lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    split(x, hi, lo)


def workspace_elems(chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> int:
    """fp32 elements of the scratch `compact_adamw_step` needs for `chunk_elems` (master, int32 temp,
    and the widened gradient when it arrives in bf16 / fp16)."""
    return 3 * _aligned(chunk_elems)


def _join_into(h: torch.Tensor, low: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> None:
    """fp32 `out` <- planes, in three vectorized passes over a chunk (no strided copies)."""
    _join_viewed(h.view(torch.bfloat16), low.view(torch.uint16), out, out.view(torch.int32), tmp)


def _join_viewed(h_bf16: torch.Tensor, low_u16: torch.Tensor, out: torch.Tensor, out_bits: torch.Tensor,
                 tmp: torch.Tensor) -> None:
    """`_join_into` on views made beforehand (the high plane as bf16, the low one as uint16, `out` as int32).

    bf16 -> fp32 conversion is exactly `bits << 16`, so it places the high plane; the low plane is
    zero-extended (read as uint16) into int32 and or-ed in.
    """
    out.copy_(h_bf16)
    tmp.copy_(low_u16)
    out_bits.bitwise_or_(tmp)


def _join_strided(h: torch.Tensor, low: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> None:
    """fp32 `out` <- planes in two strided copies: each plane into its half of every 32-bit word
    (`tmp` unused: the signature of `_join_into`)."""
    words = out.view(torch.int16).view(-1, 2)  # little-endian: [low half, high half]
    words[:, 0].copy_(low)
    words[:, 1].copy_(h)


def _split_strided(x: torch.Tensor, h: torch.Tensor, low: torch.Tensor) -> None:
    """Planes <- fp32 `x` in two strided copies (x is left as it was)."""
    words = x.view(torch.int16).view(-1, 2)
    low.copy_(words[:, 0])
    h.copy_(words[:, 1])


def _split_consuming(x32: torch.Tensor, h: torch.Tensor, low: torch.Tensor) -> None:
    """Planes <- int32 bits `x32`, which it overwrites: int32 -> int16 conversion keeps the low 16 bits."""
    low.copy_(x32)
    x32.bitwise_right_shift_(_SIXTEEN)
    h.copy_(x32)


# 16 as a 0-dim tensor: torch wraps a Python number in a new tensor at every call (a few µs), which shows
# in the low-precision step's short chunks (backends/host/moments.py)
_SIXTEEN = torch.tensor(16, dtype=torch.int32)


def _split_shift(x: torch.Tensor, h: torch.Tensor, low: torch.Tensor) -> None:
    """Planes <- fp32 `x` by narrowing and shifting its bits (x is overwritten)."""
    _split_consuming(x.view(torch.int32), h, low)


# moves -> (join a chunk into its fp32 scratch, split the scratch back into the planes)
_MOVES: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
                        Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]]] = {
    "shift": (_join_into, _split_shift), "strided": (_join_strided, _split_strided)}
MOVES = tuple(_MOVES)


def _workspace(scratch: torch.Tensor | None, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if scratch is None:
        scratch = torch.empty(3 * c, dtype=torch.float32)
    if scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.numel() < 3 * c:
        raise ValueError(f"scratch must be a contiguous fp32 tensor of >= {3 * c} elements "
                         f"(workspace_elems(chunk_elems)), got {scratch.dtype} with {scratch.numel()}")
    flat = scratch.view(-1)
    return flat[:c], flat[c:2 * c].view(torch.int32), flat[2 * c:3 * c]


def _aligned(chunk_elems: int) -> int:
    """`chunk_elems` rounded up to a multiple of CHUNK_ALIGN_ELEMS."""
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be positive, got {chunk_elems}")
    return -(-chunk_elems // CHUNK_ALIGN_ELEMS) * CHUNK_ALIGN_ELEMS


def _chunk(chunk_elems: int, n: int) -> int:
    """Chunk length for n elements: `chunk_elems` aligned, no longer than n (at least 1)."""
    return max(1, min(_aligned(chunk_elems), n))


def _i16(plane: torch.Tensor) -> torch.Tensor:
    return plane.view(-1).view(torch.int16)


def _check_planes(hi: torch.Tensor, lo: torch.Tensor) -> int:
    if sys.byteorder != "little":  # pragma: no cover - the planes assume little-endian fp32
        raise RuntimeError("the compact host memory layout needs a little-endian host")
    for name, t in (("hi", hi), ("lo", lo)):
        if t.dtype not in _PLANE_DTYPES:
            raise TypeError(f"plane {name} must be int16 or uint16, got {t.dtype}")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"plane {name} must be a contiguous CPU tensor")
    if hi.numel() != lo.numel():
        raise ValueError(f"planes differ in size: hi {hi.numel()}, lo {lo.numel()} elements")
    return hi.numel()


def _flat(t: torch.Tensor, dtype: torch.dtype, n: int, name: str) -> torch.Tensor:
    if t.dtype != dtype or t.numel() != n or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of {n} elements, "
                         f"got {t.dtype} with {t.numel()} on {t.device}")
    return t.view(-1)
