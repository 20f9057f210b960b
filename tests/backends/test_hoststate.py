"""Host state layouts: exact optimizer arithmetic, plane packing, versions, and the bytes really held."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tinypipe.backends.host.compact import join_planes_on  # noqa: E402
from tinypipe.backends.host.layouts import make_host_state  # noqa: E402
from tinypipe.backends.host.pinned import ALIGN_BYTES, plan  # noqa: E402
from tinypipe.backends.host.planes import split  # noqa: E402
from tinypipe.backends.host.state import AdamWConfig  # noqa: E402
from tinypipe.backends.host.torch_adamw import layer_adamw  # noqa: E402
from tinypipe.estimate.hostmem import DEFAULT_GRAD_RING_SLOTS, host_bytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)


def _params(seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {0: {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)},
            3: {"w": torch.randn(8, 8, generator=g), "n": torch.randn(8, generator=g)}}


def _clone(p: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {n: t.clone() for n, t in d.items()} for i, d in p.items()}


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("layout", ["replicated", "compact"])
def test_layouts_step_exactly_like_torch_adamw(layout: str, pin: bool) -> None:
    """Five AdamW steps through either layout leave the same fp32 masters, bit for bit, as
    `layer_adamw` (the reference's optimizer) on plain tensors; the upload is the exact master.
    Pinned or not (on a CPU: the same slab, unregistered), the arithmetic is the same."""
    ref = _clone(_params())
    opts = {i: layer_adamw(list(d.values()), lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay)
            for i, d in ref.items()}
    hs = make_host_state(_clone(_params()), host_memory=layout, compute_dtype=torch.float32, optim=CFG, pin=pin)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        for i in hs.layers:
            up = hs.load(i, step, CPU)
            assert all(torch.equal(up[n], t) for n, t in ref[i].items())
            grads = {n: torch.randn(t.shape, generator=g) for n, t in ref[i].items()}
            for n, t in ref[i].items():
                t.grad = grads[n].clone()
            opts[i].step()
            hs.receive_grads(i, grads)
            hs.step(i)
            assert hs.version(i) == step + 1
    for i in hs.layers:
        m = hs.master(i)
        assert all(torch.equal(m[n], ref[i][n]) for n in m)
        up = hs.load(i, 5, CPU)
        assert all(torch.equal(up[n], ref[i][n]) for n in m)


def test_planes_round_trip_and_high_plane_is_truncated_bf16() -> None:
    """Splitting fp32 into two 16-bit planes and joining them back is exact (inf, nan, -0 included);
    the high plane, read as bf16, is the value truncated to bf16."""
    x = torch.cat([torch.randn(1000), torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, 3.4e38])])
    hi, lo = torch.empty(x.numel(), dtype=torch.int16), torch.empty(x.numel(), dtype=torch.int16)
    split(x, hi, lo)
    back = join_planes_on(hi, lo, torch.empty_like(x))
    assert torch.equal(back.view(torch.int32), x.view(torch.int32))
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert torch.equal(hi.view(torch.bfloat16).float().view(torch.int32), truncated.view(torch.int32))


def test_bf16_upload_forms() -> None:
    """With bf16 compute, compact uploads the high plane (truncation), replicated a rounded copy."""
    p = _params()
    comp = make_host_state(_clone(p), host_memory="compact", compute_dtype=torch.bfloat16, optim=CFG)
    repl = make_host_state(_clone(p), host_memory="replicated", compute_dtype=torch.bfloat16, optim=CFG)
    w = p[0]["w"]
    assert torch.equal(comp.load(0, 0, CPU)["w"].float(), (w.view(torch.int32) & ~0xFFFF).view(torch.float32))
    assert torch.equal(repl.load(0, 0, CPU)["w"], w.to(torch.bfloat16))


@pytest.mark.parametrize("layout", ["replicated", "compact"])
def test_previous_version_kept_until_dropped(layout: str) -> None:
    """An asynchronous step (`keep_previous`) leaves the previous version uploadable; a LOAD of a
    version the host no longer holds is an error that names the versions it has."""
    hs = make_host_state(_clone(_params()), host_memory=layout, compute_dtype=torch.float32, optim=CFG)
    before = hs.master(0)
    hs.receive_grads(0, {n: torch.ones_like(t) for n, t in before.items()})
    hs.step(0, keep_previous=True)
    assert all(torch.equal(hs.load(0, 0, CPU)[n], before[n]) for n in before)
    after = hs.master(0)
    assert all(torch.equal(hs.load(0, 1, CPU)[n], after[n]) for n in after)
    hs.drop_stale(0)
    hs.receive_grads(0, {n: torch.ones_like(t) for n, t in before.items()})
    hs.step(0)
    with pytest.raises(ValueError, match="wants the weights after 0 optimizer steps"):
        hs.load(0, 0, CPU)


def test_compact_ring_grows_beyond_its_slots_and_says_so() -> None:
    """More layers waiting for the optimizer than the ring has slots: an extra slot is allocated
    (a slab of its own), and it shows in the bytes held: its 16 fp32 values as gradients, the rest of
    its 4 KiB as padding."""
    params = {i: {"w": torch.randn(4, 4)} for i in range(DEFAULT_GRAD_RING_SLOTS + 1)}
    hs = make_host_state(params, host_memory="compact", compute_dtype=torch.float32, optim=CFG)
    before = hs.held()
    for i in hs.layers:
        hs.receive_grads(i, {"w": torch.ones(4, 4)})
    after = hs.held()
    assert after.grad_bytes == before.grad_bytes + 16 * 4
    assert after.pinned_rounding_bytes == before.pinned_rounding_bytes + ALIGN_BYTES - 16 * 4
    for i in hs.layers:
        hs.step(i)


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
def test_state_dict_round_trip_continues_exactly(tmp_path: Path, state: str) -> None:
    """Saving and loading the state in a fresh HostState continues with identical steps, for every
    precision of the moments (the quantised ones as held: codes and absmax)."""
    from tinypipe.backends.save import checkpoint, ckpt_format

    a = make_host_state(_clone(_params()), host_memory="compact", compute_dtype=torch.float32, optim=CFG,
                        optimizer_state=state)
    for i in a.layers:
        a.receive_grads(i, {n: torch.full_like(t, 0.5) for n, t in a.master(i).items()})
        a.step(i, keep_previous=True)
    b = make_host_state(_clone(_params(seed=7)), host_memory="compact", compute_dtype=torch.float32, optim=CFG,
                        optimizer_state=state)
    # through files, as a checkpoint goes: state_dict hands out the live tensors
    ckpt_format.write(tmp_path / "rank0", a.state_dict(), checkpoint._write_synced)
    b.load_state_dict(ckpt_format.read(tmp_path / "rank0"))
    for hs in (a, b):
        for i in hs.layers:
            hs.receive_grads(i, {n: torch.full_like(t, -0.25) for n, t in hs.master(i).items()})
            hs.step(i)
    for i in a.layers:
        assert all(torch.equal(a.master(i)[n], b.master(i)[n]) for n in a.master(i))


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    from tinypipe.backends.model.hf import build_model

    return build_model("tiny-llama", seed=0)


@pytest.mark.parametrize("layout", ["replicated", "compact"])
@pytest.mark.parametrize("layers", [(0, 1, 2), (3, 4, 5)])
def test_bytes_held_match_hostmem_formulas(tiny_llama: Any, layout: str, layers: tuple[int, ...]) -> None:
    """The storage a rank really holds equals `hostmem.host_bytes` for its layers, plus what the
    formulas leave out: AdamW's step counters (4 B per tensor), in compact the chunked optimizer's
    workspace (its state keys hold no memory), and the pinned slab's alignment padding in
    place of the formulas' pinned rounding (none for compact; for replicated the power-of-two blocks
    of peers, which the slab does not have)."""
    stack = tiny_llama
    state = {i: {n: t.clone() for n, t in d.items()} for i, d in stack.state().items() if i in layers}
    hs = make_host_state(state, host_memory=layout, compute_dtype=torch.float32, optim=CFG)
    for i in layers:  # one step so the AdamW moments exist
        hs.receive_grads(i, {n: torch.zeros_like(t) for n, t in state[i].items()})
        hs.step(i)
    held = hs.held()
    want = host_bytes(stack.spec, layout, compute_dtype="fp32", layers=layers)
    tensors = sum(len(state[i]) for i in layers)
    assert held.params == want.params
    assert held.master_bytes == want.master_bytes
    assert held.upload_copy_bytes == want.upload_copy_bytes
    assert held.grad_bytes == want.grad_bytes
    assert held.optim_state_bytes == want.optim_state_bytes + 4 * tensors
    biggest = max(t.numel() for i in layers for t in state[i].values())
    from tinypipe.backends.host.planes import DEFAULT_CHUNK_ELEMS, workspace_elems

    work = 4 * workspace_elems(min(DEFAULT_CHUNK_ELEMS, biggest))
    assert held.scratch_bytes == (work if layout == "compact" else 0)
    assert 0 <= held.pinned_rounding_bytes < ALIGN_BYTES * 2 * len(layers)
    assert held.total_bytes == (want.total_bytes - want.pinned_rounding_bytes + held.pinned_rounding_bytes
                                + 4 * tensors + held.scratch_bytes)


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("layout", ["replicated", "compact"])
def test_pinned_blocks_are_one_slab_of_exact_size(tiny_llama: Any, layout: str, pin: bool) -> None:
    """Every pinned block of a HostState is a view of one allocation whose size is the slab plan's
    (compact: the two planes, then the ring in the compute dtype; replicated: the upload copies, then the fp32 gradient
    buffers). `held()` splits exactly that slab by purpose, the alignment padding (less than 4 KiB a
    block) as its pinned rounding, and adds what is not pinned: no power-of-two rounding anywhere."""
    stack = tiny_llama
    state = {i: {n: t.clone() for n, t in d.items()} for i, d in stack.state().items()}
    hs = make_host_state(state, host_memory=layout, compute_dtype=torch.bfloat16, optim=CFG, pin=pin)
    for i in hs.layers:  # one step so the AdamW moments exist
        hs.receive_grads(i, {n: torch.zeros_like(t) for n, t in state[i].items()})
        hs.step(i)
    numel = {i: sum(t.numel() for t in d.values()) for i, d in state.items()}
    n, tensors = sum(numel.values()), sum(len(d) for d in state.values())
    if layout == "compact":
        blocks, size = plan([((2, n), torch.int16), ((DEFAULT_GRAD_RING_SLOTS, max(numel.values())), torch.bfloat16)])
        views = [hs._slab, hs._ring]
    else:
        blocks, size = plan([((numel[i],), torch.bfloat16) for i in hs.layers]
                            + [((numel[i],), torch.float32) for i in hs.layers])
        views = [*hs._upload_flat.values(), *hs._grad_flat.values()]
    assert {v.untyped_storage().data_ptr() for v in views} == {views[0].untyped_storage().data_ptr()}
    assert views[0].untyped_storage().nbytes() == size
    held = hs.held()
    pinned = held.master_bytes + held.grad_bytes if layout == "compact" else held.upload_copy_bytes + held.grad_bytes
    assert pinned == sum(b.nbytes for b in blocks)
    assert held.pinned_rounding_bytes == size - pinned < ALIGN_BYTES * len(blocks)
    moments = 8 * n + 4 * tensors  # exp_avg, exp_avg_sq and a step counter per tensor
    unpinned = moments + (held.scratch_bytes if layout == "compact" else 4 * n)  # scratch, or the fp32 masters
    assert held.total_bytes == size + unpinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["replicated", "compact"])
def test_cuda_pinned_host_state_trains_like_the_cpu_one(layout: str) -> None:
    """With CUDA, the slab is registered: its views read as pinned, non_blocking LOADs and GRAD_OUTs
    through them carry the values, and the steps match a HostState that never saw a GPU."""
    gpu = torch.device("cuda")
    pinned = make_host_state(_clone(_params()), host_memory=layout, compute_dtype=torch.float32, optim=CFG, pin=True)
    plain = make_host_state(_clone(_params()), host_memory=layout, compute_dtype=torch.float32, optim=CFG)
    views = [pinned._slab, pinned._ring] if layout == "compact" else [*pinned._upload_flat.values()]
    assert all(v.is_pinned() for v in views)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        for i in pinned.layers:
            up = pinned.load(i, step, gpu, non_blocking=True)
            torch.cuda.synchronize()
            assert all(torch.equal(up[n].cpu(), t) for n, t in plain.load(i, step, CPU).items())
            grads = {n: torch.randn(t.shape, generator=g) for n, t in up.items()}
            pinned.receive_grads(i, {n: t.to(gpu) for n, t in grads.items()}, non_blocking=True)
            torch.cuda.synchronize()
            plain.receive_grads(i, grads)
            pinned.step(i)
            plain.step(i)
    for i in pinned.layers:
        assert all(torch.equal(pinned.master(i)[n], t) for n, t in plain.master(i).items())


@pytest.mark.parametrize("layout", ["compact", "replicated"])
def test_upload_of_the_previous_version_while_a_step_writes(tiny_llama: Any, layout: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Asynchronous optimizer, step on another thread: an upload of the version before the step,
    issued while the step is writing the layer, gets exactly the weights before the step (the
    snapshot / the kept upload copy), and one of the new version after it gets the updated ones."""
    import threading

    stack = tiny_llama
    state = {i: {n: t.clone() for n, t in d.items()} for i, d in stack.state().items()}
    hs = make_host_state(state, host_memory=layout, compute_dtype=torch.bfloat16, optim=CFG, snapshots=True)
    layer = hs.layers[1]
    before = hs.load(layer, 0, torch.device("cpu"))
    hs.receive_grads(layer, {n: torch.ones_like(t) for n, t in state[layer].items()})
    inside, release = threading.Event(), threading.Event()
    name = "_adamw" if layout == "compact" else "_opt"
    if layout == "compact":
        original = hs._adamw  # type: ignore[attr-defined]

        def paused(lay: int, slot: torch.Tensor) -> None:  # the planes are updated, the version not yet
            original(lay, slot)
            inside.set()
            release.wait(10)

        monkeypatch.setattr(hs, name, paused)
    else:
        opt = hs._opt[layer]
        original_step = opt.step

        def paused_step(*args: Any, **kwargs: Any) -> Any:  # the master is updated, the version not yet
            out = original_step(*args, **kwargs)
            inside.set()
            release.wait(10)
            return out

        monkeypatch.setattr(opt, "step", paused_step)
    worker = threading.Thread(target=hs.step, args=(layer,), kwargs={"keep_previous": True})
    worker.start()
    assert inside.wait(10)
    during = hs.load(layer, 0, torch.device("cpu"))  # the step is writing right now
    release.set()
    worker.join(10)
    assert hs.version(layer) == 1
    for n in before:
        torch.testing.assert_close(during[n], before[n], rtol=0, atol=0)
    if layout == "compact":  # the snapshot serves the old version until drop_stale, whatever comes between
        old = hs.load(layer, 0, torch.device("cpu"))
        for n in before:
            torch.testing.assert_close(old[n], before[n], rtol=0, atol=0)
    # (replicated has one upload copy: the first upload of the new version refreshes it, which is why
    # the schedule issues a layer's uploads in iteration order on one stream)
    after = hs.load(layer, 1, torch.device("cpu"))
    assert any(not torch.equal(after[n], before[n]) for n in before)


@pytest.mark.parametrize("layout", ["replicated", "compact"])
def test_a_tied_layers_second_share_is_staged_then_added_by_its_step(layout: str) -> None:
    """The second gradient share of the tied layer lands in pinned staging (counted as gradient
    bytes), is added by the step, and the result equals one step with the summed gradient."""
    params = _params()
    layer = min(params)
    tied = make_host_state(_clone(params), host_memory=layout, compute_dtype=torch.float32, optim=CFG,
                           shared_grad=layer)
    plain = make_host_state(_clone(params), host_memory=layout, compute_dtype=torch.float32, optim=CFG)
    first = {n: torch.full_like(t, 0.5) for n, t in params[layer].items()}
    second = {n: torch.full_like(t, 0.25) for n, t in params[layer].items()}
    before = tied.held().grad_bytes
    tied.receive_grads(layer, first)
    tied.receive_grads(layer, second)
    assert tied.held().grad_bytes == before + sum(t.numel() * 4 for t in second.values())
    tied.step(layer)
    plain.receive_grads(layer, {n: first[n] + second[n] for n in first})
    plain.step(layer)
    assert all(torch.equal(tied.master(layer)[n], plain.master(layer)[n]) for n in params[layer])
