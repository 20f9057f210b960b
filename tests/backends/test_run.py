"""`tinypipe run` end to end in real worker processes over gloo: training equals the reference,
checkpoint + resume equals an uninterrupted run, failures and bad input end in one-line errors."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import (  # noqa: E402
    TINY_QWEN3,
    TINY_QWEN3_TIED,
    fixed_cpu_hardware,
    plan_run,  # noqa: E402
)

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch.run_report import profile_hint, sparkline  # noqa: E402
from tinypipe.backends.launch.spawn import WorkerError, launch  # noqa: E402
from tinypipe.backends.options.run_flags import add_run_arguments  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.backends.save import checkpoint  # noqa: E402
from tinypipe.cli import build_parser  # noqa: E402
from tinypipe.cli import main as cli_main  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.ir.schedule import Kind  # noqa: E402
from tinypipe.ir.timeline import HOST_CAT, ISSUE_CAT  # noqa: E402
from tinypipe.replay.trace_match import load_run_trace  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, MBS, MB = 16, 2, 2
LR = 1e-2
CONSTANT = ("--lr-schedule", "constant", "--warmup-ratio", "0")  # the reference's lr: the same at every step


def policy_file(tmp: Path, **fields: object) -> str:
    base = {"name": "test", "swap": "layer", "host_memory": "compact", "microbatch_size": MBS, "resident": "none"}
    path = tmp / "policy.json"
    path.write_text(json.dumps({**base, **fields}))
    return str(path)


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    return ap.parse_args(["--seq-len", str(SEQ), "--batch-tokens", str(SEQ * MBS * MB), "--lr", str(LR), *CONSTANT,
                          *argv])


def fake_checkpoint(out: Path, *, step: int, **run: object) -> str:
    """A run directory whose checkpoint records `run` (over this module's settings) at `step`:
    what `--resume` reads before anything else."""
    record = {"seq_len": SEQ, "batch_tokens": SEQ * MBS * MB, "lr": LR, **run}
    (out / checkpoint.DIR).mkdir(parents=True)
    meta = {"format": checkpoint.FORMAT, "step": step, "run": record}
    (out / checkpoint.DIR / "meta.json").write_text(json.dumps(meta))
    return str(out)


def reference(model: str, steps: int) -> object:
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS, microbatches=MB,
                           seed=0)
    return reference_train(model, batches, steps=steps, lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0, seed=0)


def test_run_trains_two_processes_saves_and_traces(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`tinypipe run --gpus 2` (gloo, several packs per process, layer swap, compact host) exits 0,
    prints the summary, writes a Chrome trace of both ranks (5 steps: two windows, with the work between
    them on each rank's `gN.host`), and saves a model that `AutoModelForCausalLM.from_pretrained` loads
    with exactly the reference's trained weights."""
    from transformers import AutoModelForCausalLM

    out, trace = tmp_path / "out", tmp_path / "trace.json"
    pol = policy_file(tmp_path, packing=[1, 2, 1, 2], mapping=[0, 1, 0, 1])
    code = cli_main(["run", "--gpus", "2", "--policy", pol, "--steps", "5", "--seq-len", str(SEQ),
                     "--batch-tokens", str(SEQ * MBS * MB), "--lr", str(LR), *CONSTANT, "--out", str(out),
                     "--trace", str(trace)])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    for word in ("loss", "accuracy", "tokens/s measured", "predicted by the simulator", "B/param measured", "saved",
                 "for the layers each of the 2 rank(s) holds", "optimizer scratch"):
        assert word in captured.out
    assert "training [" in captured.err
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} >= {"g0", "g1"}
    # each device action's issue by its rank's main thread, on a thread of its own, named as the action
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} >= {"g0.issue", "g1.issue"}
    not_actions = (ISSUE_CAT, HOST_CAT)
    actions = {e["args"]["id"]: e["name"] for e in events if e.get("ph") == "X" and e["cat"] not in not_actions}
    issued = [e for e in events if e.get("cat") == ISSUE_CAT]
    assert issued and all(actions[e["args"]["id"]] == e["name"] and e["dur"] >= 0 for e in issued)
    between = [e for e in events if e.get("cat") == HOST_CAT and e["name"] == "between windows"]
    assert len(between) == 2 and all(e["dur"] >= 0 for e in between)  # one per rank: steps 0-3, then 4
    assert len(load_run_trace(trace).records) == len(actions)  # replay reads the actions only
    ref = reference("tiny-llama", 5)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    from tinypipe.backends.model.hf import build_model

    names = build_model("tiny-llama", seed=0, only=set()).names
    saved = dict(model.named_parameters())
    for i, tensors in ref.state.items():
        for n, want in tensors.items():
            torch.testing.assert_close(saved[names[i][n]].detach(), want, rtol=1e-5, atol=1e-6)


def test_run_trains_a_tied_model_and_saves_it_tied(tmp_path: Path, tied_config: str,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """`tinypipe run --gpus 2` on a tied model (mapping chosen by the policy: the head joins the
    embedding's GPU) saves a model that `from_pretrained` loads tied, with exactly the reference's
    trained weights."""
    from transformers import AutoModelForCausalLM

    from tinypipe.backends.model.hf import build_model

    out = tmp_path / "out"
    pol = policy_file(tmp_path, packing=[1, 2, 1, 1], mapping="round-robin")
    code = cli_main(["run", "--gpus", "2", "--model", tied_config, "--policy", pol, "--steps", "4",
                     "--seq-len", str(SEQ), "--batch-tokens", str(SEQ * MBS * MB), "--lr", str(LR), *CONSTANT,
                     "--out", str(out)])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    ref = reference(tied_config, 4)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = build_model(tied_config, seed=0, only=set()).names
    saved = dict(model.named_parameters())
    for i, tensors in ref.state.items():
        for n, want in tensors.items():
            assert torch.equal(saved[names[i][n]].detach(), want), (i, n)


def test_checkpoint_then_resume_equals_an_uninterrupted_run(tmp_path: Path, qwen3_config: str) -> None:
    """A Qwen3 on 3 processes (replicated host, pack swap) stops after 2 of 5 steps, leaving a
    checkpoint; `--resume` continues: losses and final weights equal the uninterrupted reference, and
    the checkpoints of step 4 and of the end are both kept."""
    out = tmp_path / "out"
    pol = policy_file(tmp_path, packing=[1, 1, 1, 1, 1], mapping=[0, 1, 2, 0, 1], swap="pack",
                      host_memory="replicated")
    args = parse("--gpus", "3", "--model", qwen3_config, "--policy", pol, "--steps", "5", "--out", str(out),
                 "--checkpoint-every", "4", "--keep-checkpoints", "2")
    plan = plan_run(args)
    first = launch(dataclasses.replace(plan.job, stop_after=2, progress=False, save_model=False), plan.world)
    assert first is not None and all(r.interrupted for r in first)
    assert checkpoint.find(out) == out / checkpoint.DIR
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 2
    resumed = plan_run(parse("--gpus", "3", "--model", qwen3_config, "--policy", pol, "--steps", "5", "--out",
                              str(out), "--checkpoint-every", "4", "--resume", "--keep-checkpoints", "2"))
    second = launch(dataclasses.replace(resumed.job, progress=False, save_model=False, keep_masters=True), 3)
    assert second is not None and [r.start_step for r in second] == [2, 2, 2]
    # step 4 (--checkpoint-every 4), then the end (time-based checkpointing, on by default): the last two kept
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 5
    assert json.loads((out / "checkpoint.old" / "meta.json").read_text())["step"] == 4
    ref = reference(qwen3_config, 5)
    losses = {k: v for r in second for k, v in r.losses.items()}
    assert [losses[k] for k in range(5)] == pytest.approx(ref.losses, rel=1e-6, abs=1e-7)
    masters = {i: t for r in second for i, t in r.masters.items()}
    for i, tensors in ref.state.items():
        for n, want in tensors.items():
            torch.testing.assert_close(masters[i][n], want, rtol=1e-5, atol=1e-6)


def test_a_failing_worker_brings_the_others_down_with_one_line(tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    """Rank 1 fails at its first action while rank 0 waits for it: the run ends with rank 1's
    error in one line (its words, not the exception's class; no `Terminating process` warnings
    from torch on stderr), and no checkpoint or model is left half-written."""
    pol = policy_file(tmp_path, packing=[3, 3], mapping=[0, 1])
    plan = plan_run(parse("--gpus", "2", "--policy", pol, "--steps", "2", "--out", str(tmp_path / "out")))
    sched = plan.schedule
    first = next(a for a in sched.actions if a.resource == "g1.h2d")
    acts = tuple(dataclasses.replace(a, kind=Kind.EVICT, resource="g1.compute") if a is first else a
                 for a in sched.actions)
    job = dataclasses.replace(plan.job, schedule=dataclasses.replace(sched, actions=acts), progress=False)
    with pytest.raises(WorkerError) as info:
        launch(job, 2)
    msg = str(info.value)
    assert msg.startswith("rank 1 failed:") and "\n" not in msg and "not on the device" in msg
    assert "Error:" not in msg and "tinypipe." not in msg
    assert "Terminating process" not in capfd.readouterr().err
    assert not (tmp_path / "out" / "checkpoint").exists()


@pytest.mark.parametrize(("argv", "match"), [
    (["--model", "/nonexistent/model"], "unknown model"),
    (["--data", "DATA_NOT_JSONL", "--byte-tokens"], "not a JSON object"),
    (["--model", "qwen3-1.7b", "--data", "DATA_NOT_JSONL"], "no tokenizer files .* 151,936 ids.* --byte-tokens"),
    (["--policy", "POLICY_TOO_MANY_LAYERS"], "pack sizes sum to 7"),
    (["--backend", "cuda", "--gpus", "64"], "cuda|CUDA"),
    (["--gpus", "1000"], "too many CPU workers"),
    (["--batch-tokens", "50"], "not a multiple of the microbatch"),
    (["--resume", "--out", "EMPTY_DIR"], "no checkpoint"),
    (["--out", "EARLIER_RUN"], "already holds an earlier run"),
    (["--model", "MODEL_DIR_WITHOUT_WEIGHTS"], "no model weights"),
    (["--model", "TIED_MODEL", "--policy", "POLICY_TIED_APART"], "mapping: .*ties its LM head"),
    (["--model", "TIED_MODEL", "--policy", "mobius"], 'every GPU needs at least one pack .*"num_packs": 3'),
    (["--lr", "-1"], "--lr: must be a positive number, got -1"),
    (["--lr", "nan"], "--lr: must be a positive number, got nan"),
    (["--betas", "1.5", "0.9"], r"--betas: each must be in \[0, 1\)"),
    (["--eps", "0"], "--eps: must be a positive number"),
    (["--weight-decay", "-0.1"], "--weight-decay: must be a number >= 0"),
    (["--seed", "-1"], "--seed: must be in"),
    (["--checkpoint-minutes", "inf"], "--checkpoint-minutes: must be a number >= 0"),
    (["--hardware", "h200x2"], "--hardware h200x2: only for --backend cuda"),
    (["--out", "A_FILE"], "exists and is not a directory"),
    (["--out", "/proc/tinypipe-run"], "--out /proc/tinypipe-run: cannot write in /proc"),
    (["--trace", "/proc/trace.json"], "--trace /proc/trace.json: cannot write in /proc"),
    (["--trace", "NO_DIR/trace.json"], "does not exist"),
    (["--resume", "--out", "CKPT_AT_30", "--steps", "20"], "--steps 20: the checkpoint .* is already at step 30"),
    (["--resume", "--out", "CKPT_AT_30", "--lr", "0.5"], "was started with --lr 0.01, this command gives --lr 0.5"),
    (["--seq-len", "1"], "--seq-len 1: step 0: no token carries loss"),
    (["--model", ""], "--model: empty"),
    (["--model", "TRUNCATED_SHARD"], "model-00002-of-00002.safetensors: truncated"),
    (["--model", "GARBAGE_SHARD"], "model-00002-of-00002.safetensors: not a safetensors file"),
    (["--model", "MISSING_SHARD"], "model-00002-of-00002.safetensors: missing"),
    (["--model", "BAD_INDEX"], "model.safetensors.index.json: not a safetensors index"),
    (["--model", "BAD_TOKENIZER", "--data", "GOOD_DATA"], "cannot load the tokenizer"),
    (["--gpus", "2", "--resume", "--out", "CORRUPT_RANK"], r"rank1\.safetensors: truncated or corrupt"),
    (["--epochs", "1"], "--epochs: give --data"),
    (["--load-in-4bit"], "--load-in-4bit needs --lora R"),
    (["--eval-fraction", "0.2"], "--eval-fraction: give --data"),
    (["--eval-every", "5"], "--eval-every: give --eval-data FILE or --eval-fraction F"),
    (["--eval-fraction", "1.5", "--data", "GOOD_DATA", "--byte-tokens"], r"--eval-fraction: must be in \(0, 1\)"),
    (["--eval-data", "TINY_DATA", "--byte-tokens"], "fewer than one step's"),
    (["--max-grad-norm", "0"], "--max-grad-norm: must be a positive number"),
    (["--warmup-ratio", "1.5"], r"--warmup-ratio: must be in \[0, 1\)"),
])
def test_bad_input_is_one_line_error_before_any_worker(argv: list[str], match: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each mistake is an InputError raised by the planning step; nothing is spawned."""
    from tinypipe.backends.launch import spawn as launch_mod

    for name in ("start_processes", "_run_here"):  # where launch() starts workers, or runs one in-process
        monkeypatch.setattr(launch_mod, name, lambda *a, **k: pytest.fail("a worker was started"))
    bad_data = tmp_path / "data.jsonl"
    bad_data.write_text('{"text": "fine"}\nthis is not json\n')
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_QWEN3))
    tied_dir = tmp_path / "tied"
    tied_dir.mkdir()
    tied = tied_dir / "tied.json"
    tied.write_text(json.dumps(TINY_QWEN3_TIED))
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")  # a saved model: a new run must not overwrite it
    subst = {"DATA_NOT_JSONL": str(bad_data), "POLICY_TOO_MANY_LAYERS": policy_file(tmp_path, packing=[4, 3]),
             "EMPTY_DIR": str(tmp_path), "MODEL_DIR_WITHOUT_WEIGHTS": str(model_dir), "EARLIER_RUN": str(earlier),
             "TIED_MODEL": str(tied), "POLICY_TIED_APART": policy_file(tied_dir, packing=[2, 2, 1], mapping=[0, 0, 1]),
             "A_FILE": str(bad_data), "NO_DIR": str(tmp_path / "no" / "such"),
             "CKPT_AT_30": fake_checkpoint(tmp_path / "at30", step=30, steps=3000),
             "CKPT_DONE": fake_checkpoint(tmp_path / "done", step=30, steps=30)}
    if any(a in ("TRUNCATED_SHARD", "GARBAGE_SHARD", "MISSING_SHARD", "BAD_INDEX", "BAD_TOKENIZER") for a in argv):
        subst.update(_broken_models(tmp_path))
    if "GOOD_DATA" in argv:
        good = tmp_path / "good.txt"
        good.write_text("hello world\n" * 20)
        subst["GOOD_DATA"] = str(good)
    if "TINY_DATA" in argv:
        tiny = tmp_path / "tiny.txt"
        tiny.write_text("hi there\n")
        subst["TINY_DATA"] = str(tiny)
    if "CORRUPT_RANK" in argv:
        subst["CORRUPT_RANK"] = _corrupt_checkpoint(tmp_path / "corrupt")
    args = parse(*[subst.get(a, a) for a in argv])
    with pytest.raises(InputError, match=match) as info:
        plan_run(args)
    assert "\n" not in str(info.value)


def _broken_models(tmp: Path) -> dict[str, str]:
    """Model directories whose weights (two shards and an index, saved from tiny-llama) are broken one way each."""
    from tinypipe.backends.model.hf import build_model
    from tinypipe.backends.save.hf_save import save_pretrained

    base = tmp / "saved"
    stack = build_model("tiny-llama", seed=0)
    state = stack.state()
    save_pretrained(state, stack.config, base, rank=0, world=1)
    # two shards: layers 0-2 in the first, 3-5 in the second
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in sorted(base.glob("model-*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    names = sorted(tensors)
    half = {n: tensors[n] for n in names[: len(names) // 2]}, {n: tensors[n] for n in names[len(names) // 2:]}
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for part, f in zip(half, files):
        save_file(part, str(base / f))
    index = {"metadata": {}, "weight_map": {n: files[k] for k in (0, 1) for n in half[k]}}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    out = {}
    for name, breaks in (("TRUNCATED_SHARD", lambda d: (d / files[1]).write_bytes((d / files[1]).read_bytes()[:-64])),
                         ("GARBAGE_SHARD", lambda d: (d / files[1]).write_bytes(b"\x10\0\0\0\0\0\0\0garbage!")),
                         ("MISSING_SHARD", lambda d: (d / files[1]).unlink()),
                         ("BAD_INDEX", lambda d: (d / "model.safetensors.index.json").write_text("{not json")),
                         ("BAD_TOKENIZER", lambda d: (d / "tokenizer.json").write_text("{not a tokenizer"))):
        d = tmp / name.lower()
        shutil.copytree(base, d)
        breaks(d)
        out[name] = str(d)
    return out


def _corrupt_checkpoint(out: Path) -> str:
    """A run directory whose checkpoint (this module's default settings on 2 ranks, step 1) has a truncated
    rank1.safetensors: written by a real 1-step run, then cut."""
    from tinypipe.backends.launch.spawn import run_threads

    plan = plan_run(parse("--gpus", "2", "--steps", "2", "--out", str(out)))
    run_threads(dataclasses.replace(plan.job, stop_after=1, progress=False, save_model=False,
                                    write_metrics=False), 2)
    f = out / checkpoint.DIR / "rank1.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return str(out)


def test_cuda_runs_default_to_every_visible_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --gpus, a CUDA run takes every GPU torch sees (a 1-GPU box is not asked for 2); the CPU keeps 2."""
    from tinypipe.backends.options.settings import settle

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = settle(vars(parse("--backend", "cuda", "--out", str(tmp_path / "a"))))
    cpu = settle(vars(parse("--out", str(tmp_path / "b"))))
    given = settle(vars(parse("--backend", "cuda", "--gpus", "3", "--out", str(tmp_path / "c"))))
    assert (cuda.gpus, cpu.gpus, given.gpus) == (1, 2, 3)


def test_resume_continues_the_recorded_run(tmp_path: Path) -> None:
    """`--resume --out DIR` alone takes every setting from the checkpoint's record, the target steps
    included; a new run's defaults checkpoint every 10 minutes of training."""
    from tinypipe.backends.options.settings import RECORDED, record, settle

    first = settle(vars(parse("--steps", "3000", "--model", "tiny-qwen3", "--gpus", "3", "--seed", "7",
                              "--checkpoint-every", "50", "--out", str(tmp_path / "new"))))
    assert first.checkpoint_minutes == 10.0
    out = fake_checkpoint(tmp_path / "run", step=30, **record(first))
    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    again = settle(vars(ap.parse_args(["--resume", "--out", out])))
    assert {k: getattr(again, k) for k in RECORDED} == {k: getattr(first, k) for k in RECORDED}
    assert again.steps == 3000 and again.model == "tiny-qwen3" and again.lr == LR


def test_a_tied_model_runs_on_every_gpu_under_the_defaults(tmp_path: Path, tied_config: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The default policy would put a tied model's head pack, and so every pack, on GPU 0: the
    default job spreads the layers over more packs dealt round-robin, and says so."""
    import tinypipe.backends.launch.prepare as plan_mod

    monkeypatch.setattr(plan_mod, "cpu_hardware", lambda workers, threads: fixed_cpu_hardware(workers))
    plan = plan_run(parse("--gpus", "2", "--model", tied_config, "--out", str(tmp_path / "out")))
    assert sorted(set(plan.schedule.pack_gpu)) == [0, 1]
    assert plan.schedule.pack_gpu[0] == plan.schedule.pack_gpu[-1]  # the head with the embedding
    assert plan.note is not None and "balanced packs dealt round-robin" in plan.note
    assert plan.job.checkpoint_s == 600.0


def test_checkpoints_by_time_keep_the_last_two(tmp_path: Path) -> None:
    """With time-based checkpoints every window is due when the interval is tiny (steps 4 and 6 of
    a 6-step run, 4 iterations a window): with two kept (--keep-checkpoints 2), both, newest in
    checkpoint/. A long interval leaves only the checkpoint at the end."""
    from tinypipe.backends.launch.spawn import run_threads

    pol = policy_file(tmp_path, packing=[3, 3], mapping=[0, 1])
    plan = plan_run(parse("--gpus", "2", "--policy", pol, "--steps", "6", "--out", str(tmp_path / "plan")))
    for name, every_s, steps in (("often", 1e-9, [6, 4]), ("rarely", 3600.0, [6])):
        out = tmp_path / name
        run_threads(dataclasses.replace(plan.job, out=str(out), checkpoint_s=every_s, progress=False,
                                        save_model=False, keep_checkpoints=2), 2)
        found = [json.loads((out / d / "meta.json").read_text())["step"] for d in (checkpoint.DIR, checkpoint.OLD)
                 if (out / d).exists()]
        assert found == steps, name
        assert not (out / checkpoint.TMP).exists()


def test_issue_lines_give_each_ranks_share_of_a_steady_step() -> None:
    """Literal: per rank, its main thread's issue spans in the iterations after the first over those
    iterations' time; at 80% or more the line says the GPU likely waits (and suggests --compile when the
    blocks are eager); a run of one iteration has no steady step and no line."""
    from tinypipe.backends.launch.run_report import _issue_lines, issue_shares
    from tinypipe.ir.timeline import Record, Timeline

    recs = tuple(Record(i, "g0.compute", "FWD", "F", 1, 0, i // 2, float(i), i + 1.0) for i in range(6))
    tl = Timeline(recs, {}, source="cuda")
    g0 = argparse.Namespace(rank=0, issue=[(i, float(i), i + 0.9) for i in range(6)])  # 0.9 s of each 1 s action
    g1 = argparse.Namespace(rank=1, issue=[(2, 2.0, 2.5), (0, 0.0, 1.0)])
    assert issue_shares(tl, [g1, g0], 2.0) == pytest.approx({0: 0.9, 1: 0.125})
    assert _issue_lines(tl, [g0], 2.0, compiled=False) == [
        "host      main thread issuing the GPU's work: g0 90% of each steady step; the GPU likely waits for its host "
        "(--compile issues a block in fewer calls)"]
    assert _issue_lines(tl, [g1], 2.0, compiled=True) == [
        "host      main thread issuing the GPU's work: g1 12% of each steady step"]
    assert _issue_lines(Timeline(recs[:2], {}, source="cuda"), [g0], 2.0, compiled=True) == []


def test_a_run_that_lost_host_cpu_to_the_hypervisor_says_so() -> None:
    """Literal: above 1% of the host's CPU time stolen on any rank, one line with the largest share;
    at or below it, or unknown, none."""
    from tinypipe.backends.launch.run_report import _steal_lines

    def ranks(*shares: float | None) -> list[argparse.Namespace]:
        return [argparse.Namespace(host_steal_share=x) for x in shares]

    assert _steal_lines(ranks(0.004, 0.023)) == [
        "host      the hypervisor took 2.3% of the host's CPU time during the run: the host optimizer's steps can "
        "run up to 2x slow, and the run slower than predicted"]
    assert _steal_lines(ranks(0.01, None)) == []
    assert _steal_lines(ranks(None)) == []


def test_sparkline_is_compact_and_ordered() -> None:
    """The loss curve in the summary: one character per bin, lowest value lowest bar."""
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert len(sparkline(list(range(500)), width=40)) <= 40


def _hinted_plan(measured_over_predicted: float, *, analytic: bool = True, backend: str = "cpu",
                 compiled: bool = False) -> tuple[Any, float]:
    job = SimpleNamespace(model="tiny llama/config.json", seq_len=64, microbatch_size=4, backend=backend, threads=1,
                          compile_blocks=compiled)
    plan = SimpleNamespace(job=job, prediction=SimpleNamespace(iteration_s=0.0148),
                           trace=SimpleNamespace(analytic=analytic, dtype="fp32"))
    return plan, 0.0148 * measured_over_predicted


@pytest.mark.parametrize(("backend", "compiled", "compile_flag"), [("cpu", False, None), ("cuda", False, False),
                                                                  ("cuda", True, True)])
def test_an_analytic_prediction_far_off_names_the_profile_that_would_measure_it(backend: str, compiled: bool,
                                                                               compile_flag: bool | None) -> None:
    """Six times off (the default job's CPU stand-in): one line with the ratio and a `tinypipe profile` command
    that the CLI parses into this job's model, shape, backend, dtype, threads and compile mode."""
    lines = profile_hint(*_hinted_plan(6.0, backend=backend, compiled=compiled))
    assert len(lines) == 1 and "the step took 6.0 x the prediction" in lines[0]
    cmd = lines[0].split("`")[1]
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    assert (args.command, args.model, args.seq_len, args.microbatch_size, args.backend, args.dtype, args.threads,
            args.compile, args.out) == ("profile", "tiny llama/config.json", 64, [4], backend, "fp32", 1,
                                        compile_flag, "DIR")


@pytest.mark.parametrize(("ratio", "analytic"), [(1.9, True), (0.6, True), (6.0, False)])
def test_a_close_or_measured_prediction_gets_no_profile_hint(ratio: float, analytic: bool) -> None:
    """Within 2 x either way, or from a measured trace (off for other reasons): no line."""
    assert profile_hint(*_hinted_plan(ratio, analytic=analytic)) == []
    assert profile_hint(*_hinted_plan(0.3))[0].startswith("          the step took 0.3 x")


def _cuda_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_gpus() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(("layout", "optimizer", "swap"), [("compact", "sync", "layer"), ("replicated", "sync", "pack"),
                                                           ("compact", "async", "layer")])
def test_cuda_two_gpus_train_like_the_reference(tmp_path: Path, layout: str, optimizer: str, swap: str) -> None:
    """NCCL, one stream per resource, events for dependencies, fp32 compute: losses match the CPU
    reference to the precision of different kernels; weights within a fraction of one AdamW step
    (Adam divides by the gradient's running magnitude, so where a gradient is ~0 a kernel's
    rounding difference can move an element by up to lr per step)."""
    pol = policy_file(tmp_path, packing=[1, 2, 1, 2], mapping=[0, 1, 0, 1], host_memory=layout, optimizer=optimizer,
                      swap=swap)
    plan = plan_run(parse("--backend", "cuda", "--gpus", "2", "--dtype", "fp32", "--policy", pol, "--steps", "6",
                           "--out", str(tmp_path / "out")))
    results = launch(dataclasses.replace(plan.job, progress=False, keep_masters=True), 2)
    assert results is not None
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS, microbatches=MB,
                           seed=0)
    ref = reference_train("tiny-llama", batches, steps=6, lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0,
                          seed=0, async_staleness=1 if optimizer == "async" else 0)
    losses = {k: v for r in results for k, v in r.losses.items()}
    assert [losses[k] for k in range(6)] == pytest.approx(ref.losses, rel=1e-4)
    masters = {i: t for r in results for i, t in r.masters.items()}
    for i, tensors in ref.state.items():
        for n, want in tensors.items():
            torch.testing.assert_close(masters[i][n], want, rtol=1e-3, atol=LR / 5)
    assert all(r.peak_device_bytes > 0 for r in results)
    assert all(rec.end_s >= rec.start_s for r in results for rec in r.records)
    for r in results:  # streams persist across windows: no new cuBLAS workspace every window
        used = [(rec.iteration, b) for rec, (_, b) in zip(r.records, r.memory)]
        assert max(b for s, b in used if s == 5) <= max(b for s, b in used if s == 0) + (1 << 20)


def test_a_policy_that_does_not_fit_host_memory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's ledgers at the devices' capacities decide whether the policy fits: a model
    whose host state exceeds the host's memory is an InputError naming the device, before any worker."""
    import tinypipe.backends.launch.prepare as plan_mod

    small = fixed_cpu_hardware(2)
    small = dataclasses.replace(small, host=dataclasses.replace(small.host, memory_bytes=1 << 20))
    monkeypatch.setattr(plan_mod, "cpu_hardware", lambda workers, threads: small)
    with pytest.raises(InputError, match="needs .* of host memory at its predicted peak, more than the 1.0 MiB"):
        plan_run(parse("--gpus", "2", "--out", str(tmp_path)))
