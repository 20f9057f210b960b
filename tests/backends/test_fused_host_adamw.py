"""The host optimizer's one-pass kernel: fp32 moments bit for bit torch's fused AdamW, bf16 and 8-bit moments the
rules of the torch operators, the same bits on any thread count, and the torch operators wherever it cannot run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tinypipe.backends.host import fused_host_adamw as fha  # noqa: E402
from tinypipe.backends.host import moments, planes  # noqa: E402
from tinypipe.backends.host.layouts import make_host_state  # noqa: E402
from tinypipe.backends.host.state import AdamWConfig  # noqa: E402
from tinypipe.estimate.hostmem import QUANT_BLOCK_ELEMS  # noqa: E402
from tinypipe.policy.modes import HostMemory, OptimizerState  # noqa: E402

needs_kernel = pytest.mark.skipif(fha.kernel() is None, reason=f"the kernel is not built here: {fha.unavailable()}")


def _planes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi, lo = torch.empty(w.numel(), dtype=torch.int16), torch.empty(w.numel(), dtype=torch.int16)
    planes.split(w, hi, lo)
    return hi, lo


def _join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return planes.join(hi, lo, torch.empty(hi.numel()))


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 17, 1000, 70_001])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_moments_equal_torchs_fused_adamw_bit_for_bit(n: int, grad_dtype: torch.dtype,
                                                           weight_decay: float) -> None:
    """Three steps on the planes (sizes with and without torch's scalar tail, every gradient dtype, 3 threads)
    leave the master, m and v equal, bit for bit, to torch.optim.AdamW(fused=True) on the joined fp32 tensor."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, generator=gen)
    hi, lo = _planes(w)
    m, v = torch.zeros(n), torch.zeros(n)
    p = torch.nn.Parameter(w.clone())
    ref = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, fused=True)
    for t in range(1, 4):
        g = (torch.randn(n, generator=gen) * 0.1).to(grad_dtype)
        hp = fha.Hyper(step=t, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
        assert fha.run([fha.Job(hi, lo, g, {"exp_avg": m, "exp_avg_sq": v}, hp)], state=OptimizerState.FP32,
                       threads=3)
        p.grad = g.float()
        ref.step()
    st = ref.state[p]
    assert torch.equal(_join(hi, lo), p.detach())
    assert torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"])


@needs_kernel
@pytest.mark.parametrize("state", ["bf16", "8bit"])
@pytest.mark.parametrize("n", [5, 3 * QUANT_BLOCK_ELEMS + 77, 300_011])
def test_low_precision_moments_follow_the_torch_operators(state: str, n: int) -> None:
    """Three steps with bf16 or 8-bit moments against `moments.lowp_adamw_step` (the torch operators): equal bits
    on all elements before the tensor's last 16 (which torch computes in its scalar tail), and within the
    8-bit rule's tolerance there (masters to 1e-7, moments one code apart)."""
    st = OptimizerState(state)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(n, generator=gen) * 0.1
    hi, lo = _planes(w)
    hi2, lo2 = hi.clone(), lo.clone()
    held, held2 = moments.zero_state(n, st), moments.zero_state(n, st)
    for t in range(1, 4):
        g = (torch.randn(n, generator=gen) * 0.01).bfloat16()
        hp = fha.Hyper(step=t, lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01)
        assert fha.run([fha.Job(hi, lo, g, held, hp)], state=st, threads=2)
        moments.lowp_adamw_step(hi2, lo2, g, held2, state=st, step=t, lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-8,
                                weight_decay=0.01, threads=1)
    bulk = n - n % 16
    block_bulk = bulk // QUANT_BLOCK_ELEMS * QUANT_BLOCK_ELEMS  # blocks wholly before the tail
    assert torch.equal(hi[:bulk], hi2[:bulk]) and torch.equal(lo[:bulk], lo2[:bulk])
    torch.testing.assert_close(_join(hi, lo), _join(hi2, lo2), rtol=0, atol=1e-7)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(held[k][:block_bulk], held2[k][:block_bulk])
        assert int((held[k].float() - held2[k].float()).abs().max() if state == "8bit" else 0) <= 1


@needs_kernel
@pytest.mark.parametrize("state", list(OptimizerState))
def test_the_thread_count_does_not_change_the_bits(state: OptimizerState) -> None:
    """Ranges on 1, 2 and 5 threads (a tensor of several ranges, one of a partial block) leave the same bits."""
    n = 5 * fha.MIN_PART_ELEMS + 333
    gen = torch.Generator().manual_seed(5)
    w, g = torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 0.01).bfloat16()
    out = []
    for threads in (1, 2, 5):
        hi, lo = _planes(w)
        held = {k: t.view(-1) for k, t in moments.zero_state(n, state).items()}
        for t in (1, 2):
            hp = fha.Hyper(step=t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
            assert fha.run([fha.Job(hi, lo, g, held, hp)], state=state, threads=threads)
        out.append((hi, lo, held))
    for hi, lo, held in out[1:]:
        assert torch.equal(hi, out[0][0]) and torch.equal(lo, out[0][1])
        assert all(torch.equal(held[k], out[0][2][k]) for k in held)


def test_parts_cover_the_tensor_in_whole_blocks() -> None:
    """A tensor's ranges: consecutive, covering it, each a multiple of a block long but the last, one range for a
    tensor under two MIN_PART_ELEMS, and none for an empty one."""
    for n, threads in ((10, 4), (3 * fha.MIN_PART_ELEMS + 5, 4), (100 * fha.MIN_PART_ELEMS, 16)):
        parts = fha._parts(n, threads)
        assert parts[0][0] == 0 and parts[-1][1] == n and len(parts) <= threads
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all((e - s) % QUANT_BLOCK_ELEMS == 0 for s, e in parts[:-1])
    assert len(fha._parts(fha.MIN_PART_ELEMS, 8)) == 1 and fha._parts(0, 4) == []


def test_without_the_kernel_the_torch_operators_step_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """TINYPIPE_HOST_KERNEL=torch, or no C compiler: the kernel is unavailable and says why, `run` changes nothing
    and returns False, and a compact host state steps with the torch operators: the same bits as the kernel."""
    monkeypatch.setattr(fha, "_STATE", {})
    monkeypatch.setenv(fha.KERNEL_ENV, "torch")
    assert fha.kernel() is None and fha.name() == "torch" and "TINYPIPE_HOST_KERNEL=torch" in str(fha.unavailable())
    monkeypatch.setattr(fha, "_STATE", {})
    monkeypatch.delenv(fha.KERNEL_ENV)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    assert fha.kernel() is None and "no C compiler" in str(fha.unavailable())
    hi, lo = _planes(torch.ones(64))
    before = hi.clone()
    hp = fha.Hyper(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert not fha.run([fha.Job(hi, lo, torch.ones(64), {"exp_avg": torch.zeros(64), "exp_avg_sq": torch.zeros(64)},
                                hp)], state=OptimizerState.FP32)
    assert torch.equal(hi, before)
    torch_bits = _train_compact(OptimizerState.INT8, beta1=0.9)
    monkeypatch.setattr(fha, "_STATE", {})
    monkeypatch.undo()
    if fha.kernel() is not None:
        assert all(torch.equal(a, b) for a, b in zip(torch_bits, _train_compact(OptimizerState.INT8, beta1=0.9)))


def test_hyperparameters_outside_the_kernel_run_the_torch_operators() -> None:
    """beta1 = 0.3 (torch's other lerp branch): `run` declines, and a compact host state's step equals
    torch.optim.AdamW(fused=True) all the same."""
    hp = fha.Hyper(step=1, lr=1e-2, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert not hp.supported()
    hi, lo = _planes(torch.ones(64))
    assert not fha.run([fha.Job(hi, lo, torch.ones(64), {"exp_avg": torch.zeros(64), "exp_avg_sq": torch.zeros(64)},
                                hp)], state=OptimizerState.FP32)
    w = torch.randn(300, generator=torch.Generator().manual_seed(0))
    got = _train_compact(OptimizerState.FP32, beta1=0.3, w=w)
    p = torch.nn.Parameter(w.clone())
    ref = torch.optim.AdamW([p], lr=1e-2, betas=(0.3, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    for g in _grads(300):
        p.grad = g.float()
        ref.step()
    assert torch.equal(got[0].reshape(-1), p.detach())


def _grads(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(n, generator=gen) * 0.1 for _ in range(3)]


def _train_compact(state: OptimizerState, *, beta1: float, w: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Three steps of a one-layer compact host state (fp32 compute): its master and moments after them."""
    w = torch.randn(300, generator=torch.Generator().manual_seed(0)) if w is None else w
    hs = make_host_state({0: {"w": w.clone()}}, host_memory=HostMemory.COMPACT, compute_dtype=torch.float32,
                         optim=AdamWConfig(lr=1e-2, betas=(beta1, 0.999)), optimizer_state=state)
    for g in _grads(w.numel()):
        hs.receive_grads(0, {"w": g})
        hs.step(0)
    st = next(iter(hs._opt[0].state.values()))
    return (hs.master(0)["w"], *(t for k, t in sorted(st.items()) if k != "step"))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sum_of_squares_is_exact_in_double_on_any_thread_count(dtype: torch.dtype) -> None:
    """`sum_squares` of a gradient (several ranges and a tail) equals the float64 sum of its squares to 1e-12
    relative on 1 and 3 threads (torch's fp32 `vector_norm` of the same bf16 tensor is ~1e-4 off)."""
    g = (torch.randn(3 * fha.MIN_PART_ELEMS + 13, generator=torch.Generator().manual_seed(9)) * 1e-3).to(dtype)
    want = float(g.double().pow(2).sum())
    for threads in (1, 3):
        got = fha.sum_squares(g, threads=threads)
        assert got is not None and got == pytest.approx(want, rel=1e-12)
