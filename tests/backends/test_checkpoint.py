"""Checkpoints without pickle, sized before training, refused when the disk cannot hold them, and a write
that fails (a full disk) costs one line, not the run or its model."""

from __future__ import annotations

import dataclasses
import errno
import json
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import compiled, job  # noqa: E402

from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.options import frugal  # noqa: E402
from tinypipe.backends.save import checkpoint, ckpt_format  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.describe.hfconfig import load_model  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_checkpoint_file_is_safetensors_and_json_and_round_trips(tmp_path: Path) -> None:
    """Nested state (int keys, tuples, a str enum, Python's RNG state, tensors of every dtype a host state
    holds) written by `ckpt_format.write` reads back equal; the tensor file is standard safetensors
    (`safetensors.safe_open` reads every tensor) and nothing is pickled."""
    from safetensors import safe_open

    from tinypipe.policy.modes import HostMemory

    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "i16": torch.arange(6, dtype=torch.int16),
               "u8": torch.arange(256, dtype=torch.uint8), "scalar": torch.tensor(3.0), "empty": torch.empty(0),
               "rng": torch.get_rng_state()}
    state = {"layout": HostMemory.COMPACT, "steps": {0: 2, 5: 3}, "betas": (0.9, 0.98), "python": random.getstate(),
             "optim": {3: {"state": {0: {"step": tensors["scalar"]}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}},
             "losses": {0: 1.5, 1: float("nan")}, "t": tensors}
    ckpt_format.write(tmp_path / "rank0", state, checkpoint._write_synced)
    back = ckpt_format.read(tmp_path / "rank0")
    assert back["layout"] == "compact" and back["steps"] == {0: 2, 5: 3} and back["betas"] == (0.9, 0.98)
    assert back["python"] == random.getstate()
    assert back["optim"][3]["param_groups"] == [{"lr": 1e-3, "params": [0]}]
    assert back["losses"][0] == 1.5 and back["losses"][1] != back["losses"][1]
    for name, t in tensors.items():
        assert back["t"][name].dtype == t.dtype and torch.equal(back["t"][name], t), name
    with safe_open(str(tmp_path / "rank0.safetensors"), framework="pt") as f:
        read = {k: f.get_tensor(k) for k in f.keys()}
    flat = ckpt_format.flatten(state)[1]
    assert sorted(read) == sorted(flat) and all(torch.equal(read[k], flat[k]) for k in flat)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank0.safetensors"]
    assert ckpt_format.tensor_file_bytes(flat) == (tmp_path / "rank0.safetensors").stat().st_size


def _run(tmp_path: Path, name: str, **changes: Any) -> list[Any]:
    sched = compiled("tiny-llama", PRESETS["tinypipe"].replace(optimizer="sync", packing=(3, 3), mapping=(0, 1),
                                                               **changes.pop("policy", {})), 2)
    base = dataclasses.replace(job("tiny-llama", sched, 6), out=str(tmp_path / name), checkpoint_s=3600.0,
                               save_model=True, **changes)
    return run_threads(base, 2)


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_checkpoint_size_is_the_formula_before_training(tmp_path: Path, state: str) -> None:
    """The bytes a run's checkpoint takes on disk are `hostmem.checkpoint_bytes` for each rank's layers (the
    formula `check_disk` uses before training), less at most its per-rank slack (step counters, RNG states,
    the JSON beside the tensors)."""
    from tinypipe.estimate.hostmem import CHECKPOINT_SLACK_BYTES

    results = _run(tmp_path, state, policy={"optimizer_state": state})
    assert not any(r.checkpoint_failures for r in results)
    written = checkpoint.held_bytes(tmp_path / state)
    sched = compiled("tiny-llama", PRESETS["tinypipe"].replace(optimizer="sync", packing=(3, 3), mapping=(0, 1),
                                                               optimizer_state=state), 2)
    formula = frugal.checkpoint_plan_bytes(load_model("tiny-llama"), sched)
    assert formula - 2 * CHECKPOINT_SLACK_BYTES <= written <= formula


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_model_is_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's file of the second checkpoint (step 4 of 6, every 2) meets a full disk (ENOSPC): every rank
    learns it, the partial checkpoint is deleted, the one line names the step, the rank, the error and the
    checkpoint kept (step 2); the run goes on, checkpoints step 6 and saves its fine-tuned model."""
    writes: list[str] = []
    real = checkpoint._write_synced

    def full_disk(path: Path, write: Any) -> None:
        writes.append(path.name)
        if path.name == "rank1.safetensors" and writes.count("rank1.safetensors") == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, write)

    monkeypatch.setattr(checkpoint, "_write_synced", full_disk)
    results = _run(tmp_path, "out", checkpoint_every=2)
    out = tmp_path / "out"
    lines = results[0].checkpoint_failures
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("warning: checkpoint of step 4 not written (rank 1: No space left on device")
    assert lines[0].endswith(f"kept: {out / 'checkpoint'} (step 2)")
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 6
    assert not (out / checkpoint.TMP).exists()
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()


def test_a_disk_too_small_refuses_the_run_before_training_in_one_line(tmp_path: Path) -> None:
    """`check_disk`: keep + 1 checkpoints and the model against the free bytes; too few is one line with the
    bytes needed and what to change; enough passes; --keep-checkpoints 0 needs only the model."""
    spec = load_model("tiny-llama")
    sched = compiled("tiny-llama", PRESETS["tinypipe"].replace(packing=(3, 3), mapping=(0, 1)), 2)
    one, model = frugal.checkpoint_plan_bytes(spec, sched), frugal.model_bytes(spec)
    out = str(tmp_path / "run")
    ok = frugal.check_disk(out, spec, sched, keep=1, checkpoints=True, free=2 * one + model)
    assert ok["need"] == 2 * one + model
    with pytest.raises(InputError) as info:
        frugal.check_disk(out, spec, sched, keep=2, checkpoints=True, free=2 * one + model)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"--out {out}: the run needs")
    assert "3 x" in msg and "--keep-checkpoints 1" in msg and "--keep-checkpoints 0" in msg
    assert "larger filesystem" in msg
    assert frugal.check_disk(out, spec, sched, keep=0, checkpoints=True, free=model)["need"] == model


def test_a_lora_run_needs_disk_for_its_adapters_not_the_base() -> None:
    """Under LoRA a checkpoint is the adapters' fp32 weights and two moments per rank (plus its slack) and
    the output the fp32 adapter directory; `--merge` adds the merged model in the save dtype."""
    from tinypipe.estimate.hostmem import CHECKPOINT_SLACK_BYTES
    from tinypipe.estimate.lora_costs import model_adapter_params
    from tinypipe.policy.lora_spec import LoraSpec

    spec, lora = load_model("tiny-llama"), LoraSpec(rank=2)
    sched = compiled("tiny-llama", PRESETS["tinypipe"].replace(packing=(3, 3), mapping=(0, 1), lora=lora), 2)
    adapters = model_adapter_params(spec, lora)
    assert 0 < adapters < spec.params // 10
    one = frugal.checkpoint_plan_bytes(spec, sched)
    assert one == 12 * adapters + 2 * CHECKPOINT_SLACK_BYTES
    got = frugal.check_disk("unused", spec, sched, keep=1, checkpoints=True, save_dtype="bf16", free=1 << 40)
    assert got["need"] == 2 * one + 4 * adapters and got["model"] == 4 * adapters
    merged = frugal.check_disk("unused", spec, sched, keep=1, checkpoints=True, save_dtype="bf16", merge=True,
                               free=1 << 40)
    assert merged["model"] == 4 * adapters + frugal.model_bytes(spec, "bf16")
    with pytest.raises(InputError, match="--keep-checkpoints 0") as info:
        frugal.check_disk("unused", spec, sched, keep=1, checkpoints=True, free=one)
    assert "--optimizer-state" not in str(info.value)  # a LoRA checkpoint holds no host moments


def test_run_refuses_a_disk_too_small_with_exit_code_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`tinypipe run` on a filesystem with 1 KiB free: exit 2, one `error:` line naming --keep-checkpoints,
    before any worker starts (nothing written in --out)."""
    from tinypipe.cli import main

    monkeypatch.setattr(frugal, "free_bytes", lambda out: 1024)
    code = main(["run", "--steps", "2", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: --out") and "--keep-checkpoints" in err[-1]
    assert not (tmp_path / "out").exists()
