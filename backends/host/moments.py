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
  normalised fp32 value index a table (`maps`), built once per map by binary search at the middle of
  each 20-bit interval (2^-12 relative), so no element is searched at run time.

The quantised state is plain tensors (uint8 codes, fp32 absmax), so a checkpoint holds it exactly.

Only torch operators, each a vectorized pass over the chunk but the 8-bit step's four table look-ups
(`index_select`, torch's fastest CPU gather: a scalar loop, ~1 ns an element), which take about half of its
time. A chunk is ~30 operator calls (8bit; bf16 ~12): the views they take are made once per step and per
thread's workspace, not per chunk, since on a slow core a call costs microseconds (docs/memory.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from tinypipe.estimate.hostmem import QUANT_BLOCK_ELEMS
from tinypipe.policy.modes import OptimizerState

from . import planes

TABLE_BITS = 20  # of the fp32 pattern that index the nearest-code table (sign, exponent, 11 mantissa bits)
_SHIFT = 32 - TABLE_BITS
# A chunk: 256K elements (a multiple of the block and of planes.CHUNK_ALIGN_ELEMS); its workspace (master,
# two moments, an int32 temporary that holds the widened gradient while AdamW runs: 1 MiB each, and a
# reciprocal per block) is 4 MiB per optimizer thread. On the shared 2-core dev VM (512 KiB L2 a core, 32 MiB
# L3), 16M parameters, chunks of 64K to 1M elements: 128K-256K were the fastest at 1 and 2 threads for both
# precisions (1M: 8bit 0.8x and bf16 0.6x of 256K's rate at 1 thread; 64K: 0.9x, four times the calls).
# Each call also takes the GIL for its Python part, so with many pool threads a longer chunk may pay: not
# measured above 2 threads (bench/device/frugal_h200.sh measures 1-16 on the H200 host).
DEFAULT_CHUNK_ELEMS = 1 << 18


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
def maps(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
    if OptimizerState(state).quantised:
        out["exp_avg"].fill_(int((maps(True)[0] == 0).nonzero()[0]))
        out["exp_avg_sq"].fill_(int((maps(False)[0] == 0).nonzero()[0]))
    return out


def workspace_elems(chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> int:
    """fp32 elements of the scratch `lowp_adamw_step` needs for chunks of `chunk_elems`: the master, the two
    moments and an int32 temporary (in turn the widened gradient) of a chunk each, and a reciprocal per block."""
    c = _chunk(chunk_elems, chunk_elems)
    return 4 * c + c // QUANT_BLOCK_ELEMS


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
    need = workspace_elems(c)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.float32)
    if scratch.numel() < need:
        raise ValueError(f"scratch: needs {need} fp32 elements (workspace_elems(chunk_elems)), got {scratch.numel()}")
    job = _Step(hi.view(-1).view(torch.int16), lo.view(-1).view(torch.int16), grad.reshape(-1), moments, state,
                torch.tensor(float(step), dtype=torch.float32), c,
                {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay, "eps": eps})
    chunks = len(job.parts)
    threads = torch.get_num_threads() if threads is None else threads
    if threads <= 1:
        for i in range(chunks):
            job.chunk(i, scratch)
        return
    # on the pool even when there is one chunk: its operators then run on one core, not on an OpenMP team
    # whose every operator waits for the slowest of `threads` cores (on a loaded host, for a core taken away)
    workers, next_chunk = pool(threads), _Counter(chunks)
    for f in [workers.submit(_on_pool_thread, job, next_chunk) for _ in range(min(threads, chunks))]:
        f.result()


# The table's shift and mask as 0-dim tensors: torch wraps a Python number in a new tensor at every call
# (~4 µs each on the dev VM), which shows in a chunk of few operators.
_TABLE_SHIFT = torch.tensor(_SHIFT, dtype=torch.int32)
_TABLE_MASK = torch.tensor((1 << TABLE_BITS) - 1, dtype=torch.int32)


class _Step:
    """One parameter's update, chunk by chunk: `chunk(i, scratch)` does chunk i of `parts`."""

    def __init__(self, h: torch.Tensor, low: torch.Tensor, g: torch.Tensor, moments: dict[str, torch.Tensor],
                 state: OptimizerState, step_t: torch.Tensor, c: int, hp: dict[str, float]) -> None:
        self.state, self.step_t, self.c, self.hp = state, step_t, c, hp
        self.quantised = OptimizerState(state).quantised
        # Every chunk's views, made once per step (one `split` per tensor, not a slice per chunk and tensor):
        # hi as int16 and as bf16, lo as int16 and as uint16, grad, then bf16: m, v; 8bit: m codes,
        # v codes, m absmax, v absmax (as [blocks, 1] columns).
        if self.quantised:
            cb = c // QUANT_BLOCK_ELEMS
            held = [moments["exp_avg"].split(c), moments["exp_avg_sq"].split(c),
                    moments["exp_avg_absmax"].view(-1, 1).split(cb), moments["exp_avg_sq_absmax"].view(-1, 1).split(cb)]
            self.maps = (maps(True), maps(False))
        else:
            held = [moments["exp_avg"].split(c), moments["exp_avg_sq"].split(c)]
        self.parts = list(zip(h.split(c), h.view(torch.bfloat16).split(c), low.split(c),
                              low.view(torch.uint16).split(c), g.split(c), *held))

    def chunk(self, i: int, scratch: torch.Tensor) -> None:
        h, h_bf16, low, low_u16, g, *held = self.parts[i]
        w = _views(scratch, self.c, h.numel(), self.quantised)
        planes._join_viewed(h_bf16, low_u16, w.x, w.x32, w.tmp_k)
        if self.quantised:
            _dequantise(held, w, self.maps)
        else:
            w.m.copy_(held[0])
            w.v.copy_(held[1])
        gc = g if g.dtype == torch.float32 else w.wide.copy_(g)  # in the temporary: free until requantising
        hp = self.hp
        torch._fused_adamw_([w.x], [gc], [w.m], [w.v], [], [self.step_t], lr=hp["lr"], beta1=hp["beta1"],
                            beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=False,
                            maximize=False)
        if self.quantised:
            _quantise(held, w, self.maps)
        else:
            held[0].copy_(w.m)
            held[1].copy_(w.v)
        planes._split_consuming(w.x32, h, low)


class _Views:
    """A thread's scratch seen as one chunk's buffers, for a chunk of k elements (kb: k in whole blocks):
    the fp32 master `x` (and its bits `x32`), the moments `m`, `v` (k elements; the 8-bit step's `mb`, `vb`
    cover whole blocks, as [blocks, 256], and `mi`, `vi` are their bits), the int32 `tmp` and, in its place
    while AdamW runs, the widened gradient `wide`, and `inv`, a reciprocal per block."""

    def __init__(self, scratch: torch.Tensor, c: int, k: int, quantised: bool) -> None:
        b = QUANT_BLOCK_ELEMS
        kb = -(-k // b) * b if quantised else k
        ws = scratch.view(-1)
        self.x = ws[:k]
        self.x32 = self.x.view(torch.int32)
        m, v = ws[c:c + kb], ws[2 * c:2 * c + kb]
        self.m, self.v = m[:k], v[:k]
        self.wide = ws[3 * c:3 * c + k]
        self.tmp = ws[3 * c:3 * c + kb].view(torch.int32)
        self.tmp_k = self.tmp[:k]
        if quantised:
            self.m_all, self.v_all = m, v
            self.mb, self.vb = m.view(-1, b), v.view(-1, b)
            self.mi, self.vi = m.view(torch.int32), v.view(torch.int32)
            self.tails = (m[k:], v[k:]) if kb > k else ()
            self.inv = ws[4 * c:4 * c + kb // b].view(-1, 1)


def _views(scratch: torch.Tensor, c: int, k: int, quantised: bool) -> _Views:
    """This thread's `_Views` of `scratch` for a chunk of k (made once per scratch, chunk and length: a view
    is an operator call too)."""
    cache: tuple[torch.Tensor, dict[tuple[int, int, bool], _Views]] | None = getattr(_LOCAL, "views", None)
    if cache is None or cache[0] is not scratch or len(cache[1]) > 256:
        cache = _LOCAL.views = (scratch, {})
    key = (c, k, quantised)
    w = cache[1].get(key)
    if w is None:
        w = cache[1][key] = _Views(scratch, c, k, quantised)
    return w


_Maps = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (values, table) per map


def _dequantise(held: list[torch.Tensor], w: _Views, maps: _Maps) -> None:
    """fp32 moments (w.m_all, w.v_all) <- a chunk's codes (`held`: m codes, v codes, m absmax, v absmax) times
    their block's absmax: each code widened to an int32 index into its map's 256 values (`index_select`,
    torch's fastest CPU gather), then one multiply by the block's absmax."""
    for codes, absmax, (values, _), out, blocks in ((held[0], held[2], maps[0], w.m_all, w.mb),
                                                    (held[1], held[3], maps[1], w.v_all, w.vb)):
        w.tmp.copy_(codes)
        torch.index_select(values, 0, w.tmp, out=out)
        blocks.mul_(absmax)


def _quantise(held: list[torch.Tensor], w: _Views, maps: _Maps) -> None:
    """A chunk's codes and absmax (`held`) <- the fp32 moments, which are overwritten: per block the absmax,
    each value times its reciprocal (0 for a block whose absmax is 0, subnormal or NaN), and the top
    TABLE_BITS of that product's pattern index the nearest-code table."""
    for tail in w.tails:  # the tail of a tensor's last block: zeros, which quantise to 0
        tail.zero_()
    inv, tmp = w.inv, w.tmp
    for codes, absmax, (_, table), blocks, bits, signed in ((held[0], held[2], maps[0], w.mb, w.mi, True),
                                                             (held[1], held[3], maps[1], w.vb, w.vi, False)):
        torch.amax(blocks, dim=1, keepdim=True, out=absmax)
        if signed:  # max |x| as max(max x, -min x): two fast reductions, no |x| temporary
            torch.amin(blocks, dim=1, keepdim=True, out=inv)
            torch.maximum(absmax, inv.neg_(), out=absmax)
        # 1/absmax, and 0 where that is not finite: the codes are then those of x * 0 = 0, as the table gives
        # for x * inf (its entries for inf and NaN patterns are the code of 0)
        torch.reciprocal(absmax, out=inv).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        blocks.mul_(inv)
        torch.bitwise_right_shift(bits, _TABLE_SHIFT, out=tmp)
        if signed:
            tmp.bitwise_and_(_TABLE_MASK)
        else:  # v >= 0: its sign bit is clear, so the shift alone is the index
            try:
                torch.index_select(table, 0, tmp, out=codes)
                continue
            except IndexError:  # a NaN with its sign bit set (a diverged step): mask as for the signed map
                tmp.bitwise_and_(_TABLE_MASK)
        torch.index_select(table, 0, tmp, out=codes)


class _Counter:
    """The next chunk to do, handed out to the pool's threads one at a time (under a lock)."""

    def __init__(self, total: int) -> None:
        self._next, self._total, self._lock = 0, total, threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            if self._next >= self._total:
                return None
            self._next += 1
            return self._next - 1


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()  # ranks run as threads in tests: one pool per size, made once
_LOCAL = threading.local()
_WORKSPACES: list[torch.Tensor] = []  # every pool thread's workspace (`pool_workspace_bytes`)


def pool(threads: int) -> ThreadPoolExecutor:
    """A pool of `threads` threads, each running torch operators on one core (made once per size).

    torch.set_num_threads(1) in a pool thread also sets the count a thread new to torch starts with, process
    wide (torch keeps the last one set for them); so every pool thread is started here, at once, and that
    count put back as it was, which leaves other threads as they were."""
    with _POOLS_LOCK:
        if threads not in _POOLS:
            was = _on_new_thread(torch.get_num_threads) or 1
            pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tinypipe-moments",
                                      initializer=torch.set_num_threads, initargs=(1,))
            started = threading.Barrier(threads)
            for f in [pool.submit(started.wait) for _ in range(threads)]:  # each waits for all: one per thread
                f.result()
            _on_new_thread(lambda: torch.set_num_threads(was))
            _POOLS[threads] = pool
        return _POOLS[threads]


def _on_new_thread(fn: Callable[[], int | None]) -> int | None:
    """fn() on a thread of its own that has not run torch before (what torch gives such a thread)."""
    out: list[int | None] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _on_pool_thread(job: _Step, next_chunk: _Counter) -> None:
    """Run chunks of `job` until none is left, with this pool thread's own workspace (grown when needed)."""
    need = workspace_elems(job.c)
    ws = getattr(_LOCAL, "scratch", None)
    if ws is None or ws.numel() < need:
        if ws is not None:
            _WORKSPACES[:] = [w for w in _WORKSPACES if w is not ws]
        ws = _LOCAL.scratch = torch.empty(need, dtype=torch.float32)
        _WORKSPACES.append(ws)
    while (i := next_chunk.take()) is not None:
        job.chunk(i, ws)


def pool_workspace_bytes() -> int:
    """Bytes of the pool threads' workspaces (4 MiB each at the default chunk), held for the process's life."""
    return sum(w.numel() * w.element_size() for w in list(_WORKSPACES))


def _chunk(chunk_elems: int, n: int) -> int:
    """Chunk length: `chunk_elems` rounded up to whole blocks, no longer than n rounded up to a block."""
    b = QUANT_BLOCK_ELEMS
    return max(b, min(-(-chunk_elems // b) * b, -(-n // b) * b))
