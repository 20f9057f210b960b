"""AdamW on the compact planes with low-precision moments (bf16, or 8-bit block-wise), chunk by chunk.

One fused pass per chunk of a parameter tensor, in cache: join the chunk's planes into fp32, widen its
moments to fp32, run torch's fused CPU AdamW kernel on the chunk (the same arithmetic as the fp32 step),
narrow the moments back and split the master into the planes. The master stays exactly fp32; only the
moments are rounded, once per step.

- bf16: each moment rounded to the nearest bf16 (torch's fp32 -> bf16 conversion).
- 8bit: Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization" (arXiv:2110.02861), with
  blocks of `hostmem.QUANT_BLOCK_ELEMS` (256, torchao's choice; the paper uses 2048): per block the
  absmax in fp32, per element the index of the nearest value of the dynamic tree map (Dettmers 2016,
  arXiv:1511.04561) scaled by it: the signed map for the first moment, the unsigned one for the second
  (as bitsandbytes' 8-bit Adam). Nearest-value search is one table look-up: the top 20 bits of the
  normalised fp32 value index `_nearest_table`, built once per map by binary search at the middle of
  each 20-bit interval (2^-12 relative), so no element is searched at run time.

The quantised state is plain tensors (uint8 codes, fp32 absmax), so a checkpoint holds it exactly.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from tinypipe.estimate.hostmem import QUANT_BLOCK_ELEMS
from tinypipe.policy.modes import OptimizerState

from . import planes

TABLE_BITS = 20  # of the fp32 pattern that index the nearest-code table (sign, exponent, 11 mantissa bits)
_SHIFT = 32 - TABLE_BITS
# A chunk: 1M elements (a multiple of the block and of planes.CHUNK_ALIGN_ELEMS); its fp32 workspace (master,
# int32 temporary, widened gradient, two moments) is 20 MiB per optimizer thread.
DEFAULT_CHUNK_ELEMS = 1 << 20


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted values of the dynamic tree map (Dettmers 2016): per decade 10^-6 .. 10^0 a linear
    fraction with twice the values of the decade below (signed: mirrored), plus 0 and 1."""
    values: list[float] = [0.0, 1.0]
    for i in range(7):
        items = 2 ** i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, items + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += mids
        if signed:
            values += [-v for v in mids]
    out = torch.tensor(sorted(values), dtype=torch.float32)
    assert out.numel() == 256, out.numel()
    return out


@lru_cache(maxsize=2)
def _maps(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the map's values, the uint8 nearest-code table over the top TABLE_BITS of an fp32 pattern)."""
    code = dynamic_map(signed)
    mids = (code[1:].double() + code[:-1].double()) / 2
    patterns = torch.arange(1 << TABLE_BITS, dtype=torch.int64)
    bits = ((patterns << _SHIFT) | (1 << (_SHIFT - 1))).to(torch.int64)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)  # as signed 32-bit words
    x = bits.view(torch.float32).double()
    x = torch.nan_to_num(x, nan=0.0).clamp(-1.0 if signed else 0.0, 1.0)
    table = torch.bucketize(x, mids).to(torch.uint8)
    return code, table


def state_shapes(numel: int, state: OptimizerState) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors (name -> (shape, dtype)) that hold one parameter's moments under `state`."""
    state = OptimizerState(state)
    if state == OptimizerState.FP32:
        return {"exp_avg": ((numel,), torch.float32), "exp_avg_sq": ((numel,), torch.float32)}
    if state == OptimizerState.BF16:
        return {"exp_avg": ((numel,), torch.bfloat16), "exp_avg_sq": ((numel,), torch.bfloat16)}
    blocks = -(-numel // QUANT_BLOCK_ELEMS)
    return {"exp_avg": ((blocks * QUANT_BLOCK_ELEMS,), torch.uint8),
            "exp_avg_sq": ((blocks * QUANT_BLOCK_ELEMS,), torch.uint8),
            "exp_avg_absmax": ((blocks,), torch.float32), "exp_avg_sq_absmax": ((blocks,), torch.float32)}


def zero_state(numel: int, state: OptimizerState) -> dict[str, torch.Tensor]:
    """Fresh moments (zeros) of one parameter under `state`; 8bit: code of 0.0 in each map, absmax 0."""
    out = {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in state_shapes(numel, state).items()}
    if OptimizerState(state) == OptimizerState.INT8:
        out["exp_avg"].fill_(int((_maps(True)[0] == 0).nonzero()[0]))
        out["exp_avg_sq"].fill_(int((_maps(False)[0] == 0).nonzero()[0]))
    return out


def workspace_elems(chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> int:
    """fp32 elements of the scratch `lowp_adamw_step` needs for chunks of `chunk_elems`."""
    return 5 * _chunk(chunk_elems, chunk_elems)


def lowp_adamw_step(hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, moments: dict[str, torch.Tensor], *,
                    state: OptimizerState, step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
                    scratch: torch.Tensor | None = None, threads: int | None = None) -> None:
    """One AdamW update of the fp32 master in the planes `hi`/`lo` with moments held as `state` (bf16 or
    8bit, `zero_state`'s tensors), in place. `grad`: fp32, bf16 or fp16, read only. `step`: 1-based.
    `scratch`: fp32 workspace of >= `workspace_elems(chunk_elems)` elements, reused across calls (the
    calling thread's). `threads` (default: torch's intra-op threads of the caller): chunks run side by side
    on that many threads of a pool, each running its chunk's operators on one core (torch's table look-ups
    run on one thread whatever the intra-op setting, so chunks, not operators, are what spread); every
    chunk's arithmetic is the same on any thread, so the result does not depend on `threads`."""
    state = OptimizerState(state)
    if state.exact:
        raise ValueError("fp32 moments take planes.compact_adamw_step")
    if step < 1:
        raise ValueError(f"step is the 1-based number of this update, got {step}")
    n = hi.numel()
    c = _chunk(chunk_elems, n)
    if scratch is None:
        scratch = torch.empty(5 * c, dtype=torch.float32)
    if scratch.numel() < 5 * c:
        raise ValueError(f"scratch: needs {5 * c} fp32 elements, got {scratch.numel()}")
    job = _Step(hi.view(-1).view(torch.int16), lo.view(-1).view(torch.int16), grad.reshape(-1), moments, state,
                torch.tensor(float(step), dtype=torch.float32), c,
                {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay, "eps": eps})
    starts = list(range(0, n, c))
    threads = torch.get_num_threads() if threads is None else threads
    if threads <= 1 or len(starts) == 1:
        for s in starts:
            job.chunk(s, scratch)
        return
    pool = _pool(threads)
    for f in [pool.submit(_on_pool_thread, job, s) for s in starts]:
        f.result()


class _Step:
    """One parameter's update, chunk by chunk: `chunk(start, scratch)` does elements start..start+c."""

    def __init__(self, h: torch.Tensor, low: torch.Tensor, g: torch.Tensor, moments: dict[str, torch.Tensor],
                 state: OptimizerState, step_t: torch.Tensor, c: int, hp: dict[str, float]) -> None:
        self.h, self.low, self.g, self.moments, self.state = h, low, g, moments, state
        self.step_t, self.c, self.hp = step_t, c, hp

    def chunk(self, s: int, scratch: torch.Tensor) -> None:
        c, n = self.c, self.h.numel()
        ws = scratch.view(-1)
        master, wide, m32, v32 = ws[:c], ws[c:2 * c], ws[2 * c:3 * c], ws[3 * c:4 * c]
        tmp = ws[4 * c:5 * c].view(torch.int32)
        e = min(n, s + c)
        k = e - s
        x = master[:k]
        planes._join_into(self.h[s:e], self.low[s:e], x, tmp[:k])
        g = self.g
        gc = g[s:e] if g.dtype == torch.float32 else wide[:k].copy_(g[s:e])
        kb = _widen(self.moments, self.state, s, k, m32, v32, tmp)
        hp = self.hp
        torch._fused_adamw_([x], [gc], [m32[:k]], [v32[:k]], [], [self.step_t], lr=hp["lr"], beta1=hp["beta1"],
                            beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=False,
                            maximize=False)
        _narrow(self.moments, self.state, s, k, kb, m32, v32, tmp)
        planes._split_shift(x, self.h[s:e], self.low[s:e])


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()  # ranks run as threads in tests: one pool per size, made once
_LOCAL = threading.local()
_WORKSPACES: list[torch.Tensor] = []  # every pool thread's workspace (`pool_workspace_bytes`)


def _pool(threads: int) -> ThreadPoolExecutor:
    """A pool of `threads` threads, each running torch operators on one core (made once per size)."""
    with _POOLS_LOCK:
        if threads not in _POOLS:
            _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tinypipe-moments",
                                                 initializer=torch.set_num_threads, initargs=(1,))
        return _POOLS[threads]


def _on_pool_thread(job: _Step, s: int) -> None:
    """Run one chunk with this pool thread's own workspace (grown to the job's chunk when needed)."""
    ws = getattr(_LOCAL, "scratch", None)
    if ws is None or ws.numel() < 5 * job.c:
        if ws is not None:
            _WORKSPACES[:] = [w for w in _WORKSPACES if w is not ws]
        ws = _LOCAL.scratch = torch.empty(5 * job.c, dtype=torch.float32)
        _WORKSPACES.append(ws)
    job.chunk(s, ws)


def pool_workspace_bytes() -> int:
    """Bytes of the pool threads' workspaces (20 MiB each at the default chunk), held for the process's life."""
    return sum(w.numel() * w.element_size() for w in list(_WORKSPACES))


def _chunk(chunk_elems: int, n: int) -> int:
    """Chunk length: `chunk_elems` rounded up to whole blocks, no longer than n rounded up to a block."""
    b = QUANT_BLOCK_ELEMS
    return max(b, min(-(-chunk_elems // b) * b, -(-n // b) * b))


def _widen(moments: dict[str, torch.Tensor], state: OptimizerState, s: int, k: int, m32: torch.Tensor,
           v32: torch.Tensor, tmp: torch.Tensor) -> int:
    """fp32 moments of elements s..s+k into m32, v32; returns the elements covered (8bit: whole blocks)."""
    if state == OptimizerState.BF16:
        m32[:k].copy_(moments["exp_avg"][s:s + k])
        v32[:k].copy_(moments["exp_avg_sq"][s:s + k])
        return k
    b = QUANT_BLOCK_ELEMS
    kb = -(-k // b) * b
    for key, out, signed in (("exp_avg", m32, True), ("exp_avg_sq", v32, False)):
        code = _maps(signed)[0]
        idx = tmp[:kb]
        idx.copy_(moments[key][s:s + kb])
        torch.index_select(code, 0, idx, out=out[:kb])
        out[:kb].view(-1, b).mul_(moments[key + "_absmax"][s // b:(s + kb) // b].unsqueeze(1))
    return kb


def _narrow(moments: dict[str, torch.Tensor], state: OptimizerState, s: int, k: int, kb: int, m32: torch.Tensor,
            v32: torch.Tensor, tmp: torch.Tensor) -> None:
    """Store fp32 moments m32, v32 of elements s..s+k back as `state` (8bit: requantised by block)."""
    if state == OptimizerState.BF16:
        moments["exp_avg"][s:s + k].copy_(m32[:k])
        moments["exp_avg_sq"][s:s + k].copy_(v32[:k])
        return
    b = QUANT_BLOCK_ELEMS
    for key, src, signed in (("exp_avg", m32, True), ("exp_avg_sq", v32, False)):
        table = _maps(signed)[1]
        if kb > k:
            src[k:kb].zero_()  # the tail of a tensor's last block: zeros, which quantise to 0
        blocks = src[:kb].view(-1, b)
        absmax = moments[key + "_absmax"][s // b:(s + kb) // b]
        torch.amax(blocks, dim=1, out=absmax)
        if signed:  # max |x| as max(max x, -min x): two fast reductions, no |x| temporary
            torch.maximum(absmax, torch.amin(blocks, dim=1).neg_(), out=absmax)
        inv = torch.where(absmax > 0, absmax.reciprocal(), torch.zeros_like(absmax))
        blocks.mul_(inv.unsqueeze(1))
        bits = src[:kb].view(torch.int32)
        idx = tmp[:kb]
        torch.bitwise_right_shift(bits, _SHIFT, out=idx)
        idx.bitwise_and_((1 << TABLE_BITS) - 1)
        torch.index_select(table, 0, idx, out=moments[key][s:s + kb])
