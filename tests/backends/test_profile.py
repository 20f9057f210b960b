"""`tinypipe profile`: traces measured through the interpreter's handlers load and hold what autograd holds,
the host rates rewrite a preset, and simulate / search / run take the result with `--profile`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import fixed_cpu_hardware, plan_run  # noqa: E402

from tinypipe.backends.options.run_flags import add_run_arguments  # noqa: E402
from tinypipe.backends.options.settings import rank_threads  # noqa: E402
from tinypipe.backends.profile import rates as rates_module  # noqa: E402
from tinypipe.backends.profile.command import trace_file  # noqa: E402
from tinypipe.backends.profile.measure_layers import STEP, LayerBench  # noqa: E402
from tinypipe.backends.profile.rates import measure_rates  # noqa: E402
from tinypipe.backends.rank.interpreter import Interpreter, StepData  # noqa: E402
from tinypipe.cli import main as cli_main  # noqa: E402
from tinypipe.compiler import compile_schedule  # noqa: E402
from tinypipe.describe.hardware import load_hardware  # noqa: E402
from tinypipe.describe.hfconfig import load_model  # noqa: E402
from tinypipe.describe.model import head_workspace_bytes, head_workspace_fixed_bytes  # noqa: E402
from tinypipe.describe.trace import FORMAT, load_profiles, load_trace  # noqa: E402
from tinypipe.ir.schedule import Kind  # noqa: E402
from tinypipe.policy import load_policy  # noqa: E402
from tinypipe.sim import simulate  # noqa: E402
from tinypipe.sim.evaluate import SimEvaluator  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, SIZES = 16, (1, 2)
SPEC = load_model("tiny-llama")
H = SPEC.hidden_size


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """One `tinypipe profile` of tiny-llama on the CPU (small copies and optimizer tensors: this is a
    test of the plumbing, not a measurement), its output directory, the base preset and stdout."""
    root = tmp_path_factory.mktemp("profile")
    base = root / "cpu-x2.json"
    base.write_text(json.dumps(fixed_cpu_hardware(2).to_json()))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rates_module, "CPU_COPY_BYTES", 1 << 20)
        mp.setattr(rates_module, "OPTIM_PARAMS", 1 << 16)
        out = root / "out"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = cli_main(["profile", "--model", "tiny-llama", "--seq-len", str(SEQ), "--microbatch-size",
                             *map(str, SIZES), "--threads", "1", "--repeat", "3", "--warmup", "1", "--hardware",
                             str(base), "--optimizer-phases", "--out", str(out)])
    assert code == 0
    return out, base, buf.getvalue()


def test_profile_writes_traces_that_load_and_say_what_they_are(profiled: tuple[Path, Path, str]) -> None:
    """One trace per microbatch size, named like the shipped ones, that `load_trace` reads: measured,
    for the GPU model "CPU" (what `cpu_hardware` calls its stand-ins), fp32, tiny-llama; its source
    says how it was timed and that the workspace is not measured on a CPU."""
    out, _, printed = profiled
    names = sorted(p.name for p in out.iterdir())
    assert names == ["cpu-tiny-llama-mb1-seq16-fp32.json", "cpu-tiny-llama-mb2-seq16-fp32.json", "hardware.json",
                     "rates.json"]
    for size in SIZES:
        t = load_trace(str(out / f"cpu-tiny-llama-mb{size}-seq{SEQ}-fp32.json"))
        assert trace_file(t) == f"cpu-tiny-llama-mb{size}-seq{SEQ}-fp32.json"
        assert (t.gpu_model, t.model, t.dtype, t.microbatch_size, t.seq_len, t.analytic) == (
            "CPU", "tiny-llama", "fp32", size, SEQ, False)
        assert "median of 3 after 1 warm-up runs, time.perf_counter" in t.source
        assert "workspace_bytes NOT measured" in t.source
    assert "wrote " + str(out / "rates.json") in printed and "not measured on a CPU" in printed


def test_profile_times_each_kinds_optimizer_step(profiled: tuple[Path, Path, str]) -> None:
    """Every kind of every trace carries its host optimizer step (trace format v2): the kind's own
    parameters, the thread count asked for, both host layouts alone and in the run, each > 0; measured
    once, the same in every trace; the report shows them, and the source says how they were taken."""
    out, _, printed = profiled
    traces = [load_trace(str(out / f"cpu-tiny-llama-mb{s}-seq{SEQ}-fp32.json")) for s in SIZES]
    assert all(json.loads((out / f"cpu-tiny-llama-mb{s}-seq{SEQ}-fp32.json").read_text())["format"] == FORMAT
               for s in SIZES)
    params = {x.kind.value: x.params for x in SPEC.layers}
    for t in traces:
        for kind, p in t.kinds.items():
            o = p.optimizer
            assert o is not None and (o.params, o.threads) == (params[kind], 1), kind
            assert set(o.alone_s) == set(o.in_run_s) == {"replicated", "compact"}
            assert min(*o.alone_s.values(), *o.in_run_s.values()) > 0
            for layout in ("replicated", "compact"):  # by phase too (--optimizer-phases)
                for asynchronous in (False, True):
                    phases = o.phases_s(layout, o.params, asynchronous=asynchronous)
                    assert phases is not None and min(phases) > 0, (kind, layout, asynchronous)
            assert o == traces[0].kinds[kind].optimizer
        assert "Host optimizer: one OPT_STEP of each kind's layer" in t.source and "issued by the executor" in t.source
        assert "by phase" in t.source and "LOAD, 16 x FWD, EVICT per window" in t.source
    assert "host optimizer step per layer kind (1 thread(s)" in printed and "beside FWD ms" in printed


def test_profile_times_the_block_inside_the_executors_loop(profiled: tuple[Path, Path, str]) -> None:
    """Each trace's block (only the block) carries its own size's loop times, alone and beside the optimizer,
    each > 0; the source says how they were taken and the report shows them."""
    out, _, printed = profiled
    loops = []
    for size in SIZES:
        t = load_trace(str(out / f"cpu-tiny-llama-mb{size}-seq{SEQ}-fp32.json"))
        loop = t.kinds["block"].loop
        assert loop is not None and t.kinds["embed"].loop is None and t.kinds["head"].loop is None
        assert min(loop.fwd_s, loop.recompute_bwd_s, loop.fwd_beside_optimizer_s,
                   loop.recompute_bwd_beside_optimizer_s) > 0
        assert (f"Loop (block): the block's recomputing FWD and BWD issued back to back by the executor: layer 1 "
                f"(a block) at {size * SEQ} tokens per microbatch") in t.source
        assert "3 window(s) per condition (24 FWD, 24 BWD each)" in t.source
        loops.append(loop)
    assert loops[0] != loops[1]  # measured per size, not scaled
    assert "the block inside the executor's loop" in printed


def test_profile_without_the_loop(tmp_path: Path) -> None:
    """`--no-loop` leaves the loop times out (the simulator then takes the isolated ones)."""
    assert cli_main(["profile", "--model", "tiny-llama", "--seq-len", str(SEQ), "--threads", "1", "--repeat", "1",
                     "--warmup", "0", "--no-rates", "--no-optimizer", "--no-loop", "--out", str(tmp_path)]) == 0
    t = load_trace(str(tmp_path / f"cpu-tiny-llama-mb1-seq{SEQ}-fp32.json"))
    assert all(p.loop is None for p in t.kinds.values()) and "Loop (block)" not in t.source


def test_simulate_charges_the_profiled_steps(profiled: tuple[Path, Path, str]) -> None:
    """A schedule simulated with the profiled trace runs every OPT_STEP for its kind's measured step under the
    policy's layout and optimizer mode, whatever the host's rate says: by phase, so between the least and
    the most of its phases' times; without the phases, the in-run step."""
    out, base, _ = profiled
    hw = load_hardware(str(base))
    trace = load_trace(str(out / f"cpu-tiny-llama-mb2-seq{SEQ}-fp32.json"))
    unphased = replace(trace, kinds={k: replace(p, optimizer=replace(p.optimizer, beside_fwd_s={}, async_alone_s={}))
                                     for k, p in trace.kinds.items() if p.optimizer is not None})
    for layout, optimizer in (("compact", "sync"), ("replicated", "async")):
        policy = load_policy("tinypipe").replace(microbatch_size=2, microbatches=2, host_memory=layout,
                                                 optimizer=optimizer)
        sched = compile_schedule(policy, SPEC, hw, trace)
        for t, phased in ((trace, True), (unphased, False)):
            steps = [r for r in simulate(sched, SPEC, hw, t).timeline.records if r.kind == "OPT_STEP"]
            assert len(steps) == len(SPEC.layers) * sched.iterations
            for r in steps:
                o = t.kinds[SPEC.layers[r.layer].kind.value].optimizer
                assert o is not None
                took = r.end_s - r.start_s
                if phased:
                    phases = o.phases_s(layout, o.params, asynchronous=optimizer == "async")
                    assert phases is not None and min(phases) * (1 - 1e-9) <= took <= max(phases) * (1 + 1e-9)
                else:
                    assert took == pytest.approx(o.step_s(layout, o.params, asynchronous=optimizer == "async"))


def test_profile_without_the_optimizers_phases(tmp_path: Path) -> None:
    """Without `--optimizer-phases` the steps are timed alone and beside the mixed loop only (the simulator then
    charges a step the same whatever runs)."""
    assert cli_main(["profile", "--model", "tiny-llama", "--seq-len", str(SEQ), "--threads", "1", "--repeat", "1",
                     "--warmup", "0", "--no-rates", "--no-loop", "--out", str(tmp_path)]) == 0
    t = load_trace(str(tmp_path / f"cpu-tiny-llama-mb1-seq{SEQ}-fp32.json"))
    for p in t.kinds.values():
        assert p.optimizer is not None and p.optimizer.in_run_s and p.optimizer.async_in_run_s
        assert not (p.optimizer.beside_fwd_s or p.optimizer.async_alone_s) and "by phase" not in t.source


def test_profile_without_the_optimizer(tmp_path: Path) -> None:
    """`--no-optimizer` leaves the steps out (the simulator then takes the host's rate), not the loop times."""
    assert cli_main(["profile", "--model", "tiny-llama", "--seq-len", str(SEQ), "--threads", "1", "--repeat", "1",
                     "--warmup", "0", "--no-rates", "--no-optimizer", "--out", str(tmp_path)]) == 0
    t = load_trace(str(tmp_path / f"cpu-tiny-llama-mb1-seq{SEQ}-fp32.json"))
    assert all(p.optimizer is None for p in t.kinds.values()) and "Host optimizer" not in t.source
    assert t.kinds["block"].loop is not None  # the loop is timed without the optimizer's profile


def test_profile_times_and_sizes_are_sane(profiled: tuple[Path, Path, str]) -> None:
    """Every time is > 0 and a block's recomputing backward takes at least half of the longer of forward
    and backward (it runs both; the margin absorbs a shared 2-core machine's noise); the head, never recomputed, has
    recompute_bwd = fwd + bwd. Sizes: a layer's recompute footprint is its fp32 input, the embedding
    keeps its token ids (8 B each), the head keeps x, the normalised x and the normed output in fp32
    plus the labels, the log-sum-exp and the reciprocal RMS (12 h + 16 B a token); the workspace is
    tinypipe.describe.trace's analytic one; saved bytes grow with the microbatch."""
    out = profiled[0]
    traces = {s: load_trace(str(out / f"cpu-tiny-llama-mb{s}-seq{SEQ}-fp32.json")) for s in SIZES}
    for size, t in traces.items():
        tokens = size * SEQ
        for kind, p in t.kinds.items():
            assert p.fwd_s > 0 and p.bwd_s > 0 and p.recompute_bwd_s > 0, kind
        block = t.kinds["block"]  # the embedding takes microseconds here: too little to compare
        assert block.recompute_bwd_s >= 0.5 * max(block.fwd_s, block.bwd_s)
        embed, block, head = t.kinds["embed"], t.kinds["block"], t.kinds["head"]
        assert head.recompute_bwd_s == pytest.approx(head.fwd_s + head.bwd_s)
        assert embed.saved_act_bytes == 8 * tokens and embed.saved_act_bytes_recompute == 0
        assert block.saved_act_bytes_recompute == head.saved_act_bytes_recompute == 4 * H * tokens
        assert head.saved_act_bytes == (12 * H + 16) * tokens
        assert block.workspace_bytes == math.ceil(0.5 * block.saved_act_bytes)
        assert head.workspace_bytes == head_workspace_bytes(SPEC, tokens)
        assert head.workspace_fixed_bytes == head_workspace_fixed_bytes(SPEC, tokens)
    assert traces[2].kinds["block"].saved_act_bytes > traces[1].kinds["block"].saved_act_bytes


def test_saved_bytes_equal_what_autograd_holds() -> None:
    """The hook count of a block's saved bytes equals the distinct non-parameter storages found by
    walking the kept graph's `_saved_*` tensors (an independent count of what autograd holds)."""
    bench = LayerBench("tiny-llama", device=torch.device("cpu"), dtype="fp32")
    m = bench.measure("block", microbatch_size=2, seq_len=SEQ, repeat=1, warmup=0)
    it: Interpreter = bench.interp[False]
    it.dispatch(bench._act(Kind.LOAD, 1), STEP)
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    it.data = {STEP: StepData([(ids, ids)], 1.0)}
    it.x[(STEP, 1, 0)] = torch.randn(2, SEQ, H)
    it.dispatch(bench._act(Kind.FWD, 1), STEP)
    out, _, leaves = it.graphs[(STEP, 1, 0)]
    params = {t.untyped_storage().data_ptr() for t in leaves.values()}
    found: dict[int, int] = {}
    seen: set[Any] = set()
    todo = [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for attr in dir(fn):
            if attr.startswith("_saved_"):
                value = getattr(fn, attr)
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                        s = t.untyped_storage()
                        if s.data_ptr() not in params:
                            found[s.data_ptr()] = s.nbytes()
        todo += [f for f, _ in fn.next_functions]
    assert m.saved_bytes == sum(found.values()) > 0


def test_simulate_search_and_run_take_the_profile(profiled: tuple[Path, Path, str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`simulate --profile DIR` uses the measured trace (its JSON says so, and the prediction is the
    simulator's with that trace); the search's evaluator takes it, and the search then tries only the
    measured microbatch sizes; `run`'s plan takes it too."""
    out, base, _ = profiled
    argv = ["simulate", "--model", "tiny-llama", "--hardware", str(base), "--seq-len", str(SEQ), "--dtype", "fp32",
            "--microbatch-size", "2", "--batch-tokens", str(4 * SEQ), "--policy", "tinypipe", "--profile", str(out)]
    assert cli_main([*argv, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["trace"]["measured"] and row["trace"]["source"].startswith("measured by `tinypipe profile`")
    hw = load_hardware(str(base))
    trace = load_trace(str(out / f"cpu-tiny-llama-mb2-seq{SEQ}-fp32.json"))
    policy = load_policy("tinypipe").replace(microbatch_size=2, microbatches=2)
    want = simulate(compile_schedule(policy, SPEC, hw, trace), SPEC, hw, trace)
    assert row["iteration_s"] == pytest.approx(want.iteration_s)
    assert cli_main(argv) == 0
    assert "trace for microbatch size 2: measured (measured by `tinypipe profile`" in capsys.readouterr().out
    assert cli_main([*argv[:-2], "--json"]) == 0  # without --profile: the analytic trace
    assert not json.loads(capsys.readouterr().out)["results"][0]["trace"]["measured"]

    ev = SimEvaluator(SPEC, hw, SEQ, profiles=load_profiles([str(out)]), dtype="fp32", iterations=3)
    assert ev(policy).iteration_s == pytest.approx(want.iteration_s)
    # the search tries only the microbatch sizes measured (analytic times would not compare with them)
    assert cli_main(["search", "--model", "tiny-llama", "--hardware", str(base), "--seq-len", str(SEQ), "--dtype",
                     "fp32", "--batch-tokens", str(4 * SEQ), "--workers", "1", "--profile", str(out), "--json"]) == 0
    got = capsys.readouterr()
    assert "note: searching microbatch sizes 1, 2, those --profile measured" in got.err
    assert {e["policy"]["microbatch_size"] for e in json.loads(got.out)["top"]} <= set(SIZES)

    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    args = ap.parse_args(["--seq-len", str(SEQ), "--batch-tokens", str(4 * SEQ), "--microbatch-size", "2",
                          "--steps", "2", "--out", str(out.parent / "run"), "--profile", str(out),
                          "--calibrate", "off"])
    plan = plan_run(args)
    assert plan.trace == trace and plan.note is None
    args.calibrate = "now"  # the same profile, its host optimizer steps scaled to this host as measured now
    plan = plan_run(args)
    assert plan.trace.source.startswith(trace.source) and "calibrated to this host" in plan.trace.source
    assert plan.trace.kinds["block"].fwd_s == trace.kinds["block"].fwd_s and plan.note is None


def test_host_rates_rewrite_a_preset(profiled: tuple[Path, Path, str]) -> None:
    """hardware.json is the base preset with the measured rates (`--hardware FILE` loads it): each GPU's own
    link at min(H2D, D2H) with the measured fixed cost, the AdamW rate, and for several GPUs the
    preset's DMA cap kept unless exceeded; upstream switch links and GPU models are untouched; the compact
    step's rate with each moment precision."""
    out, base, _ = profiled
    rates = json.loads((out / "rates.json").read_text())
    hw = load_hardware(str(out / "hardware.json"))
    assert hw.provenance == "measured" and hw.host.adam_params_per_s == rates["adam_params_per_s"] > 0
    assert all(rates[k] > 0 for k in ("h2d_gbps", "d2h_gbps", "bidir_gbps", "replicated_params_per_s",
                                      "compact_params_per_s", "compact_bf16_params_per_s", "compact_8bit_params_per_s"))
    assert hw.host.compact_8bit_params_per_s == rates["compact_8bit_params_per_s"]
    link = hw.link("rc0", "gpu1")
    assert link.gbps == min(rates["h2d_gbps"], rates["d2h_gbps"]) and link.latency_s == rates["copy_latency_s"]
    assert hw.host.dma_gbps == max(10.0, rates["bidir_gbps"])  # the base (2 GPUs) caps at 10 GB/s
    assert set(rates["optimizer_time_factor"]) == {"replicated", "compact"}

    r = measure_rates(torch.device("cpu"), threads=1, compute_dtype="bf16", repeat=1, copy_bytes=1 << 16,
                      optim_params=1 << 12)
    eight = load_hardware("rtx4090x8-pcie4")
    got = r.hardware(eight)
    for before, after in zip(eight.links, got.links):
        leaf = "gpu" in after.a or "gpu" in after.b
        assert (after.gbps, after.latency_s) == ((min(r.h2d_gbps, r.d2h_gbps), r.copy_latency_s) if leaf
                                                 else (before.gbps, before.latency_s))
    assert got.gpus == eight.gpus and got.host.dma_gbps == max(eight.host.dma_gbps, r.bidir_gbps)
    one = r.hardware(load_hardware("h200x1"))
    assert one.host.dma_gbps == one.link("host", "rc0").gbps == r.bidir_gbps


@pytest.mark.parametrize(("argv", "match"), [
    (["--microbatch-size", "0"], "--microbatch-size: every size must be >= 1"),
    (["--repeat", "0"], "--repeat: must be >= 1"),
    (["--warmup", "-1"], "--warmup: must be >= 0"),
    (["--seq-len", "100000"], "--seq-len 100000: tiny-llama handles at most 2048"),
    (["--model", "llama-9"], "llama-9"),
    (["--model", "gpt2-xl"], "`run` trains llama, mistral, qwen2, qwen3, qwen3_moe, mixtral"),
    (["--hardware", "dgx-a100"], "unknown hardware 'dgx-a100'"),
    (["--out", "FILE"], "exists and is not a directory"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_profile_bad_input_is_one_line_exit_2(argv: list[str], match: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Mistakes end in one `error:` line and exit code 2, before anything is measured or written."""
    (tmp_path / "file").write_text("x")
    base = ["profile", "--model", "tiny-llama", "--seq-len", "16", "--no-rates", "--out", str(tmp_path / "out")]
    argv = [str(tmp_path / "file") if a == "FILE" else a for a in argv]
    assert cli_main(base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where there is no GPU")
def test_profile_cuda_without_a_gpu_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--backend cuda` on a machine without CUDA says so and suggests the CPU."""
    assert cli_main(["profile", "--model", "tiny-llama", "--backend", "cuda", "--out", str(tmp_path)]) == 2
    assert "use --backend cpu" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["simulate"], ["search", "--workers", "1"], ["run", "--steps", "1"]])
def test_a_missing_profile_is_one_line_exit_2(command: list[str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """simulate, search and run refuse a --profile that does not exist, with one line, before any work."""
    assert cli_main([*command, "--model", "tiny-llama", "--profile", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: --profile {tmp_path / 'nope'}: no such file or directory", err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_on_cuda_measures_the_workspace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a GPU: bf16 traces with the allocator-measured workspace, CUDA-event times, and the rates of
    pinned copies (hardware.json when a preset matches the GPU, else only with --hardware)."""
    assert cli_main(["profile", "--model", "tiny-llama", "--backend", "cuda", "--seq-len", "64",
                     "--microbatch-size", "1", "4", "--out", str(tmp_path), "--hardware", "h200x1"]) == 0
    capsys.readouterr()
    t = load_trace(str(tmp_path / "h200-tiny-llama-mb4-seq64-compiled.json"))  # cuda compiles by default
    assert t.dtype == "bf16" and "CUDA events" in t.source and "NOT measured" not in t.source
    assert all(p.fwd_s > 0 and p.workspace_bytes >= 0 for p in t.kinds.values())
    assert t.kinds["head"].workspace_fixed_bytes <= t.kinds["head"].workspace_bytes
    rates = json.loads((tmp_path / "rates.json").read_text())
    assert rates["h2d_gbps"] > 1 and rates["copy_latency_s"] < 1e-3
    assert load_hardware(str(tmp_path / "hardware.json")).provenance == "measured"
    threads = rank_threads("cuda", 1, os.cpu_count() or 1)  # one rank's, as `run --backend cuda --gpus 1`
    for p in t.kinds.values():
        o = p.optimizer
        assert o is not None and o.threads == threads and set(o.in_run_s) == {"replicated", "compact"}
        assert min(*o.alone_s.values(), *o.in_run_s.values()) > 0
        for layout in ("replicated", "compact"):  # and by phase, beside the block's FWD / BWD loops
            assert all(o.phases_s(layout, o.params, asynchronous=a) is not None for a in (False, True))


def test_profile_lora_measures_the_frozen_block_and_a_lora_run_takes_it(tmp_path: Path) -> None:
    """`profile --lora` times the block on a frozen base with its adapters (the BWD a LoRA run issues: no weight
    gradients), writes a trace named and marked with the adapters, without a host optimizer step or loop times;
    `run --lora` with the same adapters plans with it as measured, and a full run does not take it."""
    pytest.importorskip("peft")
    lora = ["--lora", "4", "--lora-alpha", "8", "--lora-targets", "all"]
    assert cli_main(["profile", "--model", "tiny-llama", "--seq-len", str(SEQ), "--threads", "1", "--repeat", "1",
                     "--warmup", "0", "--no-rates", *lora, "--out", str(tmp_path)]) == 0
    name = f"cpu-tiny-llama-mb1-seq{SEQ}-fp32-lora-r4-a8-d0-q-k-v-o-gate-up-down.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    t = load_trace(str(tmp_path / name))
    assert t.lora == "r4,a8,d0,q+k+v+o+gate+up+down" and "a frozen base with LoRA" in t.source
    assert all(p.optimizer is None and p.loop is None for p in t.kinds.values())
    assert min(t.kinds["block"].fwd_s, t.kinds["block"].recompute_bwd_s) > 0

    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    base = ["--seq-len", str(SEQ), "--batch-tokens", str(2 * SEQ), "--microbatch-size", "1", "--steps", "2",
            "--profile", str(tmp_path), "--calibrate", "off"]
    plan = plan_run(ap.parse_args([*base, *lora, "--out", str(tmp_path.parent / "run-lora")]))
    assert plan.trace == t
    plan = plan_run(ap.parse_args([*base, "--out", str(tmp_path.parent / "run-full")]))
    assert not plan.trace.lora
