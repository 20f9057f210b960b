"""OPT_STEP time: a trace's per-kind step measured in a run's conditions, else the host's rate
(`hostmem.optimizer_step_s`); the trace format that carries it, and what traces from before it predict."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tinypipe.cli import main as cli_main
from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.optimprofile import OptimizerProfile
from tinypipe.describe.target import Target
from tinypipe.describe.trace import FORMAT, ProfileTrace, load_trace, trace_for
from tinypipe.describe.workload import Workload
from tinypipe.estimate.hostmem import optimizer_s_per_param, optimizer_step_s
from tinypipe.policy import PRESETS
from tinypipe.search.policy_search import SearchTarget, lower_bound

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "traces" / "profiles"  # taken before per-kind optimizer steps existed
SPEC = load_model("llama-3.1-8b")
HW = load_hardware("h200x1")
EMBED, BLOCK, HEAD = SPEC.layers[0], SPEC.layers[1], SPEC.layers[-1]


def measured(trace: ProfileTrace, **in_run: dict[str, float]) -> ProfileTrace:
    """`trace` with the given kinds' in-run steps (kind -> layout -> s), each for that kind's layer."""
    params = {x.kind.value: x.params for x in SPEC.layers}
    kinds = {k: replace(p, optimizer=OptimizerProfile(params=params[k], threads=15, alone_s=dict(in_run[k]),
                                                      in_run_s=dict(in_run[k])))
             if k in in_run else p for k, p in trace.kinds.items()}
    return replace(trace, kinds=kinds)


def test_step_time_is_the_measured_one_else_the_host_rate() -> None:
    """Measured kind and layout: its in-run seconds (scaled by parameters for another layer of the kind:
    twice the parameters, twice the time); a layout or kind not measured, or no trace at all: the
    layer's parameters at the host's rate for the layout."""
    trace = measured(trace_for(SPEC, HW.gpus[0], 4, 2048), block={"compact": 0.125})
    assert optimizer_step_s(BLOCK, "compact", HW.host, trace) == 0.125
    assert optimizer_step_s(replace(BLOCK, params=2 * BLOCK.params), "compact", HW.host, trace) == 0.25
    rate = {lay: optimizer_s_per_param(HW.host, lay) for lay in ("compact", "replicated")}
    assert optimizer_step_s(BLOCK, "replicated", HW.host, trace) == BLOCK.params * rate["replicated"]
    assert optimizer_step_s(EMBED, "compact", HW.host, trace) == EMBED.params * rate["compact"]
    assert optimizer_step_s(BLOCK, "compact", HW.host) == BLOCK.params * rate["compact"]
    assert 0.125 != pytest.approx(BLOCK.params * rate["compact"])  # the measurement is not the rate here


def test_traces_without_steps_load_and_predict_at_the_host_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped H200 profiles carry no per-kind optimizer steps: they load with none, and giving one as
    --profile predicts exactly what the shipped default does, the steps at the host's rate."""
    for f in sorted(SHIPPED.glob("h200-*.json")):
        assert json.loads(f.read_text())["format"] == FORMAT
        assert all(p.optimizer is None for p in load_trace(str(f)).kinds.values())
    argv = ["simulate", "--model", "llama-3.1-8b", "--hardware", "h200x1", "--policy", "tinypipe",
            "--microbatch-size", "4", "--gpu-mem", "24GiB", "--seq-len", "2048", "--batch-tokens", "65536", "--json"]
    got = []
    for extra in ([], ["--profile", str(SHIPPED / "h200-llama-3.1-8b-mb4-seq2048.json")]):
        assert cli_main([*argv, *extra]) == 0
        got.append(json.loads(capsys.readouterr().out)["results"][0]["iteration_s"])
    assert got[0] == got[1]


def test_trace_json_round_trip_keeps_the_steps(tmp_path: Path) -> None:
    """A trace with steps writes `format` and its steps, and reads back equal; scaling it to another
    microbatch size keeps the steps (they do not depend on the tokens)."""
    t = measured(trace_for(SPEC, HW.gpus[0], 4, 2048), embed={"compact": 0.3, "replicated": 0.2},
                 block={"compact": 0.14})
    obj = t.to_json()
    assert obj["format"] == FORMAT and obj["kinds"]["block"]["optimizer"] == {
        "params": BLOCK.params, "threads": 15, "alone_s": {"compact": 0.14}, "in_run_s": {"compact": 0.14}}
    assert "optimizer" not in obj["kinds"]["head"]
    (tmp_path / "t.json").write_text(json.dumps(obj))
    assert load_trace(str(tmp_path / "t.json")) == t
    assert t.scaled_to(2).kinds["embed"].optimizer == t.kinds["embed"].optimizer


def _set(path: tuple[str, ...], value: Any) -> Any:
    def mutate(obj: dict[str, Any]) -> None:
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    return mutate


@pytest.mark.parametrize(("mutate", "message"), [
    (_set(("format",), "tinypipe-trace-v9"), "format 'tinypipe-trace-v9' is not one this tinypipe reads"),
    (_set(("kinds", "block", "optimizer", "in_run_s", "compressed"), 0.1), "unknown host memory layout 'compressed'"),
    (_set(("kinds", "block", "optimizer", "in_run_s", "compact"), 0.0), "in_run_s.compact: must be > 0"),
    (_set(("kinds", "block", "optimizer", "params"), 0), "optimizer.params: must be >= 1"),
    (_set(("kinds", "block", "optimizer"), [1]), "optimizer: expected a JSON object"),
])
def test_bad_steps_are_one_line_errors(tmp_path: Path, mutate: Any, message: str) -> None:
    """A trace whose format or steps are wrong is an InputError naming the file and the field."""
    obj = measured(trace_for(SPEC, HW.gpus[0], 4, 2048), block={"compact": 0.14}).to_json()
    mutate(obj)
    (tmp_path / "t.json").write_text(json.dumps(obj))
    with pytest.raises(InputError, match="t.json") as e:
        load_trace(str(tmp_path / "t.json"))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_search_bound_spreads_the_steps_over_the_ranks() -> None:
    """The search's bound on the optimizer: every layer's measured step once, spread over the GPUs (one
    optimizer thread per rank), and never below the longest step: on two GPUs with the steps set so
    the optimizer dominates, (2 + 32 x 1 + 2) / 2 = 18 s."""
    hw = load_hardware("h200x2")
    trace = measured(trace_for(SPEC, hw.gpus[0], 1, 2048), embed={"compact": 2.0}, block={"compact": 1.0},
                     head={"compact": 2.0})
    target = SearchTarget(Workload(model=SPEC, seq_len=2048, batch_tokens=8 * 2048,
                                   profiles=(replace(trace, analytic=False, model=SPEC.name),)), Target(hardware=hw))
    bound, _ = lower_bound(target, PRESETS["tinypipe"].replace(microbatch_size=1, microbatches=8))
    assert bound == pytest.approx(18.0)


def test_the_async_step_is_its_own_measurement_where_there_is_one() -> None:
    """The async optimizer's step (it keeps the previous version first) costs `async_in_run_s` where the
    trace measured it, else the sync step; the sync step never takes the async time. The field survives
    the JSON round trip and is left out when empty (traces before it read the same)."""
    base = trace_for(SPEC, HW.gpus[0], 4, 2048)
    opt = OptimizerProfile(params=BLOCK.params, threads=15, alone_s={"compact": 0.1}, in_run_s={"compact": 0.125},
                           async_in_run_s={"compact": 0.175})
    trace = replace(base, kinds={**base.kinds, "block": replace(base.kinds["block"], optimizer=opt)})
    assert optimizer_step_s(BLOCK, "compact", HW.host, trace) == 0.125
    assert optimizer_step_s(BLOCK, "compact", HW.host, trace, optimizer="async") == 0.175
    older = replace(opt, async_in_run_s={})
    assert older.step_s("compact", BLOCK.params, asynchronous=True) == 0.125
    assert "async_in_run_s" not in older.to_json()
    again = ProfileTrace.from_json(json.loads(json.dumps(trace.to_json())))
    assert again.kinds["block"].optimizer == opt


def test_the_step_by_phase_where_all_three_were_measured() -> None:
    """`phases_s` gives the step alone, beside FWDs and beside BWDs (the async step's from the async_*
    fields), scaled by parameters like `step_s`, and None unless all three were measured for the layout
    and mode. The fields survive the JSON round trip and are left out when empty. The floor and the search
    bound take the least of the in-run step and the phases (`optimizer_steps_s(least=True)`); the plan
    and the simulator's fallback keep the in-run step."""
    from tinypipe.describe.optimprofile import StepPhases
    from tinypipe.estimate.hostmem import optimizer_step_phases_s, optimizer_steps_s

    base = trace_for(SPEC, HW.gpus[0], 4, 2048)
    opt = OptimizerProfile(params=BLOCK.params, threads=15, alone_s={"compact": 0.1}, in_run_s={"compact": 0.125},
                           async_in_run_s={"compact": 0.175}, beside_fwd_s={"compact": 0.3},
                           beside_bwd_s={"compact": 0.2, "replicated": 0.1}, async_alone_s={"compact": 0.12},
                           async_beside_fwd_s={"compact": 0.4}, async_beside_bwd_s={"compact": 0.25})
    assert opt.phases_s("compact", BLOCK.params) == StepPhases(0.1, 0.3, 0.2)
    assert opt.phases_s("compact", 2 * BLOCK.params, asynchronous=True) == StepPhases(0.24, 0.8, 0.5)
    assert opt.phases_s("replicated", BLOCK.params) is None  # no alone or FWD time for it
    assert replace(opt, async_beside_bwd_s={}).phases_s("compact", BLOCK.params, asynchronous=True) is None
    trace = replace(base, kinds={**base.kinds, "block": replace(base.kinds["block"], optimizer=opt)})
    assert optimizer_step_phases_s(BLOCK, "compact", trace, optimizer="async") == StepPhases(0.12, 0.4, 0.25)
    assert optimizer_step_phases_s(EMBED, "compact", trace) is None  # the embedding's step was not measured
    assert optimizer_steps_s(SPEC, "compact", HW.host, trace)[1] == 0.125
    assert optimizer_steps_s(SPEC, "compact", HW.host, trace, least=True)[1] == 0.1
    assert optimizer_steps_s(SPEC, "compact", HW.host, trace, optimizer="async", least=True)[1] == 0.12
    assert optimizer_steps_s(SPEC, "replicated", HW.host, trace, least=True) == optimizer_steps_s(
        SPEC, "replicated", HW.host, trace)
    again = ProfileTrace.from_json(json.loads(json.dumps(trace.to_json())))
    assert again.kinds["block"].optimizer == opt
    assert set(OptimizerProfile(params=1, threads=1, in_run_s={"compact": 0.1}).to_json()) == {
        "params", "threads", "alone_s", "in_run_s"}


def test_the_schedule_says_its_optimizer_mode() -> None:
    """The compiled schedule carries the policy's optimizer mode through its text form; a schedule text
    without it is a one-line error (the backend's version checks follow it)."""
    from tinypipe.compiler import compile_schedule
    from tinypipe.ir.schedule import Schedule

    trace = trace_for(SPEC, HW.gpus[0], 1, 2048)
    for mode in ("sync", "async"):
        s = compile_schedule(PRESETS["tinypipe"].replace(optimizer=mode), SPEC, HW, trace, iterations=2)
        assert s.optimizer == mode and Schedule.loads(s.dumps()).optimizer == mode
    text = compile_schedule(PRESETS["tinypipe"], SPEC, HW, trace, iterations=2).dumps()
    assert " optimizer=sync " in text
    with pytest.raises(InputError, match="missing header field 'optimizer'"):
        Schedule.loads(text.replace(" optimizer=sync", ""))
