"""What a TRL or Unsloth user gets wrong first: each mistake is one `error:` line, exit code 2, before any
worker starts, with nothing on disk changed (issue 38's defects)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import (  # noqa: E402
    TINY_QWEN3,
    parse_run,
    plan_run,  # noqa: E402
)

from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.model.hf import build_model, hf_name_maps, load_source  # noqa: E402
from tinypipe.backends.model.lora_adapters import inject, peft_name  # noqa: E402
from tinypipe.backends.options.run_flags import add_run_arguments  # noqa: E402
from tinypipe.backends.save import checkpoint  # noqa: E402
from tinypipe.backends.save.lora_save import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_shapes, check_adapter  # noqa: E402
from tinypipe.cli import main as cli_main  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.describe.hfconfig import load_model  # noqa: E402
from tinypipe.policy.lora_spec import LoraSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "no_workers")

LORA = LoraSpec(rank=4)


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any worker started here fails the test: every refusal comes before them."""
    from tinypipe.backends.launch import spawn as launch_mod

    for name in ("start_processes", "_run_here"):  # where launch() starts workers, or runs one in-process
        monkeypatch.setattr(launch_mod, name, lambda *a, **k: pytest.fail("a worker was started"))


def files(d: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under `d`, a file with its size and modification time: what a refusal must leave as it was (a
    directory's own time is left out: `--out`'s write probe creates and removes a file in it)."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(d.rglob("*"))}


def refused(argv: list[str], match: str, *, disk: Path) -> str:
    """The InputError `make_run_plan` raises for `argv` (one line, matching `match`), `disk` untouched."""
    before = files(disk)
    with pytest.raises(InputError, match=match) as info:
        plan_run(parse_run(*argv))
    assert "\n" not in str(info.value)
    assert files(disk) == before
    return str(info.value)


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """`tinypipe ARGV`'s only output: one `error:` line on stderr, nothing on stdout, exit code 2."""
    code = cli_main(argv)
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


# ---- 1. --max-grad-norm under either host layout --------------------------------------------------------

def test_max_grad_norm_help_and_plan_allow_the_compact_layout(tmp_path: Path) -> None:
    """`run --help` no longer says --max-grad-norm needs the replicated layout: the compact layout clips (its
    ring becomes a whole gradient), and a compact run with it plans a clipping schedule."""
    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    text = " ".join(ap.format_help().split())
    assert "needs the replicated" not in text and "Either host layout" in text
    plan = plan_run(parse_run("--gpus", "1", "--max-grad-norm", "1", "--out", str(tmp_path / "out")))
    assert plan.schedule.grad_clip and plan.schedule.host_memory == "compact"


# ---- 2, 3. LoRA options that mean nothing ---------------------------------------------------------------

@pytest.mark.parametrize(("argv", "match"), [
    pytest.param(["--lora", "4", "--merge", "--no-save"], "--merge with --no-save: the run saves no adapters to merge",
                 id="merge-no-save"),
    pytest.param(["--lora", "4", "--optimizer-state", "8bit"], "--optimizer-state 8bit: a LoRA run's AdamW state is "
                 "its adapters', held in fp32 on the GPU", id="lora-8bit-state"),
    pytest.param(["--lora", "4", "--optimizer-state", "bf16"], "--optimizer-state bf16: a LoRA run's AdamW state",
                 id="lora-bf16-state"),
])
def test_lora_options_that_mean_nothing_are_refused(argv: list[str], match: str, tmp_path: Path) -> None:
    """--merge with --no-save (no adapters saved, so none merged) and --optimizer-state bf16/8bit with LoRA (its
    adapters' AdamW is fp32 on the GPU; the frozen base has no host optimizer state) are refused."""
    refused(["--gpus", "1", "--out", str(tmp_path / "out"), *argv], match, disk=tmp_path)
    assert not (tmp_path / "out").exists()


def test_merge_with_no_save_and_save_every_merges_each_saved_step(tmp_path: Path) -> None:
    """--no-save with --save-every N still saves OUT/step-N, so --merge has a model to merge there: accepted."""
    plan = plan_run(parse_run("--gpus", "1", "--lora", "4", "--merge", "--no-save", "--save-every", "1",
                                   "--out", str(tmp_path / "out")))
    assert plan.job.lora_files.merge and not plan.job.save_model and plan.job.save_every == 1


# ---- 4. an adapter continued on another base ------------------------------------------------------------

def write_adapter(d: Path, shapes: dict[str, tuple[int, ...]], *, base: str, lora: LoraSpec = LORA) -> str:
    """A peft adapter directory (config and zero tensors of `shapes`) naming `base` as its base model."""
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    cfg = {"r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
           "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": base, "peft_type": "LORA"}
    (d / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(d / ADAPTER_WEIGHTS))
    return str(d)


def shapes_of(model: str, lora: LoraSpec = LORA) -> dict[str, tuple[int, ...]]:
    source = load_source(model)
    return adapter_shapes(source.spec, hf_name_maps(source.config), lora)


def test_adapter_shapes_are_the_injected_adapters_peft_names_and_shapes() -> None:
    """`adapter_shapes` (from the model's description) names and sizes exactly the adapters
    `lora_adapters.inject` puts in the blocks, under the keys `lora_adapters.peft_name` saves them by."""
    stack = build_model("tiny-llama", seed=0)
    _, initial = inject(stack, LORA, list(range(len(stack.layers))), seed=0)
    injected = {peft_name(stack, i, n): tuple(t.shape) for i, own in initial.items() for n, t in own.items()}
    assert injected and shapes_of("tiny-llama") == injected


def test_an_adapter_made_for_another_base_is_refused_before_any_worker(tmp_path: Path) -> None:
    """An adapter directory whose tensors were made for another model (here tiny Qwen3's narrower blocks, its
    config naming tiny-llama as the base) is refused when `run --model ADAPTER` plans, naming the file, the
    first tensor that does not fit and what to do; the same adapter on its own base passes the check."""
    qwen = tmp_path / "tiny-qwen3.json"
    qwen.write_text(json.dumps(TINY_QWEN3))
    adapter = write_adapter(tmp_path / "adapter", shapes_of(str(qwen)), base="tiny-llama")
    msg = refused(["--gpus", "1", "--model", adapter, "--out", str(tmp_path / "out")],
                  rf"{ADAPTER_WEIGHTS}: 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' has "
                  r"shape \(4, 32\), tiny-llama's needs \(4, 64\) \(\d+ more\): the adapter does not fit tiny-llama",
                  disk=tmp_path)
    assert "base_model_name_or_path" in msg and "--model BASE --lora R" in msg
    source = load_source(str(qwen))
    check_adapter(adapter, source.spec, hf_name_maps(source.config), LORA, str(qwen))  # its own base: fits


def test_an_adapter_with_tensors_for_more_layers_is_refused(tmp_path: Path) -> None:
    """Tensors the run's model has no place for (an adapter of a deeper model) are refused, not dropped."""
    shapes = shapes_of("tiny-llama")
    extra = {k.replace("layers.0.", "layers.9."): s for k, s in shapes.items() if "layers.0." in k}
    adapter = write_adapter(tmp_path / "adapter", {**shapes, **extra}, base="tiny-llama")
    refused(["--gpus", "1", "--model", adapter, "--out", str(tmp_path / "out")],
            r"'base_model\.model\.model\.layers\.9\.self_attn\.[qv]_proj\.lora_[AB]\.weight' has no place in "
            "tiny-llama", disk=tmp_path)


# ---- 5, 6. an earlier run's outputs in --out ------------------------------------------------------------

@pytest.mark.parametrize(("earlier", "named"), [
    pytest.param({ADAPTER_CONFIG: "{}", ADAPTER_WEIGHTS: "x"}, "adapter_config.json, adapter_model.safetensors",
                 id="adapter"),
    pytest.param({"merged/config.json": "{}"}, "merged/", id="merged"),
    pytest.param({"step-5/config.json": "{}", "step-10/config.json": "{}"}, "step-5/, step-10/", id="step-models"),
    pytest.param({"step-5/adapter_config.json": "{}"}, "step-5/", id="step-adapter"),
    pytest.param({f"step-{n}/config.json": "{}" for n in (2, 4, 6, 8, 10)},
                 "step-2/, step-4/, step-6/, 2 more step-N/", id="many-steps"),
])
def test_a_new_run_never_overwrites_an_earlier_runs_outputs(earlier: dict[str, str], named: str,
                                                           tmp_path: Path) -> None:
    """A LoRA run's adapter files, its merged model, or the models `--save-every` (or a stop) saved in OUT/step-N
    are an earlier run's: a new run in that --out (without --resume) is refused, naming them and what to do."""
    out = tmp_path / "out"
    for name, text in earlier.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    refused(["--gpus", "1", "--lora", "4", "--save-every", "1", "--out", str(out)],
            rf"--out {out}: already holds an earlier run \({named}\); continue it with --resume or choose another "
            "directory", disk=tmp_path)


def test_the_cli_refuses_an_earlier_lora_run_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through `tinypipe run`: one `error:` line, exit code 2, nothing else printed, nothing changed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ADAPTER_CONFIG).write_text("{}")
    before = files(tmp_path)
    line = one_error_line(capsys, ["run", "--gpus", "1", "--lora", "4", "--out", str(out)])
    assert "already holds an earlier run (adapter_config.json)" in line and files(tmp_path) == before


# ---- 7. an edited meta.json on --resume -------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Run directories of real 2-step runs on one worker, each with its checkpoint: every parameter trained
    (fp32 and 8-bit moments) and LoRA."""
    root = tmp_path_factory.mktemp("checkpoints")
    runs = {"full": [], "8bit": ["--optimizer-state", "8bit"], "lora": ["--lora", "4"]}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, extra in runs.items():
            plan = plan_run(parse_run("--gpus", "1", "--no-save", "--out", str(root / name), *extra))
            run_threads(dataclasses.replace(plan.job, progress=False), 1)
            assert checkpoint.find(root / name) is not None
    finally:
        torch.set_num_threads(threads)
    yield {name: root / name for name in runs}


def edited(src: Path, dst: Path, edit: Callable[[dict[str, Any]], object]) -> str:
    """A copy of the run directory `src` at `dst` with its checkpoint's meta.json changed by `edit`."""
    shutil.copytree(src, dst)
    meta_path = dst / checkpoint.DIR / "meta.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    return str(dst)


@pytest.mark.parametrize("run", ["full", "8bit", "lora"])
def test_a_checkpoint_as_written_resumes(run: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The checks below pass every checkpoint as a run wrote it (full, 8-bit moments, LoRA)."""
    out = shutil.copytree(checkpoints[run], tmp_path / run)
    plan = plan_run(parse_run("--resume", "--out", str(out)))
    assert plan.job.resume and plan.schedule.optimizer_state == ("8bit" if run == "8bit" else "fp32")


def in_run(**fields: object) -> Callable[[dict[str, Any]], object]:
    """An edit of meta.json's `run` (what --resume restores) alone."""
    return lambda meta: meta["run"].update(fields)


def everywhere(**fields: object) -> Callable[[dict[str, Any]], object]:
    """An edit of meta.json's `run` and `policy` alike (`lora`: the rank in `run`, the spec in `policy`)."""
    def edit(meta: dict[str, Any]) -> None:
        meta["run"].update(fields)
        meta["policy"].update({k: (LORA.to_json() if v else None) if k == "lora" else v for k, v in fields.items()})
    return edit


EDITED = "; the checkpoint was edited or damaged: restore it, or start a new run in another --out$"


@pytest.mark.parametrize(("run", "edit", "match"), [
    pytest.param("lora", in_run(lora=None), r"run\.lora none \(every parameter trains\), but policy\.lora rank 4",
                 id="run-lora-off"),
    pytest.param("full", in_run(lora=4), r"run\.lora rank 4, but policy\.lora none \(every parameter trains\)",
                 id="run-lora-on"),
    pytest.param("lora", everywhere(lora=None), r"policy\.lora a full fine-tune's host state \(no LoRA\), but "
                 r"rank0\.json beside it holds LoRA adapters r4,a8,d0,q\+v", id="lora-off-everywhere"),
    pytest.param("full", everywhere(lora=4), r"policy\.lora LoRA adapters r4,a8,d0,q\+v, but rank0\.json beside it "
                 r"holds a full fine-tune's host state \(no LoRA\)", id="lora-on-everywhere"),
    pytest.param("full", in_run(optimizer_state="8bit"), r"run\.optimizer_state 8bit, but policy\.optimizer_state fp32",
                 id="run-state-8bit"),
    pytest.param("full", everywhere(optimizer_state="8bit"), r"policy\.optimizer_state 8bit, but rank0\.json beside it "
                 "holds fp32 moments", id="state-8bit-everywhere"),
    pytest.param("8bit", everywhere(optimizer_state="bf16"), r"policy\.optimizer_state bf16, but rank0\.json beside it "
                 "holds 8bit moments", id="state-bf16-over-8bit"),
    pytest.param("full", lambda m: m.update(step=-1), "step -1: a checkpoint's step is never negative",
                 id="negative-step"),
    pytest.param("full", lambda m: m.update(step=5), r"step 5 is past the run's last step \(run\.steps 2\)",
                 id="step-past-the-runs-steps"),
    pytest.param("full", lambda m: m.update(step=1), r"step 1, but rank0\.json beside it holds step 2",
                 id="step-behind-the-rank-files"),
])
def test_an_edited_meta_json_is_refused_on_resume(run: str, edit: Callable[[dict[str, Any]], object], match: str,
                                                 checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """meta.json edited so that it contradicts itself (the run's LoRA rank or optimizer state against its
    policy's; a negative step, or one past the run's steps) or its rank files (LoRA on or off, the moments'
    precision, the step they hold) is refused on --resume, naming the file and the field, before any worker."""
    out = edited(checkpoints[run], tmp_path / "run", edit)
    refused(["--resume", "--out", out], rf"^{out}/{checkpoint.DIR}/meta\.json: {match}{EDITED}", disk=tmp_path)


def test_a_step_past_the_asked_steps_on_resume_names_the_checkpoint(checkpoints: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """--resume --steps N below the checkpoint's step is refused, naming the checkpoint's step."""
    out = shutil.copytree(checkpoints["full"], tmp_path / "run")
    refused(["--resume", "--out", str(out), "--steps", "1"], r"--steps 1: the checkpoint in .* is already at step 2",
            disk=tmp_path)


# ---- 8. search --gpu-mem below any candidate -------------------------------------------------------------

def test_search_with_a_gpu_mem_no_candidate_fits_prints_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`search --gpu-mem 1KiB` prints no table and no advice: one line naming --gpu-mem and the least a
    candidate needs, exit code 2, before the search."""
    line = one_error_line(capsys, ["search", "--model", "tiny-llama", "--gpu-mem", "1KiB", "--workers", "1"])
    assert line.startswith("error: --gpu-mem 1KiB: less than any candidate needs; a layer's backward holds at least")


def test_the_searchs_gpu_floor_is_where_its_bound_rejects_every_candidate() -> None:
    """`least_gpu_bytes` is the least GPU memory under which `lower_bound` rejects every stage-1 candidate for GPU
    memory; at that much at least one passes it."""
    from tinypipe.describe.hardware import load_hardware
    from tinypipe.describe.target import Target
    from tinypipe.describe.workload import Workload
    from tinypipe.search.policy_search import SearchSpace, SearchTarget, least_gpu_bytes, lower_bound, stage1

    model, hw, space = load_model("tiny-llama"), load_hardware("rtx4090x1"), SearchSpace()
    work = Workload(model=model, seq_len=512, batch_tokens=8 * 512)
    least = least_gpu_bytes(SearchTarget(work, Target(hardware=hw)), space)
    assert least is not None
    below, at = (SearchTarget(work, Target(hardware=hw, gpu_mem_bytes=b)) for b in (least[0] - 1, least[0]))
    assert all(lower_bound(below, p)[1].startswith("GPU memory") for p in stage1(below, space))
    assert any(not lower_bound(at, p)[1].startswith("GPU memory") for p in stage1(at, space))


# ---- 8. what a LoRA run does not use, in a policy file; an earlier run's metrics.jsonl --------------------

def named_policy(tmp: Path, **fields: object) -> str:
    path = tmp / "policy.json"
    path.write_text(json.dumps({"name": "mine", **fields}))
    return str(path)


@pytest.mark.parametrize(("fields", "argv", "match"), [
    pytest.param({"lora": {"rank": 4}, "optimizer_state": "8bit"}, [],
                 r"policy\.json: policy 'mine': optimizer_state: 8bit moments are the host optimizer's; with lora the "
                 r"adapters' AdamW state is fp32 on their GPU", id="file-lora-and-8bit"),
    pytest.param({"lora": {"rank": 4}}, ["--optimizer-state", "bf16"],
                 r"^policy 'mine': optimizer_state: bf16 moments are the host optimizer's", id="file-lora-flag-bf16"),
    pytest.param({"optimizer_state": "8bit"}, ["--lora", "4"],
                 r"^policy 'mine': optimizer_state: 8bit moments are the host optimizer's", id="file-8bit-flag-lora"),
    pytest.param({"lora": {"rank": 4}, "host_memory": "replicated"}, [],
                 r"--policy .*policy\.json: host_memory replicated with LoRA: the host holds one frozen copy of the "
                 "base", id="file-lora-replicated"),
    pytest.param({"host_memory": "replicated"}, ["--lora", "4"], r"host_memory replicated with LoRA",
                 id="file-replicated-flag-lora"),
])
def test_a_policy_file_asking_a_lora_run_for_what_it_does_not_use_is_refused(
        fields: dict[str, object], argv: list[str], match: str, tmp_path: Path) -> None:
    """A LoRA run keeps its adapters' AdamW state in fp32 on their GPU and one frozen copy of the base on the host:
    a policy file (with `lora`, or under --lora) asking for bf16 / 8-bit moments or the replicated host layout is
    refused in one line, where it used to run with neither."""
    refused(["--gpus", "1", "--policy", named_policy(tmp_path, **fields), "--out", str(tmp_path / "out"), *argv],
            match, disk=tmp_path)


def test_what_a_lora_run_honours_in_a_policy_is_accepted(tmp_path: Path) -> None:
    """`lora` in a policy file trains LoRA; its `optimizer` async trains as sync does (test_lora_run), and a
    preset's own host layout (mobius: replicated) is its definition, unused under --lora: both plan."""
    plan = plan_run(parse_run("--gpus", "1", "--out", str(tmp_path / "a"),
                                   "--policy", named_policy(tmp_path, lora={"rank": 4}, optimizer="async")))
    assert plan.schedule.lora == LORA and plan.schedule.optimizer_state == "fp32"
    plan = plan_run(parse_run("--gpus", "1", "--out", str(tmp_path / "b"), "--policy", "mobius", "--lora", "4"))
    assert plan.schedule.lora == LORA


@pytest.mark.parametrize("beside", [{}, {"config.json": "{}"}], ids=["alone", "with-a-model"])
def test_an_earlier_runs_metrics_are_not_overwritten(beside: dict[str, str], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A non-empty metrics.jsonl in --out is an earlier run's, even when nothing else of it is left (a run with
    --no-save and no checkpoint): a new run is refused in one line, exit code 2, the file as it was."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    for name, text in beside.items():
        (out / name).write_text(text)
    before = files(tmp_path)
    line = one_error_line(capsys, ["run", "--gpus", "1", "--out", str(out)])
    if beside:
        assert line == (f"error: --out {out}: already holds an earlier run (config.json, metrics.jsonl); continue it "
                        "with --resume or choose another directory")
    else:
        assert line == (f"error: --out {out}: already holds an earlier run's metrics.jsonl (and no checkpoint to "
                        "continue with --resume); move it away or choose another directory")
    assert files(tmp_path) == before


def test_an_empty_metrics_file_holds_nothing_to_keep(tmp_path: Path) -> None:
    """An empty metrics.jsonl (a run that failed before its first step) does not stop a new run in that --out."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    assert plan_run(parse_run("--gpus", "1", "--out", str(out))).job.out == str(out)
