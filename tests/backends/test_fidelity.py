"""CPU fidelity (issue 10): the simulator's prediction of a `tinypipe run --backend cpu`, made from a trace that
`tinypipe profile` measured on this CPU, against the run's measured steady iteration time and peak memory.

The job is the default one (tiny-llama, the `tinypipe` policy, 2 worker processes of 1 thread on 2
cores, 4 x 64 tokens per microbatch, 2 microbatches per step). What the CPU stand-in does that the
simulator does not model, measured on the 2-core dev box (2026-12-01, per iteration, both ranks):
- the host optimizer thread shares its worker's core and GIL: each OPT_STEP takes 0.9-1.9 ms per
  layer (the AdamW rate predicts 0.06) beside the next BWD, and BWD measures 27-41 ms against the
  profile's 21 (1 worker, its optimizer on the other core: still 1.4 x, the GIL; FWD, which overlaps
  no optimizer step, 0.9-1.4 x);
- the CPU streams are synchronous: LOAD, GRAD_OUT, EVICT and the gloo SEND run on the worker's
  thread, 11-20 ms where the stand-in's links (2 us per copy) predict 0.1;
- the executor's 0.5 ms idle poll while a RECV is outstanding.
In 12 runs the measured steady iteration was 41-60 ms (84 once, while another test suite shared
the machine) against 24-25 ms predicted from a profile taken alone (31-40 ms from four profiles that
other work slowed): x1.8-2.4 when neither was disturbed, x1.0-1.5 when the profile was, x3.5 once.
The analytic trace predicts 6.7-8.5 ms (x4.8-8.6). TIME_BAND, [0.7, 3.0], fails a prediction that
becomes slower than the run or a gap that grows by another ~1.3 x; a result outside it is measured
once more (profile and run), since other work on a shared machine moves it either way.

Memory: the CPU backend counts the tensors its interpreter holds (weights, gradients, layer inputs and
their gradients), sampled after each action; the prediction's ledger also holds autograd's saved tensors
of kept graphs (`a.L*`), those a recomputing backward re-creates, a layer's transient workspace (`ws`;
`ws.acc` of a later backward, with the weights' fresh gradients), an action's inputs until it ends, and
a RECV's buffer from when it is posted (the backend counts it once the data has arrived). So measured <=
predicted <= measured + the largest workspace (or ws.acc) + every kept graph's saved bytes + the largest
re-created ones + the two inputs one action
frees + one posted receive. Since the profile carries the host optimizer's steps (slow here: ~5 ms a
block beside the CPU loop on one core), the holistic packer puts each layer in a pack of its own, and
the simulated peak of rank 0 holds a posted RECV_B's buffer (64 KiB) during a recomputing backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import plan_run  # noqa: E402

from tinypipe.backends.launch.runtrace import timeline  # noqa: E402
from tinypipe.backends.launch.spawn import launch  # noqa: E402
from tinypipe.backends.options.run_flags import add_run_arguments  # noqa: E402
from tinypipe.cli import main as cli_main  # noqa: E402
from tinypipe.compiler import compile_schedule  # noqa: E402
from tinypipe.describe.trace import analytic_trace  # noqa: E402
from tinypipe.sim import simulate  # noqa: E402

STEPS = 12  # 3 windows of 4 compiled iterations; the steady time is the median after the first
TIME_BAND = (0.7, 3.0)  # measured / predicted steady iteration time (module docstring)
ATTEMPTS = 2  # profile + run again once when the time falls outside the band (other work on the machine)


def _kind_s(records: list, kinds: tuple[str, ...], iterations: set[int]) -> float:
    return sum(r.duration_s for r in records if r.kind in kinds and r.iteration in iterations)


def _profile_and_run(root: Path) -> tuple[float, float, float, list[str]]:
    """Profile, plan, run; (measured, predicted, analytic-trace predicted) steady iteration seconds and a report.
    Asserts the memory bound of the module docstring on each rank."""
    prof = root / "profile"
    assert cli_main(["profile", "--model", "tiny-llama", "--seq-len", "64", "--microbatch-size", "4", "--threads", "1",
                     "--repeat", "10", "--no-rates", "--out", str(prof)]) == 0
    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    plan = plan_run(ap.parse_args(["--gpus", "2", "--steps", str(STEPS), "--profile", str(prof),
                                    "--out", str(root / "run")]))
    assert not plan.trace.analytic and plan.trace.dtype == "fp32"
    results = launch(dataclasses.replace(plan.job, progress=False, save_model=False), plan.world)
    assert results is not None
    tl = timeline(plan, results)
    measured, predicted = tl.steady_iteration_s(), plan.prediction.iteration_s
    analytic = analytic_trace(plan.spec, plan.hardware.gpus[0], microbatch_size=4, seq_len=64, dtype="fp32")
    sched = compile_schedule(plan.policy, plan.spec, plan.hardware, analytic, iterations=plan.schedule.iterations)
    analytic_s = simulate(sched, plan.spec, plan.hardware, analytic).iteration_s

    steady, sim_steady = set(range(1, STEPS)), set(range(1, plan.schedule.iterations))
    lines = [f"steady iteration: measured {measured * 1e3:.1f} ms, predicted {predicted * 1e3:.1f} ms with the profile "
             f"(x{measured / predicted:.2f}), {analytic_s * 1e3:.1f} ms with the analytic trace "
             f"(x{measured / analytic_s:.2f})"]
    for kinds in (("FWD",), ("BWD",), ("LOAD", "GRAD_OUT", "EVICT", "SEND_F", "SEND_B"), ("OPT_STEP",)):
        m = _kind_s(list(tl.records), kinds, steady) / len(steady)
        s = _kind_s(list(plan.prediction.timeline.records), kinds, sim_steady) / len(sim_steady)
        lines.append(f"  {'+'.join(kinds):24s} per iteration, all ranks: measured {m * 1e3:6.2f} ms, "
                     f"simulated {s * 1e3:6.2f} ms")
    trace, sched = plan.trace, plan.schedule
    for r in sorted(results, key=lambda r: r.rank):
        dev = f"g{r.rank}"
        layers = [x for p, g in zip(sched.pack_layers, sched.pack_gpu) if g == r.rank for x in p]
        kinds = [trace.layer(plan.spec.layers[x]) for x in layers]
        kept = sum(k.saved_act_bytes for x, k in zip(layers, kinds) if not sched.recomputes(x)) * sched.microbatches
        recreated = max((k.saved_act_bytes for x, k in zip(layers, kinds) if sched.recomputes(x)), default=0)
        transient = max(max(k.workspace_bytes, k.accumulate_workspace(plan.spec.layers[x].param_bytes(trace.dtype)))
                        for x, k in zip(layers, kinds))
        unseen = (transient + kept + recreated
                  + 3 * max(k.saved_act_bytes_recompute for k in kinds))  # two inputs an action frees, a posted RECV
        pred = plan.prediction.peak_bytes[dev]
        lines.append(f"peak memory {dev}: measured {r.peak_device_bytes:,} B, predicted {pred:,} B "
                     f"(difference {pred - r.peak_device_bytes:,} B; the CPU measurement cannot see {unseen:,} B)")
        assert r.peak_device_bytes <= pred <= r.peak_device_bytes + unseen, lines[-1]
    return measured, predicted, analytic_s, lines


def test_cpu_run_against_the_prediction_from_its_profile(tmp_path: Path) -> None:
    """Profile tiny-llama on this CPU (1 thread, as each of the run's 2 workers gets), plan the default
    run with that profile, run 12 steps, and compare: steady iteration time within TIME_BAND of the
    prediction (a second profile and run if the first falls outside) and closer to it than the analytic
    trace's; each rank's peak memory within the bound of what the CPU measurement cannot see (module
    docstring). The numbers are printed (pytest -s)."""
    report: list[str] = []
    for attempt in range(ATTEMPTS):
        measured, predicted, analytic_s, lines = _profile_and_run(tmp_path / f"attempt{attempt}")
        report += [f"attempt {attempt + 1}:", *lines]
        if TIME_BAND[0] <= measured / predicted <= TIME_BAND[1]:
            break
    print("\n" + "\n".join(report))  # shown with pytest -s (or -rP)
    assert TIME_BAND[0] <= measured / predicted <= TIME_BAND[1], report
    assert abs(math.log(measured / predicted)) < abs(math.log(measured / analytic_s)), report
