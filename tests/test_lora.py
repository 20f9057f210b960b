"""LoRA on a frozen base in the core: the spec, its parameters and times, host and GPU bytes, the schedule."""

from __future__ import annotations

import dataclasses

import pytest

from tinypipe.cli import main
from tinypipe.cli.inspect_tables import model_report
from tinypipe.common.errors import InputError
from tinypipe.compiler import compile_schedule
from tinypipe.compiler.compile import make_plan
from tinypipe.compiler.validate import validate
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.estimate import gpumem
from tinypipe.estimate.lora_costs import (
    adapter_params,
    frozen_factors,
    frozen_host_bytes,
    frozen_trace,
    model_adapter_params,
)
from tinypipe.ir.kinds import Kind
from tinypipe.ir.schedule import Schedule
from tinypipe.policy.lora_spec import ROLES, LoraSpec, parse_targets
from tinypipe.policy.modes import OptimizerMode
from tinypipe.policy.policy import PRESETS, Policy
from tinypipe.sim import simulate

ALL = LoraSpec(rank=16, alpha=32, targets=ROLES)


def test_defaults_are_peft_loraconfigs() -> None:
    """r 8, alpha 8, dropout 0, q and v (peft's LoraConfig() and its target mapping for Llama / Qwen / Mistral)."""
    s = LoraSpec()
    assert (s.rank, s.alpha, s.dropout, s.targets, s.scaling) == (8, 8.0, 0.0, ("q", "v"), 1.0)


def test_spec_round_trips_and_refuses_nonsense() -> None:
    """The header token and the policy JSON give the spec back; bad values are one-line InputErrors."""
    s = LoraSpec(rank=4, alpha=16, dropout=0.05, targets=("down", "q", "q"))
    assert s.targets == ("q", "down")
    assert LoraSpec.parse(s.text()) == s
    p = Policy(name="x", lora=s)
    assert Policy.from_json(p.to_json()) == p
    assert Policy.from_json(Policy(name="x").to_json()).lora is None
    for bad in ({"rank": 0}, {"alpha": 0}, {"dropout": 1.0}, {"targets": ("qq",)}, {"targets": ()}):
        with pytest.raises(InputError):
            LoraSpec(**bad)  # type: ignore[arg-type]
    with pytest.raises(InputError):
        LoraSpec.parse("r4,a1")
    with pytest.raises(InputError):
        Policy.from_json({"lora": {"rank": 2, "bogus": 1}})
    assert parse_targets("all") == ROLES
    with pytest.raises(InputError):
        parse_targets("q,x")


def test_adapter_parameters_of_llama_8b() -> None:
    """r x (in + out) per wrapped linear: Llama-3.1-8B, r 16, all seven linears: 1,310,720 a block, 41,943,040 in all;
    q and v only, r 8: 8 x (4096 + 4096 + 4096 + 1024) per block."""
    m = load_model("llama-3.1-8b")
    assert adapter_params(m.layers[1], ALL) == 16 * (2 * 8192 + 2 * 5120 + 3 * (4096 + 14336))
    assert model_adapter_params(m, ALL) == 41_943_040
    assert model_adapter_params(m, LoraSpec()) == 32 * 8 * (8192 + 5120)
    assert adapter_params(m.layers[0], ALL) == adapter_params(m.layers[-1], ALL) == 0


def test_frozen_times_and_host_bytes() -> None:
    """A frozen block's backward is cheaper than a full one (no weight-gradient GEMM), its forward a little dearer
    (the adapters); the embedding's backward is nothing; the host holds 2 bytes a parameter in bf16."""
    m = load_model("llama-3.1-8b")
    f, b = frozen_factors(m.layers[1], ALL, 2048)
    assert 1.0 < f < 1.05 and 0.5 < b < 0.6
    assert frozen_factors(m.layers[0], ALL, 2048) == (1.0, 0.0)
    hw = load_hardware("h200x1")
    tr = trace_for(m, hw.gpus[0], 1, 2048)
    fz = frozen_trace(tr, m, ALL)
    assert fz.kinds["block"].recompute_bwd_s < tr.kinds["block"].recompute_bwd_s
    assert fz.kinds["block"].optimizer is None
    assert frozen_host_bytes(m).total_bytes == 2 * m.params


def test_schedule_has_no_host_optimizer_and_steps_adapters_on_the_gpu() -> None:
    """No GRAD_OUT, no OPT_STEP; one ADAPT_STEP per block and iteration on the owner's compute stream right after
    its last BWD; adapters' bytes static on the GPU; the text form keeps the spec; the validator accepts it."""
    m = load_model("qwen3-1.7b")
    hw = load_hardware("h200x2")
    tr = trace_for(m, hw.gpus[0], 1, 2048)
    for opt in OptimizerMode:
        s = compile_schedule(PRESETS["tinypipe"].replace(lora=ALL, optimizer=opt), m, hw, tr, iterations=2)
        validate(s)
        kinds = [a.kind for a in s.actions]
        assert Kind.GRAD_OUT not in kinds and Kind.OPT_STEP not in kinds
        steps = [a for a in s.actions if a.kind is Kind.ADAPT_STEP]
        assert len(steps) == 2 * m.num_blocks
        for a in steps:
            lane = s.by_resource()[a.resource]
            prev = s.actions[lane[lane.index(a.id) - 1]]
            assert prev.kind is Kind.BWD and prev.layer == a.layer and a.resource.endswith(".compute")
            assert a.nbytes == 4 * adapter_params(m.layers[a.layer], ALL)
        gpu_static = sum(b for d, b in s.static_bytes if d != "host")
        assert gpu_static == 16 * model_adapter_params(m, ALL)
        assert s.static("host") == 2 * m.params
        assert all(not x.buffer.startswith("gr.") for a in s.actions for x in a.allocs)
        assert Schedule.loads(s.dumps()) == s


def test_simulated_lora_is_faster_and_lighter_than_full() -> None:
    """Llama-3.1-8B on one H200, 32 x 2048 tokens: LoRA's simulated iteration is shorter than full fine-tuning's,
    its host peak is the bf16 copy (no master, moments or ring), and its GPU ledger holds the adapters."""
    m = load_model("llama-3.1-8b")
    hw = load_hardware("h200x1")
    tr = trace_for(m, hw.gpus[0], 1, 2048)
    pol = PRESETS["tinypipe"].replace(microbatches=32)
    full = simulate(compile_schedule(pol, m, hw, tr, iterations=2), m, hw, tr)
    sched = compile_schedule(pol.replace(lora=ALL), m, hw, tr, iterations=2)
    lora = simulate(sched, m, hw, tr)
    assert lora.tokens_per_s > 1.2 * full.tokens_per_s
    assert lora.peak_host_bytes < 0.2 * full.peak_host_bytes
    assert lora.peak_host_bytes >= 2 * m.params
    assert lora.peak_gpu_bytes >= 16 * model_adapter_params(m, ALL)
    # the GPU-memory formula counts the adapters and no base gradients
    plan = make_plan(pol.replace(lora=ALL), m, hw, tr, iterations=2)
    formula = gpumem.gpu_peak_bytes(plan, tuple(len(p) for p in plan.pack_layers), plan.pack_gpu, 1,
                                    kept=plan.kept, pinned=plan.pinned)[0]
    assert formula >= 16 * model_adapter_params(m, ALL)
    assert abs(formula - lora.peak_gpu_bytes) / lora.peak_gpu_bytes < 0.15


def test_inspect_shows_lora_fits_one_h200_with_256_gb_host() -> None:
    """Llama-3.1-70B on a 1 x H200 box with 256 GB of host memory: neither full layout fits its host, LoRA
    does (131 GiB of bf16 base); on the 125 GiB H200 machine LoRA does not."""
    hw = load_hardware("h200x1")
    big = dataclasses.replace(hw, host=dataclasses.replace(hw.host, memory_bytes=256 * 10**9))
    (small,) = model_report(load_model("llama-3.1-70b"), seq_len=2048, microbatch_size=1, hardware=[hw])["fit"]
    assert not small["lora_fits"]
    rep = model_report(load_model("llama-3.1-70b"), seq_len=2048, microbatch_size=1, hardware=[big])
    (fit,) = rep["fit"]
    assert not fit["host_fits_compact"] and not fit["host_fits_replicated"] and fit["lora_fits"]
    assert rep["lora"]["host_bytes"] == 2 * rep["params"]


def test_cli_lora_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`--lora R` reaches simulate; a LoRA flag without it is `error:` and exit 2."""
    assert main(["simulate", "--model", "qwen3-1.7b", "--hardware", "h200x1", "--policy", "tinypipe",
                 "--lora", "16", "--lora-targets", "all", "--lora-alpha", "32", "--iterations", "2", "--json"]) == 0
    assert main(["simulate", "--lora-alpha", "3"]) == 2
    assert "needs --lora R" in capsys.readouterr().err


def test_a_trace_measured_with_the_adapters_is_not_scaled_again() -> None:
    """`profile --lora` measures the frozen block with its adapters: the floor and the simulator take those times as
    they are (every FWD / BWD at the trace's time, and the adapter steps), where a full-training trace is scaled for
    the frozen base; the same trace marked as measured with other adapters is refused."""
    from tinypipe.estimate.floor import schedule_floor
    from tinypipe.estimate.lora_costs import adapter_step_s
    from tinypipe.ir.kinds import Cost, Direction

    m = load_model("llama-3.1-8b")
    hw = load_hardware("h200x1")
    tr = trace_for(m, hw.gpus[0], 1, 2048)
    measured = dataclasses.replace(tr, lora=ALL.text())  # the full trace's times, as if measured with the adapters
    sched = compile_schedule(PRESETS["tinypipe"].replace(lora=ALL, microbatches=8), m, hw, measured, iterations=1)
    want = 0.0
    for a in sched.actions:
        info = a.kind.info
        if info.cost is Cost.COMPUTE:
            kp = tr.layer(m.layers[a.layer])
            want += kp.least_compute_s(info.direction is Direction.FORWARD, sched.recomputes(a.layer), issue=False)
        elif info.cost is Cost.DEVICE_OPTIMIZER:
            want += adapter_step_s(a.nbytes // 4, hw.gpus[0])
    assert schedule_floor(sched, m, hw, measured).compute_s == pytest.approx(want, rel=1e-12)
    assert schedule_floor(sched, m, hw, tr).compute_s < 0.9 * want  # a full trace: the frozen backward is cheaper
    sim = simulate(sched, m, hw, measured)
    assert sim.busy_fraction["g0.compute"] * sim.iteration_s == pytest.approx(want, rel=0.02)
    other = dataclasses.replace(tr, lora=LoraSpec(rank=4).text())
    with pytest.raises(InputError, match="measured with LoRA"):
        simulate(sched, m, hw, other)


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_search_refuses_a_moments_precision_that_lora_does_not_have(state: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`search --lora --optimizer-state bf16/8bit` is refused in one line, as `run` refuses it: the adapters' AdamW
    state is fp32 on their GPU (`auto` searches that one precision)."""
    argv = ["search", "--model", "tiny-llama", "--hardware", "h200x1", "--seq-len", "64", "--batch-tokens", "512",
            "--lora", "4", "--optimizer-state", state]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --optimizer-state {state}: a LoRA run's AdamW state is its adapters', held in fp32 on the "
                   "GPU (the frozen base has none on the host); leave --optimizer-state out\n")
