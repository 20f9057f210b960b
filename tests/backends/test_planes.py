"""The compact layout's 16-bit planes: exact round trip, the bf16 view, and a chunked AdamW step that
equals the reference's AdamW (`layer_adamw`) bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tinypipe.backends.host.planes import (  # noqa: E402
    MOVES,
    compact_adamw_step,
    hi_as_bf16,
    join,
    split,
    unfused_compact_adamw_step,
    workspace_elems,
)
from tinypipe.backends.host.torch_adamw import layer_adamw  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors, many small operators: one thread

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
SPECIALS = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 1e-40, -3e-39,
            1.17549435e-38, 3.4028235e38, -3.4028235e38, 65504.0, 1.0 + 2**-23, -(1.0 + 2**-23)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _values(n: int, seed: int) -> torch.Tensor:
    """n fp32 values from random bit patterns (every sign, exponent, denormal, inf, NaN payload),
    with the named special values at the front."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g).view(torch.float32)
    special = torch.tensor(SPECIALS[:n], dtype=torch.float32)
    x[:special.numel()] = special
    if n >= special.numel() + 3:  # NaN payloads (quiet, signed) and the smallest denormal, as bits
        x[special.numel():special.numel() + 3].view(torch.int32)[:] = torch.tensor([0x7FC00001, -0x003FFFFF, 1])
    return x


def _planes(n: int, dtype: torch.dtype = torch.int16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)


@pytest.mark.parametrize("n", [1, 7, 100_003])
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16])
def test_split_then_join_is_bit_exact(n: int, dtype: torch.dtype) -> None:
    """join(split(x)) has the bits of x for every pattern (negative, denormal, ±inf, NaN payloads),
    and the planes are x's upper and lower 16 bits, whatever the chunk."""
    x = _values(n, seed=n)
    hi, lo = _planes(n, dtype)
    split(x, hi, lo, chunk_elems=4096)
    words = x.view(torch.int16).view(-1, 2)  # little-endian: [low half, high half]
    assert torch.equal(hi.view(torch.int16), words[:, 1]) and torch.equal(lo.view(torch.int16), words[:, 0])
    out = torch.full((n,), 7.0)
    assert join(hi, lo, out, chunk_elems=1000) is out
    assert torch.equal(_bits(out), _bits(x))


def test_hi_as_bf16_is_a_zero_copy_truncation() -> None:
    """The high plane read as bf16 is the master truncated toward zero (not rounded), with no copy."""
    x = torch.randn(10_001) * 1000
    x[:len(SPECIALS)] = torch.tensor(SPECIALS)
    hi, lo = _planes(x.numel())
    split(x, hi, lo)
    up = hi_as_bf16(hi)
    assert up.dtype == torch.bfloat16 and up.data_ptr() == hi.data_ptr()
    truncated = (_bits(x) & ~0xFFFF).view(torch.float32)
    assert torch.equal(up.float().view(torch.int32), _bits(truncated))
    finite = torch.isfinite(x)
    assert bool((up.float()[finite].abs() <= x[finite].abs()).all())


@pytest.mark.parametrize("moves", MOVES)
@pytest.mark.parametrize("n,chunk,threads", [(1, 64, 1), (7, 64, 1), (7, 4096, 1), (100_003, 4096, 1),
                                             (100_003, 100, 1), (100_003, 1 << 20, 1), (100_003, 16_000, 2)])
def test_chunked_step_equals_reference_adamw(n: int, chunk: int, threads: int, moves: str) -> None:
    """Three chunked steps on the planes leave the same master, moments bit for bit as the
    reference's AdamW (fused on CPU) on the joined fp32 tensor, with either way of moving the
    planes' bits; so does the unfused step. With two threads too: torch splits its fused kernel
    among threads on 16-element boundaries."""
    torch.set_num_threads(threads)  # the one_thread fixture restores the count
    g = torch.Generator().manual_seed(n + chunk)
    x = torch.randn(n, generator=g)
    x[:3] = torch.tensor([0.0, -1e-40, 3e-39])[:n]  # a zero and denormals
    grads = [torch.randn(n, generator=g) * 1e-2 for _ in range(3)]
    param = torch.nn.Parameter(x.clone())
    opt = layer_adamw([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"])
    hi, lo = _planes(n)
    split(x, hi, lo)
    m, v = torch.zeros(n), torch.zeros(n)
    hi2, lo2 = hi.clone(), lo.clone()
    m2, v2 = torch.zeros(n), torch.zeros(n)
    scratch = torch.empty(workspace_elems(chunk))
    for step, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        opt.step()
        compact_adamw_step(hi, lo, grad, m, v, step=step, chunk_elems=chunk, scratch=scratch, moves=moves, **HYPER)
        unfused_compact_adamw_step(hi2, lo2, grad, m2, v2, step=step, **HYPER)
        joined = join(hi, lo, torch.empty(n))
        assert torch.equal(_bits(joined), _bits(param.detach())), f"master differs after step {step}"
    state = opt.state[param]
    assert torch.equal(_bits(m), _bits(state["exp_avg"])) and torch.equal(_bits(v), _bits(state["exp_avg_sq"]))
    assert torch.equal(hi2, hi) and torch.equal(lo2, lo) and torch.equal(m2, m) and torch.equal(v2, v)


def test_unaligned_chunk_sizes_are_rounded_up() -> None:
    """A chunk size that is no multiple of 64 is rounded up, so the step still matches the reference
    (torch's vector lanes and scalar tail round differently: chunks of 13 would differ from step 2 on)."""
    n = 20_000
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g)
    hi, lo = _planes(n)
    split(x, hi, lo)
    m, v = torch.zeros(n), torch.zeros(n)
    param = torch.nn.Parameter(x.clone())
    opt = layer_adamw([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"])
    for step in range(1, 4):
        grad = torch.randn(n, generator=g)
        compact_adamw_step(hi, lo, grad, m, v, step=step, chunk_elems=13, **HYPER)
        param.grad = grad
        opt.step()
    assert torch.equal(_bits(join(hi, lo, torch.empty(n))), _bits(param.detach()))
    assert torch.equal(_bits(v), _bits(opt.state[param]["exp_avg_sq"]))


def test_bad_arguments_say_what_is_wrong() -> None:
    """Mismatched planes, a wrong dtype, a too-small scratch or step 0 are refused with a clear message."""
    hi, lo = _planes(10)
    z = torch.zeros(10)
    with pytest.raises(ValueError, match="planes differ"):
        join(hi, lo[:9], z)
    with pytest.raises(TypeError, match="int16 or uint16"):
        hi_as_bf16(torch.zeros(3))
    with pytest.raises(ValueError, match="grad_fp32 must be"):
        compact_adamw_step(hi, lo, z.double(), z, z, step=1, **HYPER)
    with pytest.raises(ValueError, match="scratch must be"):
        compact_adamw_step(hi, lo, z, z, z, step=1, scratch=torch.empty(3), **HYPER)
    with pytest.raises(ValueError, match="1-based"):
        compact_adamw_step(hi, lo, z, z, z, step=0, **HYPER)
