"""The optimizer state's precision in the host model: bytes, checkpoint size, optimizer time, the policy,
the schedule's text form, the simulator, the search (only when asked) and `inspect model`."""

from __future__ import annotations

import json

import pytest

from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.model import LayerKind, LayerSpec, ModelSpec
from tinypipe.describe.target import Target
from tinypipe.describe.trace import analytic_trace
from tinypipe.describe.workload import Workload
from tinypipe.estimate.hostmem import (
    CHECKPOINT_SLACK_BYTES,
    QUANT_BLOCK_ELEMS,
    STATE_TIME_FACTOR,
    checkpoint_bytes,
    host_bytes,
    moment_bytes,
    optimizer_step_s,
)
from tinypipe.ir.schedule import Schedule
from tinypipe.policy import PRESETS, Policy
from tinypipe.policy.modes import ActivationHome, OptimizerState, ResidentMode, SwapMode
from tinypipe.search.policy_search import SearchSpace, SearchTarget, search


def _model(sizes: list[int]) -> ModelSpec:
    layers = tuple(LayerSpec(i, LayerKind.BLOCK, f"block.{i}", n, n, 2.0 * n, 0.0, 8, 4) for i, n in enumerate(sizes))
    return ModelSpec("m", "llama", layers, 4, 16, len(sizes), False, 64, "test")


def test_moment_bytes_per_precision() -> None:
    """fp32 8 B/param, bf16 4, 8bit 2 plus an fp32 absmax per block of each moment (a partial block counts)."""
    n = 10 * QUANT_BLOCK_ELEMS + 1
    assert moment_bytes(n, "fp32") == 8 * n
    assert moment_bytes(n, "bf16") == 4 * n
    assert moment_bytes(n, "8bit") == 2 * n + 2 * 4 * 11


def test_compact_host_bytes_and_checkpoint_follow_the_state() -> None:
    """compact: master 4 B/param + the moments as held + the ring; a checkpoint is the master and the moments
    (no ring) plus its slack; replicated refuses a low-precision state."""
    m = _model([4096, 8192])
    for state, moments in (("fp32", 8 * 12288), ("bf16", 4 * 12288), ("8bit", 2 * 12288 + 8 * (16 + 32))):
        h = host_bytes(m, "compact", optimizer_state=state)
        assert (h.master_bytes, h.optim_state_bytes) == (4 * 12288, moments)
        assert checkpoint_bytes(m, "compact", optimizer_state=state) == 4 * 12288 + moments + CHECKPOINT_SLACK_BYTES
    assert checkpoint_bytes(m, "replicated") == (4 + 2 + 8) * 12288 + CHECKPOINT_SLACK_BYTES
    with pytest.raises(ValueError, match="compact"):
        host_bytes(m, "replicated", optimizer_state="8bit")


def test_llama_8b_state_bytes_per_param() -> None:
    """Llama-3.1-8B (8,030,261,248 parameters): 12, 8 and 6.03 B/param of state under compact, before the ring."""
    m = load_model("llama-3.1-8b")
    per = {s: (host_bytes(m, "compact", optimizer_state=s).total_bytes - host_bytes(m, "compact").grad_bytes)
           / m.params for s in OptimizerState}
    assert per[OptimizerState.FP32] == 12.0 and per[OptimizerState.BF16] == 8.0
    assert per[OptimizerState.INT8] == pytest.approx(2 + 4 + 8 / QUANT_BLOCK_ELEMS, abs=1e-4)


def test_optimizer_time_scales_by_the_measured_state_factor() -> None:
    """Without a measured step, a layer's host optimizer time under each state is fp32's times its factor."""
    hw = load_hardware("rtx4090x1")
    layer = _model([1 << 20]).layers[0]
    base = optimizer_step_s(layer, "compact", hw.host)
    for state in OptimizerState:
        assert optimizer_step_s(layer, "compact", hw.host, optimizer_state=state) == pytest.approx(
            base * STATE_TIME_FACTOR[state])


def test_a_profiled_host_rate_per_state_is_used_and_round_trips() -> None:
    """A hardware whose host `tinypipe profile` measured per moment precision: the simulator charges each
    state its own measured rate (not the factor), and the preset JSON keeps the rates."""
    import dataclasses

    from tinypipe.describe.hardware import Hardware
    from tinypipe.estimate.hostmem import optimizer_s_per_param

    hw = load_hardware("rtx4090x1")
    host = dataclasses.replace(hw.host, compact_params_per_s=4e9, compact_bf16_params_per_s=5e9,
                               compact_8bit_params_per_s=2e9)
    measured = Hardware(name="m", provenance="measured", source="test", host=host, gpus=hw.gpus,
                        switches=hw.switches, links=hw.links, gpu_p2p=hw.gpu_p2p)
    assert [optimizer_s_per_param(measured.host, "compact", s) for s in ("fp32", "bf16", "8bit")] == [
        1 / 4e9, 1 / 5e9, 1 / 2e9]
    assert Hardware.from_json(measured.to_json()).host == host


def test_policy_schedule_and_simulator_carry_the_state() -> None:
    """The policy field round-trips through JSON, needs compact; the schedule's text form carries it (and
    leaves it out for fp32, so older schedules read as fp32); the compiled host state shrinks with it."""
    p = PRESETS["tinypipe"].replace(optimizer_state="8bit")
    assert Policy.from_json(json.loads(p.dumps())) == p
    with pytest.raises(Exception, match="optimizer_state: 8bit moments need host_memory compact"):
        PRESETS["mobius"].replace(optimizer_state="8bit")
    model, hw = load_model("llama-3.1-8b"), load_hardware("rtx4090x1")
    trace = analytic_trace(model, hw.gpus[0], microbatch_size=1, seq_len=2048)
    statics = {}
    for state in OptimizerState:
        sched = compile_schedule(p.replace(optimizer_state=state), model, hw, trace, iterations=1)
        text = sched.dumps()
        assert ("optimizer_state=" in text) == (not state.exact)
        assert Schedule.loads(text).optimizer_state == state
        statics[state] = sched.static("host")
    assert statics[OptimizerState.FP32] - statics[OptimizerState.INT8] == (
        host_bytes(model, "compact").optim_state_bytes - host_bytes(model, "compact", optimizer_state="8bit")
        .optim_state_bytes)


def test_search_finds_a_full_fine_tuning_of_llama_8b_on_a_64gb_workstation_only_when_asked() -> None:
    """rtx4090x1 (24 GB GPU, 64 GiB host): with fp32 moments nothing fits (the compact state alone is 93.7 GiB)
    and the advice names --optimizer-state; with 8-bit moments a policy fits (a narrow space for speed)."""
    from tinypipe.sim.evaluate import SimEvaluator

    model, hw = load_model("llama-3.1-8b"), load_hardware("rtx4090x1")
    w = SearchTarget(Workload(model=model, seq_len=2048, batch_tokens=32 * 2048), Target(hardware=hw))
    narrow = dict(microbatch_sizes=(2,), pack_sizes=(2,), packers=(), swaps=(SwapMode.LAYER,), recompute=(True,),
                  activation_homes=(ActivationHome.GPU,), mappings=("cross",), prefetch_depths=(1,),
                  residents=(ResidentMode.AUTO,))
    evaluate = SimEvaluator(model, hw, 2048, None, None)
    exact = search(w, evaluate, space=SearchSpace(**narrow))
    assert exact.winner is None and any("--optimizer-state" in line for line in exact.advice)
    low = search(w, evaluate, space=SearchSpace(**narrow, optimizer_state="8bit"))
    assert low.winner is not None and low.winner.policy.optimizer_state == OptimizerState.INT8
    assert low.winner.peak_host_bytes <= hw.host.memory_bytes


def test_inspect_model_shows_each_state(capsys: pytest.CaptureFixture[str]) -> None:
    """`inspect model` lists the host bytes of compact with each moment precision and whether each fits."""
    from tinypipe.cli import main

    assert main(["inspect", "model", "llama-3.1-8b", "--hardware", "rtx4090x1", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep["host"]) == {"replicated", "compact", "compact-bf16", "compact-8bit"}
    fit = rep["fit"][0]
    assert (fit["host_fits_compact"], fit["host_fits_compact-8bit"]) == (False, True)


def test_coverage_table_for_a_64gb_workstation_and_a_1tb_server() -> None:
    """`inspect coverage` on rtx4090x1 (24 GB GPU): the largest model each system fully fine-tunes, literal.
    At 64 GiB only low-precision moments reach Llama-3.1-8B (12.5 B/param fp32 does not; ZeRO-Offload's 16 and
    RoundPipe's 21.9 stop at 4B and 1.7B); at 1 TiB tinypipe reaches Llama-3.1-70B at every precision,
    which ZeRO-Offload's 16 B/param (1,051 GiB) misses."""
    from tinypipe.estimate.coverage import COVERAGE_MODELS, coverage

    rows = coverage(load_hardware("rtx4090x1"), [load_model(n) for n in COVERAGE_MODELS])
    got = {r["host_gib"]: [r[k] for k in ("tinypipe fp32", "tinypipe bf16", "tinypipe 8bit", "RoundPipe",
                                          "ZeRO-Offload")] for r in rows}
    assert got == {
        64: ["qwen3-4b", "llama-3.1-8b", "llama-3.1-8b", "qwen3-1.7b", "qwen3-4b"],
        128: ["llama-3.1-8b", "qwen3-14b", "qwen3-14b", "qwen3-4b", "llama-3.1-8b"],
        256: ["qwen3-14b", "qwen3-32b", "qwen3-32b", "llama-3.1-8b", "qwen3-14b"],
        512: ["qwen3-32b", "qwen3-32b", "llama-3.1-70b", "qwen3-14b", "qwen3-32b"],
        1024: ["llama-3.1-70b", "llama-3.1-70b", "llama-3.1-70b", "qwen3-32b", "qwen3-32b"],
    }
    # LoRA: one bf16 copy of the base (2 B/param: Qwen3-32B's 61 GiB fits 64, Llama-3.1-70B's 131 GiB needs 256);
    # RoundPipe+peft's measured 4.8 B/param stops at Llama-3.1-8B on 64 GiB
    lora = {r["host_gib"]: (r["tinypipe LoRA"], r["RoundPipe+peft LoRA"]) for r in rows}
    assert lora == {64: ("qwen3-32b", "llama-3.1-8b"), 128: ("qwen3-32b", "qwen3-14b"),
                    256: ("llama-3.1-70b", "qwen3-32b"), 512: ("llama-3.1-70b", "llama-3.1-70b"),
                    1024: ("llama-3.1-70b", "llama-3.1-70b")}


def test_new_model_configs_have_the_published_parameter_counts() -> None:
    """Qwen3-4B and Qwen3-14B from their public config.json: 4,022,468,096 and 14,768,307,200 parameters."""
    assert load_model("qwen3-4b").params == 4_022_468_096
    assert load_model("qwen3-14b").params == 14_768_307_200


def test_parked_activations_count_against_host_memory_and_a_tight_host_keeps_them_on_the_gpu() -> None:
    """Llama-3.1-8B on rtx4090x1 with 8-bit moments: activations parked on the host raise the simulated host
    peak by 14 GiB (the simulator's ledger: the most parked at once), at most what the plan counts for them
    (every microbatch's recomputed layer inputs: 16 GiB); parked, the policy fits 64 GiB but not 56, kept on
    the GPU it fits both, and the search, given both homes under --host-mem 56GiB, keeps them on the GPU."""
    from tinypipe.estimate.plan import base_plan
    from tinypipe.sim import simulate
    from tinypipe.sim.evaluate import SimEvaluator

    model, hw = load_model("llama-3.1-8b"), load_hardware("rtx4090x1")
    p = PRESETS["tinypipe"].replace(packing="uniform", pack_size=2, mapping="cross", prefetch_depth=1, microbatches=16,
                                    microbatch_size=2, optimizer="sync", optimizer_state="8bit")
    trace = analytic_trace(model, hw.gpus[0], microbatch_size=2, seq_len=2048)
    peaks = {}
    for home in ActivationHome:
        q = p.replace(activation_home=home)
        sched = compile_schedule(q, model, hw, trace, iterations=2)
        peaks[home] = simulate(sched, model, hw, trace).peak_host_bytes
    plan = base_plan(p.replace(activation_home="host"), model, hw, trace)
    parked = plan.host_dynamic_bytes - base_plan(p, model, hw, trace).host_dynamic_bytes
    assert 0.8 * parked <= peaks[ActivationHome.HOST] - peaks[ActivationHome.GPU] <= parked
    tight = 56 << 30
    fits = {ActivationHome.HOST: {None: True, tight: False}, ActivationHome.GPU: {None: True, tight: True}}
    for home, want in fits.items():
        for limit, ok in want.items():
            assert SimEvaluator(model, hw, 2048, None, limit)(p.replace(activation_home=home)).fits == ok, home
    narrow = dict(microbatch_sizes=(2,), pack_sizes=(2,), packers=(), swaps=(SwapMode.LAYER,), recompute=(True,),
                  mappings=("cross",), prefetch_depths=(1,), residents=(ResidentMode.AUTO,), optimizer_state="8bit")
    w = SearchTarget(Workload(model=model, seq_len=2048, batch_tokens=32 * 2048),
                     Target(hardware=hw, host_mem_bytes=tight))
    res = search(w, SimEvaluator(model, hw, 2048, None, tight), space=SearchSpace(**narrow))
    assert res.winner is not None and res.winner.policy.activation_home == ActivationHome.GPU
