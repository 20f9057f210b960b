"""ProfileTrace: the analytic model, the shipped measured H200 traces, trace_for and the loader."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import Fields
from tinypipe.common.units import MIB
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.looptimes import LoopTimes
from tinypipe.describe.model import head_workspace_bytes, head_workspace_fixed_bytes
from tinypipe.describe.trace import (
    FORMAT,
    KindProfile,
    ProfileTrace,
    analytic_trace,
    load_profiles,
    load_trace,
    shipped_traces,
    trace_for,
    unmatched_note,
)
from tinypipe.estimate.plan import base_plan
from tinypipe.policy import PRESETS

H200 = load_hardware("h200x2").gpu(0)
RTX4090 = load_hardware("rtx4090x8-pcie4").gpu(0)
LLAMA8B = load_model("llama-3.1-8b")


def test_shipped_traces() -> None:
    """Four measured H200 Llama-3.1-8B traces ship, at 1, 2, 4 and 8 sequences of 2048 tokens, eager, one of
    compiled blocks at 4 sequences, and one of compiled blocks on a frozen base with LoRA r16 on all seven
    linears (`profile --lora`), which only a run with those adapters takes."""
    lora = "h200-llama-3.1-8b-mb4-seq2048-compiled-lora-r16-a32-d0-q-k-v-o-gate-up-down"
    assert shipped_traces() == ([f"h200-llama-3.1-8b-mb{n}-seq2048" for n in (1, 2, 4)]
                                + ["h200-llama-3.1-8b-mb4-seq2048-compiled", lora, "h200-llama-3.1-8b-mb8-seq2048"])
    assert [load_trace(n).compiled for n in shipped_traces()] == [False, False, False, True, True, False]
    assert [n for n in shipped_traces() if load_trace(n).lora] == [lora]
    adapters = "r16,a32,d0,q+k+v+o+gate+up+down"
    assert trace_for(LLAMA8B, H200, 4, 2048, compiled=True, lora=adapters) == load_trace(lora)
    assert not trace_for(LLAMA8B, H200, 4, 2048, compiled=True).lora  # a full-training run never takes it
    assert not trace_for(LLAMA8B, H200, 4, 2048, compiled=True, lora="r8,a8,d0,q+v").lora


def test_trace_for_matches_compiled_blocks() -> None:
    """A run that compiles its blocks takes a compiled trace, else an eager measured one before an
    analytic one; an eager run the reverse; None (simulate, search) prefers eager ones."""
    eager, comp = _measured("eager"), _measured("compiled", compiled=True)
    for pool in ((eager, comp), (comp, eager)):
        assert trace_for(LLAMA8B, H200, 1, 2048, profiles=pool, compiled=True).source == "compiled"
        assert trace_for(LLAMA8B, H200, 1, 2048, profiles=pool, compiled=False).source == "eager"
        assert trace_for(LLAMA8B, H200, 1, 2048, profiles=pool).source == "eager"
    assert trace_for(LLAMA8B, H200, 1, 2048, profiles=(comp,)).source == "compiled"
    assert trace_for(LLAMA8B, H200, 1, 2048, profiles=(eager,), compiled=True).source == "eager"
    assert trace_for(LLAMA8B, H200, 4, 2048, compiled=True) == load_trace("h200-llama-3.1-8b-mb4-seq2048-compiled")
    assert not trace_for(LLAMA8B, H200, 2, 2048, compiled=True).analytic  # the eager measured one


def test_a_run_predicted_from_the_other_kind_of_trace_is_told() -> None:
    """A compiling run predicted from an eager measured trace gets a note saying so; a matching trace or
    an analytic one gets none."""
    eager = trace_for(LLAMA8B, H200, 2, 2048, compiled=True)
    note = unmatched_note((), eager, LLAMA8B, compiled=True)
    assert note is not None and "no trace of compiled blocks for llama-3.1-8b at microbatch 2" in note
    assert unmatched_note((), eager, LLAMA8B, compiled=False) is None
    assert unmatched_note((), eager, LLAMA8B) is None
    assert unmatched_note((), trace_for(LLAMA8B, RTX4090, 2, 2048, compiled=True), LLAMA8B, compiled=True) is None


def test_measured_trace_values() -> None:
    """The mb1 trace holds DESIGN section 8's block numbers: bwd = fwd+bwd - fwd, recompute+bwd - fwd,
    saved + workspace = the measured peak; the chunked head's fwd+bwd 19.7 ms, split as measured at 4x2048."""
    t = load_trace("h200-llama-3.1-8b-mb1-seq2048")
    assert (t.gpu_model, t.model, t.dtype, t.microbatch_size, t.seq_len, t.analytic) == (
        "H200", "llama-3.1-8b", "bf16", 1, 2048, False)
    block = t.kinds["block"]
    assert (block.fwd_s, block.bwd_s, block.recompute_bwd_s) == (0.00196, 0.00447, 0.00643)
    assert block.saved_act_bytes == 168_064 * 2048
    assert block.saved_act_bytes_recompute == 8192 * 2048
    assert block.saved_act_bytes + block.workspace_bytes == 1056 * MIB
    head = t.kinds["head"]
    assert head.fwd_s + head.bwd_s == pytest.approx(0.0197)
    assert head.fwd_s / (head.fwd_s + head.bwd_s) == pytest.approx(21.69 / 73.69, rel=1e-3)
    assert "embed: not measured" in t.source


@pytest.mark.parametrize(("mb", "fwd_ms", "fwd_bwd_ms", "peak_mib"), [
    (2, 3.56, 11.2, 1105), (4, 6.87, 21.0, 2209), (8, 14.2, 42.3, 4418)])
def test_measured_traces_larger_microbatches(mb: int, fwd_ms: float, fwd_bwd_ms: float,
                                             peak_mib: int) -> None:
    """The mb2/4/8 traces hold the measured block forward, forward+backward and peak."""
    block = load_trace(f"h200-llama-3.1-8b-mb{mb}-seq2048").kinds["block"]
    assert block.fwd_s == pytest.approx(fwd_ms * 1e-3)
    assert block.fwd_s + block.bwd_s == pytest.approx(fwd_bwd_ms * 1e-3)
    assert block.saved_act_bytes + block.workspace_bytes == peak_mib * MIB


@pytest.mark.parametrize("mb", [1, 2, 4, 8])
def test_measured_traces_head_sizes_follow_the_chunked_head(mb: int) -> None:
    """The shipped traces' head sizes are tinypipe.describe.model's chunked-head formula at their token count
    (what the analytic trace gives too); its times are the chunked head's measured ones."""
    t = load_trace(f"h200-llama-3.1-8b-mb{mb}-seq2048")
    head, tokens = t.kinds["head"], mb * 2048
    assert head.saved_act_bytes == LLAMA8B.layers[-1].saved_act_bytes_per_token * tokens == 32_784 * tokens
    assert head.saved_act_bytes_recompute == 8192 * tokens
    assert head.workspace_bytes == head_workspace_bytes(LLAMA8B, tokens)
    assert head.workspace_fixed_bytes == head_workspace_fixed_bytes(LLAMA8B, tokens) == 6 * 523 * 128_256
    analytic = analytic_trace(LLAMA8B, H200, microbatch_size=mb, seq_len=2048).kinds["head"]
    assert (head.saved_act_bytes, head.workspace_bytes, head.workspace_fixed_bytes) == (
        analytic.saved_act_bytes, analytic.workspace_bytes, analytic.workspace_fixed_bytes)
    assert head.fwd_s + head.bwd_s == pytest.approx({1: 19.7, 2: 38.2, 4: 73.69, 8: 156.5}[mb] * 1e-3)
    assert head.recompute_bwd_s == pytest.approx(head.fwd_s + head.bwd_s)
    assert "chunked head" in t.source


def test_head_workspace_is_nearly_constant_in_tokens() -> None:
    """The head's workspace holds one chunk of logits, not the microbatch's: 400 MiB at 2,048 tokens,
    416 MiB at 4,096 (the hidden state's gradient grows), then RMSNorm's backward, 16 bytes per
    hidden element per token, takes over: 512 MiB at 8,192. The unchunked head's was 2,068 MiB."""
    ws = {mb: analytic_trace(LLAMA8B, H200, microbatch_size=mb, seq_len=2048).kinds["head"].workspace_bytes
          for mb in (1, 2, 4)}
    assert [round(ws[mb] / MIB) for mb in (1, 2, 4)] == [400, 416, 512]


@pytest.mark.parametrize(("src", "dst"), [(1, 8), (8, 1), (2, 3), (4, 16), (16, 1)])
def test_scaled_head_workspace_never_below_the_formula(src: int, dst: int) -> None:
    """Scaling keeps the head's fixed chunk of logits unscaled and never gives less than the formula
    at the new size (a workspace is the larger of a fixed and a growing phase); a block's workspace
    (no fixed part) scales linearly."""
    a = analytic_trace(LLAMA8B, H200, microbatch_size=src, seq_len=2048)
    want = analytic_trace(LLAMA8B, H200, microbatch_size=dst, seq_len=2048).kinds
    got = a.scaled_to(dst).kinds
    assert want["head"].workspace_bytes <= got["head"].workspace_bytes
    assert got["head"].workspace_fixed_bytes == a.kinds["head"].workspace_fixed_bytes
    assert got["block"].workspace_bytes == round(a.kinds["block"].workspace_bytes * dst / src)
    assert got["head"].saved_act_bytes == want["head"].saved_act_bytes


def test_scaled_workspace_with_a_fixed_part() -> None:
    """KindProfile.scaled: the larger of the whole scaled and the fixed part kept plus the rest scaled."""
    p = KindProfile(fwd_s=1.0, bwd_s=2.0, recompute_bwd_s=3.0, saved_act_bytes=10, saved_act_bytes_recompute=4,
                    workspace_bytes=100, workspace_fixed_bytes=90)
    assert p.scaled(2.0).workspace_bytes == 200 and p.scaled(0.5).workspace_bytes == 95
    assert p.scaled(0.5).workspace_fixed_bytes == 90 and p.scaled(2.0).saved_act_bytes == 20


def test_trace_for_picks_measured_else_analytic() -> None:
    """trace_for returns the measured trace on an exact match (GPU model, model, mb, seq), else analytic."""
    t = trace_for(LLAMA8B, H200, microbatch_size=1, seq_len=2048)
    assert t == load_trace("h200-llama-3.1-8b-mb1-seq2048") and not t.analytic
    assert not trace_for(LLAMA8B, H200, microbatch_size=8, seq_len=2048).analytic
    assert trace_for(LLAMA8B, H200, microbatch_size=3, seq_len=2048).analytic
    assert trace_for(LLAMA8B, H200, microbatch_size=1, seq_len=4096).analytic
    assert trace_for(LLAMA8B, RTX4090, microbatch_size=1, seq_len=2048).analytic
    assert trace_for(load_model("qwen3-1.7b"), H200, microbatch_size=1, seq_len=2048).analytic


def _measured(source: str, **fields: Any) -> ProfileTrace:
    from dataclasses import replace

    base = load_trace("h200-llama-3.1-8b-mb1-seq2048")
    return replace(base, source=source, **fields)


def test_trace_for_takes_a_matching_profile_before_the_shipped_ones() -> None:
    """`profiles` (from --profile) are searched first, in order, by the same rules as the shipped traces:
    GPU model and model name case-insensitively, microbatch size, sequence length and dtype exactly."""
    mine = _measured("mine", gpu_model="h200", model="LLAMA-3.1-8B")
    other = _measured("other")
    assert trace_for(LLAMA8B, H200, 1, 2048, profiles=(mine, other)).source == "mine"
    assert trace_for(LLAMA8B, H200, 1, 2048, profiles=(other, mine)).source == "other"
    for miss in (dict(microbatch_size=2), dict(seq_len=4096), dict(dtype="fp32"), dict(gpu_model="RTX 4090"),
                 dict(model="qwen3-1.7b")):
        t = trace_for(LLAMA8B, H200, 1, 2048, profiles=(_measured("miss", **miss),))
        assert t == load_trace("h200-llama-3.1-8b-mb1-seq2048")
        note = unmatched_note((_measured("miss", **miss),), t, LLAMA8B)
        assert note is not None and "H200 / llama-3.1-8b / microbatch 1 / seq 2048 / bf16" in note
        assert "shipped measured trace" in note
    assert unmatched_note((mine,), mine, LLAMA8B) is None and unmatched_note((), other, LLAMA8B) is None
    t = trace_for(LLAMA8B, RTX4090, 1, 2048, profiles=(mine,))
    assert t.analytic and "using the analytic trace" in (unmatched_note((mine,), t, LLAMA8B) or "")


def test_load_profiles_reads_files_and_directories(tmp_path: Path) -> None:
    """A directory gives every trace in it, sorted by file name, skipping JSON without `kinds` (the rates
    and hardware files `tinypipe profile` writes beside the traces); files are read in the order given."""
    a, b = _measured("a", microbatch_size=2), _measured("b", microbatch_size=4)
    (tmp_path / "z.json").write_text(json.dumps(a.to_json()))
    (tmp_path / "y.json").write_text(json.dumps(b.to_json()))
    (tmp_path / "rates.json").write_text(json.dumps({"format": "tinypipe-host-rates-v1", "h2d_gbps": 50.0}))
    (tmp_path / "hardware.json").write_text(json.dumps(load_hardware("h200x1").to_json()))
    (tmp_path / "notes.txt").write_text("not json")
    assert [t.source for t in load_profiles([str(tmp_path)])] == ["b", "a"]
    assert [t.source for t in load_profiles([str(tmp_path / "z.json"), str(tmp_path)])] == ["a", "b", "a"]
    assert load_profiles([]) == ()


@pytest.mark.parametrize(("setup", "message"), [
    (lambda d: None, r"--profile .*missing: no such file or directory"),
    (lambda d: (d / "missing").mkdir(), r"--profile .*missing: no profile trace in this directory"),
    (lambda d: (d / "missing").write_text("{oops"), r"missing: malformed JSON at line 1"),
    (lambda d: (d / "missing").write_text("[1, 2]"), r"missing: expected a JSON object, got"),
    (lambda d: ((d / "missing").mkdir(), (d / "missing" / "t.json").write_text('{"kinds": {}}')),
     r"t\.json: format: missing required field"),
])
def test_load_profiles_bad_input(tmp_path: Path, setup: Any, message: str) -> None:
    """A missing path, a directory without traces, malformed JSON or a bad trace is an InputError naming it."""
    setup(tmp_path)
    with pytest.raises(InputError, match=message):
        load_profiles([str(tmp_path / "missing")])


def test_analytic_is_marked_and_monotone_in_tokens() -> None:
    """An analytic trace says so; every time and size grows with the microbatch size and the sequence."""
    traces = [analytic_trace(LLAMA8B, RTX4090, microbatch_size=mb, seq_len=2048) for mb in (1, 2, 4, 8)]
    traces += [analytic_trace(LLAMA8B, RTX4090, microbatch_size=8, seq_len=4096)]
    for t in traces:
        assert t.analytic and t.source.startswith("analytic: ") and t.model == ""
        assert set(t.kinds) == {"embed", "block", "head"}
    for kind in ("embed", "block", "head"):
        for a, b in zip(traces[:-1], traces[1:], strict=True):
            pa, pb = a.kinds[kind], b.kinds[kind]
            assert pa.fwd_s < pb.fwd_s and pa.bwd_s < pb.bwd_s and pa.recompute_bwd_s < pb.recompute_bwd_s
            assert pa.saved_act_bytes <= pb.saved_act_bytes and pa.workspace_bytes <= pb.workspace_bytes
    block = traces[0].kinds["block"]
    assert block.bwd_s == 2 * block.fwd_s and block.recompute_bwd_s == pytest.approx(3 * block.fwd_s)
    assert block.saved_act_bytes == 168_064 * 2048 and block.workspace_bytes == 168_064 * 1024


def test_analytic_calibrated_on_measured_h200_block() -> None:
    """The analytic H200 Llama-3.1-8B block is within 10% of the measured one at every microbatch size."""
    # measured / analytic block forward: 1.96 / 1.979 ms = 0.990 at 1 x 2048 tokens (the calibration
    # point for MATMUL_FRACTION = 0.7, MEM_FRACTION = 0.8); 0.926, 0.907, 0.944 at 2, 4, 8 x 2048.
    # Forward+backward: 6.43 / 5.94 = 1.08 at 1 x 2048; the head's forward+backward 12.7 / 12.6 = 1.01
    # (the unchunked head's time; the chunked head took 19.7 ms).
    for mb in (1, 2, 4, 8):
        measured = load_trace(f"h200-llama-3.1-8b-mb{mb}-seq2048").kinds["block"]
        analytic = analytic_trace(LLAMA8B, H200, microbatch_size=mb, seq_len=2048).kinds["block"]
        assert 0.9 < measured.fwd_s / analytic.fwd_s < 1.1
        assert 0.9 < (measured.fwd_s + measured.bwd_s) / (analytic.fwd_s + analytic.bwd_s) < 1.1
    a1 = analytic_trace(LLAMA8B, H200, microbatch_size=1, seq_len=2048).kinds["block"]
    assert 1.96e-3 / a1.fwd_s == pytest.approx(0.990, abs=0.005)


def test_scaled_to_is_linear_in_tokens() -> None:
    """scaled_to doubles every time and size from 1 to 2 sequences and says so in the source."""
    t = load_trace("h200-llama-3.1-8b-mb1-seq2048")
    s = t.scaled_to(2)
    assert s.microbatch_size == 2 and s.seq_len == 2048 and not s.analytic
    assert s.kinds["block"] == KindProfile(
        fwd_s=0.00392, bwd_s=0.00894, recompute_bwd_s=0.01286, saved_act_bytes=2 * 168_064 * 2048,
        saved_act_bytes_recompute=2 * 8192 * 2048, workspace_bytes=2 * (1056 * MIB - 168_064 * 2048))
    assert "scaled linearly in tokens from microbatch_size 1 to 2" in s.source
    assert t.scaled_to(1) is t
    with pytest.raises(InputError):
        t.scaled_to(0)


def test_json_round_trip(tmp_path: Path) -> None:
    """to_json / from_json round-trips an analytic trace through a file."""
    t = analytic_trace(LLAMA8B, H200, microbatch_size=2, seq_len=1024)
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t.to_json()))
    assert load_trace(str(p)) == t
    c = load_trace("h200-llama-3.1-8b-mb4-seq2048-compiled")
    p.write_text(json.dumps(c.to_json()))
    assert load_trace(str(p)) == c and c.compiled


LOOP = LoopTimes(fwd_s=1.5e-3, recompute_bwd_s=6e-3, fwd_beside_optimizer_s=1.6e-3,
                 recompute_bwd_beside_optimizer_s=6.5e-3)


def with_loop(t: ProfileTrace, loop: LoopTimes = LOOP) -> ProfileTrace:
    return replace(t, kinds={**t.kinds, "block": replace(t.kinds["block"], loop=loop)})


def test_loop_charges_the_issue_where_it_is_longer_than_the_device() -> None:
    """A looped FWD / BWD costs the larger of its device time and its issue time, in each condition; the
    issue times survive JSON and scaling (the host's work does not grow with tokens); without them
    (traces before them) the device's times are charged as before."""
    issued = replace(LOOP, fwd_issue_s=2.2e-3, recompute_bwd_issue_s=1e-3, fwd_issue_beside_optimizer_s=1.0e-3,
                     recompute_bwd_issue_beside_optimizer_s=9e-3)
    assert issued.compute_s(True, False) == 2.2e-3 and issued.compute_s(False, False) == LOOP.recompute_bwd_s
    assert issued.compute_s(True, True) == LOOP.fwd_beside_optimizer_s and issued.compute_s(False, True) == 9e-3
    assert LoopTimes.from_json(Fields(issued.to_json(), "loop")) == issued
    assert issued.scaled(2).fwd_issue_s == 2.2e-3 and issued.scaled(2).compute_s(True, False) == 3e-3
    assert LOOP.issue_s(True, False) == 0.0 and LOOP.compute_s(True, False) == LOOP.fwd_s
    kp = KindProfile(fwd_s=2e-3, bwd_s=4e-3, recompute_bwd_s=6e-3, saved_act_bytes=1, saved_act_bytes_recompute=1,
                     workspace_bytes=1, loop=issued)
    assert kp.compute_s(True, True) == 2.2e-3 and kp.least_compute_s(True, True) == LOOP.fwd_beside_optimizer_s
    assert kp.least_compute_s(True, True, issue=False) == LOOP.fwd_s  # the floor's: the device's time
    assert "fwd_issue_s" not in LOOP.to_json()


def test_json_round_trip_with_and_without_loop(tmp_path: Path) -> None:
    """A block's `loop` is written only when present, under the same format, and reads back equal; a trace
    without it (every shipped one) writes no `loop` key and reads back without it."""
    t = load_trace("h200-llama-3.1-8b-mb2-seq2048")
    assert all(k.loop is None for k in t.kinds.values()) and "loop" not in json.dumps(t.to_json())
    looped = with_loop(t)
    obj = looped.to_json()
    assert obj["format"] == FORMAT and obj["kinds"]["block"]["loop"] == {
        "fwd_s": 1.5e-3, "recompute_bwd_s": 6e-3, "fwd_beside_optimizer_s": 1.6e-3,
        "recompute_bwd_beside_optimizer_s": 6.5e-3}
    assert "loop" not in obj["kinds"]["embed"] and "loop" not in obj["kinds"]["head"]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(obj))
    assert load_trace(str(p)) == looped


@pytest.mark.parametrize(("value", "message"), [
    (0.0, r"kinds\.block\.loop\.fwd_beside_optimizer_s: must be > 0, got 0.0"),
    ("1", r"kinds\.block\.loop\.fwd_beside_optimizer_s: expected a number"),
    (None, r"kinds\.block\.loop\.fwd_beside_optimizer_s: missing required field"),
])
def test_bad_loop_fields(tmp_path: Path, value: Any, message: str) -> None:
    """Every loop time is a positive number, named with its place in the file when it is not."""
    obj = with_loop(load_trace("h200-llama-3.1-8b-mb2-seq2048")).to_json()
    obj["kinds"]["block"]["loop"]["fwd_beside_optimizer_s"] = value
    p = tmp_path / "t.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(InputError, match=message):
        load_trace(str(p))


def test_compute_s_is_the_one_rule() -> None:
    """A recomputed layer with loop times costs them (beside the optimizer or alone); a layer not recomputed,
    or one without loop times, the isolated ones (fwd_s; recompute_bwd_s or bwd_s). least_compute_s takes
    the lesser of alone and beside; scaling scales the loop with the rest."""
    iso = KindProfile(fwd_s=2e-3, bwd_s=4e-3, recompute_bwd_s=6e-3, saved_act_bytes=1, saved_act_bytes_recompute=1,
                      workspace_bytes=1)
    kp = replace(iso, loop=replace(LOOP, fwd_beside_optimizer_s=1.4e-3))
    got = [(f, r, b, kp.compute_s(f, r, beside_optimizer=b), iso.compute_s(f, r, beside_optimizer=b))
           for f in (True, False) for r in (True, False) for b in (False, True)]
    assert got == [(True, True, False, 1.5e-3, 2e-3), (True, True, True, 1.4e-3, 2e-3),
                   (True, False, False, 2e-3, 2e-3), (True, False, True, 2e-3, 2e-3),
                   (False, True, False, 6e-3, 6e-3), (False, True, True, 6.5e-3, 6e-3),
                   (False, False, False, 4e-3, 4e-3), (False, False, True, 4e-3, 4e-3)]
    assert (kp.least_compute_s(True, True), kp.least_compute_s(False, True)) == (1.4e-3, 6e-3)
    assert kp.scaled(2).loop == LoopTimes(3e-3, 12e-3, 2.8e-3, 13e-3)


def test_issue_gaps_are_optional_and_kept_by_scaling(tmp_path: Path) -> None:
    """The loop's issue gaps default to 0 and are written only when measured (traces before them read the
    same); `issue_gap_s` gives them for a recomputed layer with loop times (alone or beside the optimizer)
    and 0 otherwise; scaling to another microbatch size keeps them (host time between two actions); a
    negative gap is an error naming the field."""
    iso = KindProfile(fwd_s=2e-3, bwd_s=4e-3, recompute_bwd_s=6e-3, saved_act_bytes=1, saved_act_bytes_recompute=1,
                      workspace_bytes=1)
    gapped = replace(LOOP, fwd_gap_s=1e-4, recompute_bwd_gap_s=3e-4, fwd_gap_beside_optimizer_s=2e-4,
                     recompute_bwd_gap_beside_optimizer_s=6e-4)
    kp = replace(iso, loop=gapped)
    assert [kp.issue_gap_s(f, True, beside_optimizer=b) for f in (True, False) for b in (False, True)] == [
        1e-4, 2e-4, 3e-4, 6e-4]
    assert kp.issue_gap_s(True, False) == replace(iso, loop=LOOP).issue_gap_s(False, True) == iso.issue_gap_s(
        True, True) == 0.0
    assert kp.scaled(2).loop == replace(gapped, fwd_s=3e-3, recompute_bwd_s=12e-3, fwd_beside_optimizer_s=3.2e-3,
                                        recompute_bwd_beside_optimizer_s=13e-3)
    assert "fwd_gap_s" not in LOOP.to_json() and gapped.to_json()["recompute_bwd_gap_beside_optimizer_s"] == 6e-4
    t = with_loop(load_trace("h200-llama-3.1-8b-mb2-seq2048"), gapped)
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t.to_json()))
    assert load_trace(str(p)) == t
    obj = t.to_json()
    obj["kinds"]["block"]["loop"]["fwd_gap_s"] = -1e-4
    p.write_text(json.dumps(obj))
    with pytest.raises(InputError, match=r"kinds\.block\.loop\.fwd_gap_s: must be >= 0"):
        load_trace(str(p))


def test_base_plan_takes_the_loops_alone_times_for_recomputed_blocks() -> None:
    """The analytic side (`base_plan`, what the cost model and search read) uses `compute_s` alone: a
    recomputing policy's blocks get the loop's times, the head and a non-recomputing policy the isolated
    ones."""
    model = LLAMA8B
    hw = load_hardware("h200x2")
    t = load_trace("h200-llama-3.1-8b-mb2-seq2048")
    looped = with_loop(t)
    policy = PRESETS["tinypipe"].replace(microbatch_size=2)
    plan = base_plan(policy, model, hw, looped)
    block, head = 1, len(model.layers) - 1
    assert (plan.fwd_s[block], plan.bwd_s[block]) == (1.5e-3, 6e-3)
    assert (plan.fwd_s[head], plan.bwd_s[head]) == (t.kinds["head"].fwd_s, t.kinds["head"].bwd_s)
    assert base_plan(policy, model, hw, t).fwd_s[block] == t.kinds["block"].fwd_s
    keep = base_plan(policy.replace(recompute=False), model, hw, looped)
    assert (keep.fwd_s[block], keep.bwd_s[block]) == (t.kinds["block"].fwd_s, t.kinds["block"].bwd_s)


def test_unknown_trace_lists_shipped() -> None:
    """An unknown trace name is an InputError listing the shipped ones."""
    with pytest.raises(InputError, match="unknown trace 'nope'.*h200-llama-3.1-8b-mb1-seq2048"):
        load_trace("nope")


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda o: o["kinds"]["block"].__setitem__("fwd_s", -1.0), r"t\.json: kinds\.block\.fwd_s: must be >= 0"),
    (lambda o: o["kinds"].pop("head"), r"t\.json: kinds\.head: missing required field"),
    (lambda o: o["kinds"].__setitem__("mlp", {}), r"t\.json: kinds: unknown layer kind 'mlp'"),
    (lambda o: o.__setitem__("microbatch_size", 0), r"t\.json: microbatch_size: must be >= 1"),
    (lambda o: o.__setitem__("dtype", "int4"), r"t\.json: dtype: must be one of"),
])
def test_bad_trace_fields(tmp_path: Path, mutate: Any, message: str) -> None:
    """A bad field in a trace file is an InputError naming the file and the field."""
    obj = load_trace("h200-llama-3.1-8b-mb1-seq2048").to_json()
    mutate(obj)
    p = tmp_path / "t.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(InputError, match=message):
        load_trace(str(p))


_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**63) | st.floats()
            | st.text(max_size=8))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.text(max_size=8) | st.sampled_from(["kinds", "block", "embed", "head", "fwd_s", "gpu_model"]), c,
    max_size=6), max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_json, key=st.sampled_from(["gpu_model", "dtype", "microbatch_size", "seq_len", "kinds",
                                         "analytic", "source", "model"]))
def test_arbitrary_json_only_raises_input_error(tmp_path: Path, value: Any, key: str) -> None:
    """Arbitrary JSON, or a valid trace with one field replaced by it, loads or raises InputError."""
    obj = load_trace("h200-llama-3.1-8b-mb1-seq2048").to_json()
    obj[key] = value
    for candidate in (value, obj):
        p = tmp_path / "t.json"
        p.write_text(json.dumps(candidate))
        try:
            assert isinstance(load_trace(str(p)), ProfileTrace)
        except InputError:
            pass


def test_a_lora_run_takes_a_trace_measured_with_its_adapters() -> None:
    """`profile --lora` traces carry their adapters: a LoRA policy with the same adapters takes one as it is
    (no scaling), a full-training trace otherwise (scaled for the frozen base); other adapters or a
    full-training policy refuse a LoRA trace."""
    from tinypipe.estimate.lora_costs import frozen_trace, trace_for_policy
    from tinypipe.policy.lora_spec import LoraSpec

    lora = LoraSpec(rank=16, alpha=32.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    full = load_trace("h200-llama-3.1-8b-mb4-seq2048-compiled")
    measured = replace(full, lora=lora.text(), source="lora")
    assert ProfileTrace.from_json(json.loads(json.dumps(measured.to_json()))).lora == lora.text()
    assert "lora" not in full.to_json()
    assert trace_for(LLAMA8B, H200, 4, 2048, profiles=(measured,), compiled=True, lora=lora.text()) is measured
    assert trace_for(LLAMA8B, H200, 4, 2048, profiles=(measured,), compiled=True) == full  # a full run: not it
    other = LoraSpec(rank=8, alpha=16.0, targets=("q", "v"))
    assert trace_for(LLAMA8B, H200, 4, 2048, profiles=(measured,), compiled=True, lora=other.text()) == full
    assert trace_for_policy(measured, LLAMA8B, lora) is measured
    assert trace_for_policy(full, LLAMA8B, lora) == frozen_trace(full, LLAMA8B, lora)
    for policy_lora in (None, other):
        with pytest.raises(InputError, match="measured with LoRA"):
            trace_for_policy(measured, LLAMA8B, policy_lora)
