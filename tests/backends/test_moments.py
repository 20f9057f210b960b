"""Low-precision AdamW moments (bf16, 8-bit block-wise): the map, the step, training through the pipeline
equal to single-process training with the same optimizer, and resume with quantised state bit-exact."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import MBS, MBS_PER_STEP, OPTIM, SEQ, assert_same_training, compiled, job  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.host import moments, planes  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.estimate.hostmem import QUANT_BLOCK_ELEMS, moment_bytes  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402
from tinypipe.policy.modes import OptimizerState  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_dynamic_maps_have_256_sorted_values_with_zero_and_one() -> None:
    """The signed map is symmetric around 0 with 127 values a side plus 0 and 1; the unsigned one spans
    [0, 1]; both have the 7 decades of Dettmers' dynamic tree type down to ~1e-7."""
    for signed in (True, False):
        code = moments.dynamic_map(signed)
        assert code.numel() == 256 and torch.all(code[1:] > code[:-1])
        assert 0.0 in code.tolist() and code.max() == 1.0
        assert code[code > 0].min() < 1e-6
    signed_code = moments.dynamic_map(True)
    assert int((signed_code < 0).sum()) == 127 and signed_code.min() > -1.0


def test_table_lookup_is_the_nearest_code_up_to_the_tables_resolution() -> None:
    """The 20-bit table gives the nearest value of the map (binary search) for all but values within the
    table's resolution of a midpoint, and then a neighbour (off by one code)."""
    code, table = moments.maps(True)
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(200_000, generator=gen) * 2 - 1) * torch.pow(10, -torch.rand(200_000, generator=gen) * 7)
    nearest = torch.bucketize(x, (code[1:] + code[:-1]) / 2)
    got = table[((x.view(torch.int32) >> (32 - moments.TABLE_BITS)) & ((1 << moments.TABLE_BITS) - 1)).long()].long()
    off = (got != nearest)
    assert int(off.sum()) < 200_000 * 1e-3
    assert int((got - nearest).abs().max()) <= 1


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_each_step_equals_dequantise_adamw_requantise(state: str) -> None:
    """Each of three steps of `lowp_adamw_step` on the planes (a tensor with a partial last block, chunks of
    two blocks), from the state it starts from, against an independent formulation of that step: fp32
    moments widened from the held ones, AdamW written out, moments rounded (bf16) or quantised by nearest
    value (8bit). Masters agree to 1e-7 absolute; the held moments in at least 99% of elements, and one
    code apart else (the table decides per 2^-11-wide interval, so a value that close to the midpoint of two
    codes may take the farther one: 4 of 1024 here, near each block's absmax where the map is densest)."""
    n, lr, b1, b2, eps, wd = 3 * QUANT_BLOCK_ELEMS + 77, 1e-2, 0.9, 0.98, 1e-8, 0.01
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, generator=gen) * 0.1
    hi, lo = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
    planes.split(w, hi, lo)
    held = moments.zero_state(n, OptimizerState(state))
    for t in range(1, 4):
        ref_w, ref = planes.join(hi, lo, torch.empty(n)), {k: v.clone() for k, v in held.items()}
        g = torch.randn(n, generator=gen) * 0.01
        moments.lowp_adamw_step(hi, lo, g, held, state=OptimizerState(state), step=t, lr=lr, beta1=b1, beta2=b2,
                                eps=eps, weight_decay=wd, chunk_elems=2 * QUANT_BLOCK_ELEMS)
        m, v = _widen(ref, state, n)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        ref_w = ref_w * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        _narrow(ref, state, m, v)
        torch.testing.assert_close(planes.join(hi, lo, torch.empty(n)), ref_w, rtol=0, atol=1e-7)
        for k in ("exp_avg", "exp_avg_sq"):
            same = (held[k] == ref[k]).float().mean().item()
            assert same >= 0.99, (t, k, same)
            if state == "8bit":
                assert int((held[k].long() - ref[k].long()).abs().max()) <= 1


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_chunks_on_a_pool_of_threads_give_the_same_bits(state: str) -> None:
    """Eight chunks run on 1 thread and on a pool of 2 threads leave the same masters and moments, bit for bit
    (each chunk's arithmetic is the same on any thread)."""
    n = 8 * QUANT_BLOCK_ELEMS * 4 + 13
    gen = torch.Generator().manual_seed(2)
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
    out = []
    for threads in (1, 2):
        hi, lo = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
        planes.split(w, hi, lo)
        held = moments.zero_state(n, OptimizerState(state))
        for t in (1, 2):
            moments.lowp_adamw_step(hi, lo, g, held, state=OptimizerState(state), step=t, lr=1e-2, beta1=0.9,
                                    beta2=0.99, eps=1e-8, weight_decay=0.0, chunk_elems=4 * QUANT_BLOCK_ELEMS,
                                    threads=threads)
        out.append((hi, lo, held))
    (h1, l1, m1), (h2, l2, m2) = out
    assert torch.equal(h1, h2) and torch.equal(l1, l2) and all(torch.equal(m1[k], m2[k]) for k in m1)
    assert moments.pool_workspace_bytes() > 0


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_the_chunk_length_does_not_change_the_bits(state: str) -> None:
    """Chunks of 1, 3 and 64 blocks and one of the whole tensor leave the same masters and moments, bit for bit:
    blocks never straddle chunks, and every chunk starts on a block (a multiple of the 64 elements that keep
    torch's fused AdamW on one code path), so the default chunk length is a speed setting only."""
    n = 64 * QUANT_BLOCK_ELEMS + 101
    gen = torch.Generator().manual_seed(3)
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
    out = []
    for chunk in (QUANT_BLOCK_ELEMS, 3 * QUANT_BLOCK_ELEMS, 64 * QUANT_BLOCK_ELEMS, n):
        hi, lo = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
        planes.split(w, hi, lo)
        held = moments.zero_state(n, OptimizerState(state))
        for t in (1, 2):
            moments.lowp_adamw_step(hi, lo, g.bfloat16(), held, state=OptimizerState(state), step=t, lr=1e-2,
                                    beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, chunk_elems=chunk)
        out.append((hi, lo, held))
    h0, l0, m0 = out[0]
    for h, lo_, m in out[1:]:
        assert torch.equal(h, h0) and torch.equal(lo_, l0) and all(torch.equal(m[k], m0[k]) for k in m0)


def test_special_values_quantise_as_the_table_formula() -> None:
    """Blocks of zeros, of a subnormal absmax (whose reciprocal overflows), and with inf or NaN of either sign
    in either moment get the codes of `table[(bits(x * (1 / absmax if absmax > 0 else 0)) >> 12) & mask]`
    and the absmax max |x| (inf or NaN where the block has one), exactly; a block with inf or NaN then
    dequantises to NaN throughout (its codes are the code of 0, times an absmax of inf or NaN)."""
    b = QUANT_BLOCK_ELEMS
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(6 * b, generator=gen) * 1e-3
    v = torch.rand(6 * b, generator=gen) * 1e-6
    for x in (m, v):
        x[:b] = 0.0  # zeros
        x[b:2 * b] *= 1e-36  # subnormal values, absmax ~1e-39
        x[2 * b + 5] = float("inf")
        x[3 * b + 7] = float("nan")
        x[4 * b + 9] = -float("nan")
    m[5 * b + 1] = -float("inf")
    n = m.numel()
    held = moments.zero_state(n, OptimizerState.INT8)
    w = moments._views(torch.empty(moments.workspace_elems(n)), n, n, True)
    w.m.copy_(m)
    w.v.copy_(v)
    parts = [held["exp_avg"], held["exp_avg_sq"], held["exp_avg_absmax"].view(-1, 1),
             held["exp_avg_sq_absmax"].view(-1, 1)]
    moments._quantise(parts, w, (moments.maps(True), moments.maps(False)))
    for x, key, signed in ((m, "exp_avg", True), (v, "exp_avg_sq", False)):
        blocks = x.view(-1, b)
        absmax = torch.maximum(blocks.amax(1), -blocks.amin(1))
        inv = torch.where(absmax > 0, absmax.reciprocal(), torch.zeros_like(absmax))
        bits = (blocks * inv[:, None]).reshape(-1).view(torch.int32)
        want = moments.maps(signed)[1][((bits >> moments._SHIFT) & ((1 << moments.TABLE_BITS) - 1)).long()]
        torch.testing.assert_close(held[key + "_absmax"], absmax, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(held[key], want), key
        values = moments.dynamic_map(signed)[held[key].long()].view(-1, b) * held[key + "_absmax"][:, None]
        assert torch.isnan(values[2:5]).all() and torch.isfinite(values[:2]).all()


def test_the_chunk_pool_leaves_torchs_thread_count_as_it_was() -> None:
    """Making the pool (its threads run torch on one core each) leaves the intra-op thread count a new thread
    starts with, and the caller's, as they were."""
    def on_new_thread() -> int:
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
        t.start()
        t.join()
        return out[0]

    torch.set_num_threads(2)
    before = on_new_thread()
    moments.pool(3)  # a size no other test makes
    assert torch.get_num_threads() == 2 and on_new_thread() == before == 2


def _widen(st: dict[str, torch.Tensor], state: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if state == "bf16":
        return st["exp_avg"].float(), st["exp_avg_sq"].float()
    out = []
    for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        vals = moments.dynamic_map(signed)[st[k].long()].view(-1, QUANT_BLOCK_ELEMS) * st[k + "_absmax"][:, None]
        out.append(vals.reshape(-1)[:n])
    return out[0], out[1]


def _narrow(st: dict[str, torch.Tensor], state: str, m: torch.Tensor, v: torch.Tensor) -> None:
    if state == "bf16":
        st["exp_avg"].copy_(m)
        st["exp_avg_sq"].copy_(v)
        return
    for k, x, signed in (("exp_avg", m, True), ("exp_avg_sq", v, False)):
        code = moments.dynamic_map(signed)
        padded = torch.zeros(st[k].numel())
        padded[:x.numel()] = x
        blocks = padded.view(-1, QUANT_BLOCK_ELEMS)
        absmax = blocks.abs().amax(1)
        st[k + "_absmax"].copy_(absmax)
        norm = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
        st[k].copy_(torch.bucketize(norm.reshape(-1), (code[1:] + code[:-1]) / 2).to(torch.uint8))


def test_held_bytes_of_the_moments_are_the_formula() -> None:
    """The tensors `zero_state` holds are `hostmem.moment_bytes` for a tensor of whole blocks."""
    n = 4 * QUANT_BLOCK_ELEMS
    for state in OptimizerState:
        held = sum(t.numel() * t.element_size() for t in moments.zero_state(n, state).values())
        assert held == moment_bytes(n, state)


def reference(model: str, steps: int, state: str) -> object:
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS,
                           microbatches=MBS_PER_STEP, seed=0)
    return reference_train(model, batches, steps=steps, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                           weight_decay=OPTIM.weight_decay, seed=0, optimizer_state=OptimizerState(state))


@pytest.mark.parametrize("state", ["bf16", "8bit"])
@pytest.mark.parametrize("model", ["tiny-llama", "tied"])
def test_pipeline_training_with_low_precision_moments_equals_the_reference(model: str, state: str,
                                                                           tied_config: str) -> None:
    """Five steps through the compiled schedule (windows of 3 + 2; several packs per device; the tied
    Qwen3's head with its embedding) with bf16 or 8-bit moments give the losses and final weights of
    plain single-process training with the same optimizer (`torch_adamw.LowPrecisionAdamW`): losses to
    1e-6 relative and weights to 1e-5 / 1e-6, the tolerance of the fp32 tests (on the CPU both are
    bit-identical in practice: the same gradients meet the same chunked arithmetic)."""
    tied = model == "tied"
    packs = {} if tied else {"packing": (1, 2, 1, 2), "mapping": (0, 1, 0, 1)}
    model = tied_config if tied else model
    sched = compiled(model, PRESETS["tinypipe"].replace(optimizer="sync", optimizer_state=state, **packs), 2)
    assert sched.optimizer_state == state and (sched.pack_gpu[0] == sched.pack_gpu[-1]) == tied
    results = run_threads(job(model, sched, 5), 2)
    assert_same_training(results, reference(model, 5, state))


def test_resume_with_quantised_state_is_bit_exact(tmp_path: Path) -> None:
    """8-bit moments: a run stopped after 2 steps (checkpoint: codes and absmax as held) and resumed to 5
    ends with weights bit-identical to an uninterrupted 5-step run, and its checkpoint holds no pickle
    (safetensors + JSON only)."""
    sched = compiled("tiny-llama", PRESETS["tinypipe"].replace(optimizer="sync", optimizer_state="8bit",
                                                               packing=(3, 3), mapping=(0, 1)), 2)
    base = dataclasses.replace(job("tiny-llama", sched, 5), checkpoint_s=3600.0)
    whole = run_threads(dataclasses.replace(base, out=str(tmp_path / "whole")), 2)
    out = str(tmp_path / "resumed")
    first = run_threads(dataclasses.replace(base, out=out, stop_after=2), 2)
    assert all(r.interrupted for r in first)
    files = sorted(p.name for p in (tmp_path / "resumed" / "checkpoint").iterdir())
    assert files == ["meta.json", "rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors"]
    second = run_threads(dataclasses.replace(base, out=out, resume=True), 2)
    assert [r.start_step for r in second] == [2, 2]
    want = {i: t for r in whole for i, t in r.masters.items()}
    got = {i: t for r in second for i, t in r.masters.items()}
    for i, tensors in want.items():
        for name, t in tensors.items():
            assert torch.equal(got[i][name], t), (i, name)
    losses = {k: v for r in [*first, *second] for k, v in r.losses.items()}
    assert [losses[k] for k in range(5)] == [{k: v for r in whole for k, v in r.losses.items()}[k] for k in range(5)]
