"""Host bytes per parameter under each layout (DESIGN §1.2)."""

from __future__ import annotations

from tinypipe.describe.model import LayerKind, LayerSpec, ModelSpec
from tinypipe.estimate.hostmem import (
    COMPACT_OPTIM_FACTOR,
    REPLICATED_OPTIM_FACTOR,
    host_bytes,
    next_pow2,
    optimizer_time_factor,
)


def _model(sizes: list[int]) -> ModelSpec:
    layers = tuple(LayerSpec(i, LayerKind.BLOCK, f"block.{i}", n, n, 2.0 * n, 0.0, 8, 4) for i, n in enumerate(sizes))
    return ModelSpec("m", "llama", layers, 4, 16, len(sizes), False, 64, "test")


def test_next_pow2() -> None:
    """The pinned allocator's rounding: requests round up to the next power of two."""
    assert [next_pow2(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]


def test_replicated_is_18_bytes_plus_rounding() -> None:
    """replicated: 4 master + 2 upload + 4 grad + 8 moments, plus power-of-two rounding of pinned blocks."""
    h = host_bytes(_model([1000, 1024]), "replicated")
    assert h.params == 2024
    assert (h.master_bytes, h.upload_copy_bytes, h.grad_bytes, h.optim_state_bytes) == (8096, 4048, 8096, 16192)
    # upload 2000 -> 2048, 2048 -> 2048; grads 4000 -> 4096, 4096 -> 4096
    assert h.pinned_rounding_bytes == 48 + 96
    assert h.total_bytes == 8096 + 4048 + 8096 + 16192 + 144


def test_compact_is_12_bytes_plus_ring() -> None:
    """compact: master planes 4 + moments 8 per parameter, and a 4-slot ring of the largest layer in the
    compute dtype (bf16: 2 B a slot element, fp32: 4); async adds one upload-form copy (2 B/param in bf16)."""
    h = host_bytes(_model([1000, 1024]), "compact")
    assert (h.master_bytes, h.upload_copy_bytes, h.grad_bytes, h.optim_state_bytes, h.pinned_rounding_bytes) == (
        8096, 0, 4 * 1024 * 2, 16192, 0)
    assert host_bytes(_model([1000, 1024]), "compact", compute_dtype="fp32").grad_bytes == 4 * 1024 * 4
    big = host_bytes(_model([10**6] * 100), "compact")
    assert 12.0 < big.bytes_per_param < 12.1
    lagged = host_bytes(_model([1000, 1024]), "compact", optimizer="async")
    assert lagged.upload_copy_bytes == 2024 * 2 and lagged.total_bytes == h.total_bytes + 2024 * 2
    assert host_bytes(_model([1000, 1024]), "replicated", optimizer="async") == host_bytes(
        _model([1000, 1024]), "replicated")


def test_compact_with_clipping_holds_a_whole_gradient_instead_of_the_ring() -> None:
    """compact + clipping by the global norm: a gradient region per layer in the compute dtype replaces the
    4-slot ring (bf16: 14 B/param in all); replicated already holds a whole fp32 gradient and is unchanged."""
    m = _model([1000, 1024])
    h = host_bytes(m, "compact", grad_clip=True)
    assert h.grad_bytes == 2024 * 2 and h.total_bytes == host_bytes(m, "compact").total_bytes - 4 * 1024 * 2 + 2024 * 2
    assert host_bytes(m, "compact", compute_dtype="fp32", grad_clip=True).grad_bytes == 2024 * 4
    assert 14.0 <= host_bytes(_model([10**6] * 100), "compact", grad_clip=True).bytes_per_param < 14.01
    assert host_bytes(m, "replicated", grad_clip=True) == host_bytes(m, "replicated")


def test_optimizer_factors_are_the_measured_ones() -> None:
    """compact: chunked join/AdamW/split 1.69x a fused AdamW; replicated: AdamW + bf16 cast 1.31x."""
    assert optimizer_time_factor("replicated") == REPLICATED_OPTIM_FACTOR == 1.31
    assert optimizer_time_factor("compact") == COMPACT_OPTIM_FACTOR == (1.56 + 1.82) / 2


def test_optimizer_rate_is_the_measured_one_where_the_hardware_has_it() -> None:
    """Without measured layout rates the optimizer costs the layout's factor over the fused AdamW rate;
    a hardware JSON with `compact_params_per_s` / `replicated_params_per_s` (tinypipe profile) is
    taken as it is, and survives the JSON round trip."""
    import dataclasses

    from tinypipe.describe.hardware import Hardware, load_hardware
    from tinypipe.estimate.hostmem import optimizer_s_per_param, optimizer_time_factor

    hw = load_hardware("h200x2")  # no measured layout rates
    assert optimizer_s_per_param(hw.host, "compact") == optimizer_time_factor("compact") / hw.host.adam_params_per_s
    measured = dataclasses.replace(hw, host=dataclasses.replace(hw.host, compact_params_per_s=2e9,
                                                                replicated_params_per_s=4e9))
    assert optimizer_s_per_param(measured.host, "compact") == 1 / 2e9
    assert optimizer_s_per_param(measured.host, "replicated") == 1 / 4e9
    assert Hardware.from_json(measured.to_json()) == measured
