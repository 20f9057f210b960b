"""What a run writes while it trains: metrics.jsonl (every step, the reference's loss, lr and gradient norm),
Hugging Face directories every N steps and at a stop, in the dtype asked for, and the model of a run
resumed at the step it reached. Ranks run as threads (`spawn.run_threads`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import plan_run  # noqa: E402
from test_run import LR, MB, MBS, SEQ, policy_file  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.options.run_flags import add_run_arguments  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.backends.save import checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    return ap.parse_args(["--gpus", "2", "--seq-len", str(SEQ), "--batch-tokens", str(SEQ * MBS * MB), "--lr", str(LR),
                          *argv])


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_metrics_hold_every_step_with_the_references_loss_lr_and_gradient_norm(tmp_path: Path) -> None:
    """Six steps, cosine after 2 warmup steps, weight decay on the matrices only: one JSON line per step
    whose loss, lr and grad_norm (global over both ranks) equal the single-process reference's."""
    out = tmp_path / "out"
    pol = policy_file(tmp_path, packing=[1, 2, 1, 2], mapping=[0, 1, 0, 1])
    plan = plan_run(parse("--policy", pol, "--steps", "6", "--lr-schedule", "cosine", "--warmup-steps", "2",
                               "--weight-decay", "0.1", "--out", str(out)))
    run_threads(dataclasses.replace(plan.job, progress=False, save_model=False), 2)
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS, microbatches=MB,
                           seed=0)
    sched = plan.job.optim.schedule
    assert sched is not None and (sched.kind, sched.warmup_steps, sched.total_steps) == ("cosine", 2, 6)
    ref = reference_train("tiny-llama", batches, steps=6, lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1,
                          seed=0, schedule=sched, decay_exempt=True)
    assert [r["loss"] for r in got] == pytest.approx(ref.losses, rel=1e-6)
    assert [r["lr"] for r in got] == [sched.lr(k) for k in range(6)] and got[0]["lr"] == 0.0
    assert [r["grad_norm"] for r in got] == pytest.approx(ref.grad_norms, rel=1e-5)
    assert all(r["tokens"] == SEQ * MBS * MB and r["tokens_per_s"] > 0 for r in got)


def test_models_every_n_steps_at_a_stop_and_on_resume_at_the_reached_step(tmp_path: Path) -> None:
    """--save-every 2 --save-dtype bf16, stopped after step 4 (as Ctrl-C stops it): OUT/step-2 and OUT/step-4
    hold bf16 weights, OUT no model yet. `--resume --steps 4` trains nothing and writes OUT's model, equal to
    step-4's; resuming to 6 steps continues metrics.jsonl without repeating a step."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    pol = policy_file(tmp_path, packing=[3, 3], mapping=[0, 1])
    plan = plan_run(parse("--policy", pol, "--steps", "6", "--save-every", "2", "--save-dtype", "bf16",
                               "--out", str(out)))
    first = run_threads(dataclasses.replace(plan.job, progress=False, stop_after=4), 2)
    assert all(r.interrupted for r in first)
    assert json.loads((out / checkpoint.DIR / "meta.json").read_text())["step"] == 4
    assert not (out / "config.json").exists()
    for step in (2, 4):
        config = json.loads((out / f"step-{step}" / "config.json").read_text())
        assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
        shards = sorted((out / f"step-{step}").glob("*.safetensors"))
        assert len(shards) == 6 and {t.dtype for s in shards for t in load_file(s).values()} == {torch.bfloat16}
    export = plan_run(parse("--resume", "--steps", "4", "--out", str(out)))
    again = run_threads(dataclasses.replace(export.job, progress=False), 2)
    assert [r.steps_run for r in again] == [0, 0]
    for shard in sorted((out / "step-4").glob("*.safetensors")):
        saved, final = load_file(shard), load_file(out / shard.name)
        assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in saved)
    finish = plan_run(parse("--resume", "--out", str(out)))
    run_threads(dataclasses.replace(finish.job, progress=False), 2)
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]
    assert (out / "step-4").is_dir() and not (out / "step-6").exists()  # the end's model is OUT itself


def test_no_grad_norm_writes_every_step_without_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    pol = policy_file(tmp_path, packing=[3, 3], mapping=[0, 1])
    plan = plan_run(parse("--policy", pol, "--steps", "3", "--no-grad-norm", "--out", str(out)))
    run_threads(dataclasses.replace(plan.job, progress=False, save_model=False), 2)
    assert [(r["step"], r["grad_norm"]) for r in rows(out)] == [(1, None), (2, None), (3, None)]


def test_tensorboard_holds_the_metrics_of_every_step(tmp_path: Path) -> None:
    """With the tensorboard package installed, OUT/tensorboard's event file holds, per step, the loss, lr,
    gradient norm and tokens/s of metrics.jsonl (as float32, TensorBoard's scalar type), and the held-out loss
    at the steps it was measured."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(f'{{"text": "line {i}: {"xy" * (i % 7)} and {i * 7}"}}\n' for i in range(80)))
    pol = policy_file(tmp_path, packing=[3, 3], mapping=[0, 1])
    plan = plan_run(parse("--policy", pol, "--steps", "4", "--data", str(data), "--byte-tokens",
                               "--eval-fraction", "0.3", "--eval-every", "2", "--out", str(out)))
    run_threads(dataclasses.replace(plan.job, progress=False, save_model=False), 2)
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4] and [r["step"] for r in got if "eval_loss" in r] == [2, 4]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(
        f"train/{k}" for k in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"):
        board = {e.step: e.value for e in events.Scalars(f"train/{key}")}
        want = {r["step"]: r[key] for r in got if r.get(key) is not None}
        assert sorted(board) == sorted(want), key
        for step, value in want.items():
            assert board[step] == pytest.approx(value, rel=1e-6, abs=1e-30), (key, step)


def test_a_resumed_runs_tensorboard_shows_each_step_once(tmp_path: Path) -> None:
    """A run that wrote steps 1-4, resumed from its checkpoint after step 2: TensorBoard shows steps 3 and 4
    as the resumed run wrote them (the first run's are purged), as metrics.jsonl keeps one line per step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tinypipe.backends.rank.metrics import StepLog

    for start, loss in ((0, 1.0), (2, 2.0)):
        log = StepLog(str(tmp_path), steps=4, start=start, tokens_per_step=8, ranks=1, lr_at=lambda k: 0.1,
                      progress=False, norms=False)
        log.window(start, 4, 1.0, [({k: loss + k for k in range(start, 4)}, {})])
        log.close()
    assert [(r["step"], r["loss"]) for r in rows(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0)]
