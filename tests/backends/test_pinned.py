"""Pinned slabs: the plan's offsets and size, carving typed views out of one allocation, the errors,
and registration with CUDA (faked on CPU; real on a GPU)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from tinypipe.backends.host.pinned import (  # noqa: E402
    ALIGN_BYTES,
    Block,
    PinnedSlab,
    plan,
    registered_bytes,
    torch_pinned_peak_bytes,
)
from tinypipe.common.errors import CapacityError  # noqa: E402

REQUESTS = [((2, 3), torch.int16), ((5,), torch.float32), ((), torch.float64), ((0,), torch.float32),
            ((3, 1024), torch.float32), ((7,), torch.bfloat16)]


def test_plan_puts_each_block_on_a_page_and_sizes_the_slab_exactly() -> None:
    """Blocks follow each other in request order, each starting on the next 4 KiB boundary; a block of
    exactly 4 KiB leaves no gap; the slab ends on a boundary too, and nothing else is added."""
    blocks, nbytes = plan(REQUESTS)
    assert blocks == (Block((2, 3), torch.int16, 0), Block((5,), torch.float32, 4096),
                      Block((), torch.float64, 8192), Block((0,), torch.float32, 12288),
                      Block((3, 1024), torch.float32, 12288), Block((7,), torch.bfloat16, 24576))
    assert [b.nbytes for b in blocks] == [12, 20, 8, 0, 12288, 14]
    assert nbytes == 28672
    assert plan(REQUESTS, align_bytes=64)[1] == 64 * 3 + 12288 + 64  # 12, 20, 8 -> one line each; 0; 12288; 14
    assert plan([]) == ((), 0)


@given(st.lists(st.tuples(st.lists(st.integers(0, 300), max_size=3),
                          st.sampled_from([torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.float64])),
                max_size=8),
       st.sampled_from([64, 256, 4096]))
def test_plan_properties(reqs: list[tuple[list[int], Any]], align: int) -> None:
    """Any requests: blocks in order, aligned, disjoint, each padded by less than one alignment unit,
    and the slab is the end of the last block rounded up to the alignment."""
    blocks, nbytes = plan(reqs, align_bytes=align)
    end = 0
    for b, (shape, dtype) in zip(blocks, reqs, strict=True):
        assert (b.shape, b.dtype) == (tuple(shape), dtype)
        assert b.offset_bytes % align == 0 and end <= b.offset_bytes < end + align
        end = b.offset_bytes + b.nbytes
    assert nbytes % align == 0 and end <= nbytes < end + align


def test_views_are_typed_aligned_disjoint_and_of_one_allocation() -> None:
    """`take` hands out the planned blocks as views of one buffer of exactly the planned size: right
    shape and dtype, page-aligned addresses, no two overlapping (writing one leaves the others)."""
    slab = PinnedSlab(REQUESTS, pin=False)
    assert (slab.nbytes, slab.used_bytes, slab.padding_bytes) == (28672, 12342, 28672 - 12342)
    assert not slab.pinned
    views = [slab.take(shape, dtype) for shape, dtype in REQUESTS]
    storages = {v.untyped_storage().data_ptr() for v in views}
    assert len(storages) == 1 and views[0].untyped_storage().nbytes() == slab.nbytes
    base = views[0].untyped_storage().data_ptr()
    assert base % ALIGN_BYTES == 0
    for v, b in zip(views, slab.blocks, strict=True):
        assert (tuple(v.shape), v.dtype, v.is_contiguous()) == (b.shape, b.dtype, True)
        if v.numel():  # an empty tensor's data_ptr() reads 0
            assert v.data_ptr() == base + b.offset_bytes and v.data_ptr() % ALIGN_BYTES == 0
    for k, v in enumerate(views):
        v.fill_(k + 1)
    for k, v in enumerate(views):
        assert bool((v == k + 1).all())


def test_errors_say_what_was_asked_and_what_was_planned() -> None:
    """Taking out of order, with another dtype or beyond the plan, a negative dimension, a dtype that
    is not a torch.dtype and an alignment that is no power of two of at least 64 bytes are refused."""
    slab = PinnedSlab([((4,), torch.float32), ((2,), torch.int16)], pin=False, what="test slab")
    with pytest.raises(ValueError, match=r"test slab: block 0 was planned as \(4,\) torch.float32, take asked "
                                         r"for \(2,\) torch.int16"):
        slab.take((2,), torch.int16)
    with pytest.raises(ValueError, match="block 0 was planned as"):
        slab.take((4,), torch.float16)
    slab.take((4,), torch.float32)
    slab.take([2], torch.int16)
    with pytest.raises(ValueError, match="all 2 planned blocks are taken"):
        slab.take((1,), torch.int16)
    with pytest.raises(ValueError, match=r"slab request 1: negative dimension in shape \(2, -1\)"):
        plan([((1,), torch.int16), ((2, -1), torch.int16)])
    with pytest.raises(TypeError, match="slab request 0: dtype must be a torch.dtype"):
        plan([((1,), "float32")])  # type: ignore[list-item]
    for bad in (32, 100, 0):
        with pytest.raises(ValueError, match="power of two of at least 64 bytes"):
            plan([], align_bytes=bad)


class _FakeCudart:
    """Stands in for `torch.cuda.cudart()`: records (un)registrations, fails registration on demand."""

    def __init__(self, register_rc: int = 0) -> None:
        self.register_rc = register_rc
        self.calls: list[tuple[str, int, int]] = []
        self.cudaError = int

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, nbytes))
        return self.register_rc

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, 0))
        return 0

    def cudaGetErrorString(self, code: int) -> str:  # noqa: N802
        return "out of memory" if code == 2 else "unknown"


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCudart:
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_registered_once_and_unregistered_on_close_or_collection(fake_cuda: _FakeCudart) -> None:
    """With CUDA, the whole slab is registered once (its start, its exact size); `close` unregisters
    it once, and so does collecting a slab nobody closed. Without `pin` nothing is registered."""
    slab = PinnedSlab(REQUESTS, pin=True)
    view = slab.take(*REQUESTS[0])
    ptr = view.untyped_storage().data_ptr()
    assert slab.pinned and fake_cuda.calls == [("register", ptr, 28672)]
    slab.close()
    slab.close()
    assert not slab.pinned and fake_cuda.calls == [("register", ptr, 28672), ("unregister", ptr, 0)]
    view.fill_(1)  # still valid memory, only no longer page-locked

    fake_cuda.calls.clear()
    other = PinnedSlab(REQUESTS, pin=True)
    ptr = other.take(*REQUESTS[0]).data_ptr()
    del other
    gc.collect()
    assert fake_cuda.calls == [("register", ptr, 28672), ("unregister", ptr, 0)]

    fake_cuda.calls.clear()
    PinnedSlab(REQUESTS, pin=False)
    PinnedSlab([], pin=True)
    assert fake_cuda.calls == []


def test_registered_bytes_count_what_is_registered_now_and_at_most(fake_cuda: _FakeCudart) -> None:
    """`registered_bytes` follows registration: two slabs held at once add up (now and peak); closing
    one lowers now, not the peak; unpinned slabs never count."""
    now0, peak0 = registered_bytes()
    a = PinnedSlab(REQUESTS, pin=True)
    b = PinnedSlab(REQUESTS, pin=True)
    PinnedSlab(REQUESTS, pin=False)
    assert registered_bytes() == (now0 + 2 * 28672, max(peak0, now0 + 2 * 28672))
    a.close()
    assert registered_bytes() == (now0 + 28672, max(peak0, now0 + 2 * 28672))
    b.close()
    assert registered_bytes()[0] == now0


def test_failed_registration_names_the_bytes(fake_cuda: _FakeCudart) -> None:
    """A registration CUDA refuses is a capacity error naming what, how many bytes and CUDA's reason."""
    fake_cuda.register_rc = 2
    with pytest.raises(CapacityError, match=r"could not page-lock 28,672 bytes \(0.00 GiB\) of host memory for "
                                            r"the test state: cudaHostRegister failed with CUDA error 2 "
                                            r"\(out of memory\)"):
        PinnedSlab(REQUESTS, pin=True, what="the test state")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_pin_without_cuda_carves_the_same_unpinned() -> None:
    """Asked to pin on a machine without CUDA, the slab is carved the same and stays unregistered."""
    a, b = PinnedSlab(REQUESTS, pin=True), PinnedSlab(REQUESTS, pin=False)
    assert (a.blocks, a.nbytes, a.pinned) == (b.blocks, b.nbytes, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_views_are_pinned_and_copy_asynchronously() -> None:
    """On a GPU the carved views read as pinned, a non_blocking upload and download through them
    carries the values, two slabs side by side register independently, and close unpins."""
    a = PinnedSlab([((3, 1000), torch.float32), ((5,), torch.bfloat16)], pin=True)
    b = PinnedSlab([((17,), torch.int16)], pin=True)
    x, y, z = a.take((3, 1000), torch.float32), a.take((5,), torch.bfloat16), b.take((17,), torch.int16)
    assert a.pinned and b.pinned and x.is_pinned() and y.is_pinned() and z.is_pinned()
    x.copy_(torch.arange(3000, dtype=torch.float32).view(3, 1000))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        g = x.to("cuda", non_blocking=True)
        g.mul_(2)
        x.copy_(g, non_blocking=True)
    stream.synchronize()
    assert torch.equal(x, 2 * torch.arange(3000, dtype=torch.float32).view(3, 1000))
    a.close()
    assert not a.pinned and not x.is_pinned() and z.is_pinned()
    b.close()


def test_torch_pinned_peak_reads_the_host_allocator_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocator's `allocated_bytes.peak` where torch reports it, else the largest `*bytes*.peak`
    (a spelling of another version); None without the statistics or without any byte peak."""
    stats: dict[str, int] = {"allocated_bytes.peak": 5, "active_bytes.peak": 3}
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: stats, raising=False)
    assert torch_pinned_peak_bytes() == 5
    stats = {"segment_bytes.current": 9, "block_bytes.peak": 7, "active_bytes.peak": 3, "allocations.peak": 99}
    assert torch_pinned_peak_bytes() == 7
    stats = {"allocations.peak": 2}
    assert torch_pinned_peak_bytes() is None
    monkeypatch.delattr(torch.cuda, "host_memory_stats")
    assert torch_pinned_peak_bytes() is None
