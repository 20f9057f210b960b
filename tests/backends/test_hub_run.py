"""`tinypipe run --model org/name` trains the Hugging Face cache's snapshot of a Hub model with HF_HUB_OFFLINE=1:
its safetensors weights, which every worker reads; a cached config without weights is one line before any worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import TINY_QWEN3  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.cli import main as cli_main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, MBS, MB, STEPS, LR = 16, 2, 2, 2, 1e-2


def cached_snapshot(cache: Path, repo_id: str, *, weights_seed: int | None) -> Path:
    """A Hub model in the Hugging Face cache's layout (models--org--name/{refs/main, snapshots/<commit>/}): the tiny
    Qwen3's config and, with `weights_seed`, safetensors weights drawn by transformers from that seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    if weights_seed is None:
        (snapshot / "config.json").write_text(json.dumps(TINY_QWEN3))
        return snapshot
    torch.manual_seed(weights_seed)
    config = AutoConfig.for_model("qwen3", **{k: v for k, v in TINY_QWEN3.items() if k != "model_type"})
    AutoModelForCausalLM.from_config(config).save_pretrained(snapshot)
    return snapshot


def reference(model: str) -> dict[int, dict[str, torch.Tensor]]:
    """The single-process reference's weights after the run's steps on the embedded task, from `model`."""
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS, microbatches=MB,
                           seed=0)
    state: dict[int, dict[str, torch.Tensor]] = reference_train(model, batches, steps=STEPS, lr=LR,
                                                                betas=(0.9, 0.98)).state
    return state


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hf" / "hub"


def test_run_trains_a_cached_hub_model_from_its_weights(cache: Path, tmp_path: Path,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """The saved model equals the reference trained from the snapshot's weights, not from tinypipe's seeded
    initialisation of the same config."""
    from transformers import AutoModelForCausalLM

    snapshot = cached_snapshot(cache, "acme/tiny-qwen3", weights_seed=123)
    out = tmp_path / "out"
    code = cli_main(["run", "--gpus", "1", "--model", "acme/tiny-qwen3", "--microbatch-size", str(MBS),
                     "--steps", str(STEPS), "--seq-len", str(SEQ), "--batch-tokens", str(SEQ * MBS * MB),
                     "--lr", str(LR), "--lr-schedule", "constant", "--warmup-ratio", "0", "--out", str(out)])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert "tinypipe run: tiny-qwen3 (" in captured.out + captured.err
    saved = dict(AutoModelForCausalLM.from_pretrained(str(out)).named_parameters())
    names = build_model(str(snapshot), seed=0, only=set()).names
    for i, tensors in reference(str(snapshot)).items():
        for n, want in tensors.items():
            torch.testing.assert_close(saved[names[i][n]].detach(), want, rtol=1e-5, atol=1e-6)
    config_only = tmp_path / "tiny-qwen3.json"
    config_only.write_text(json.dumps(TINY_QWEN3))
    seeded = reference(str(config_only))[0]["embed_tokens.weight"]
    assert not torch.allclose(saved[names[0]["embed_tokens.weight"]].detach(), seeded)


def test_a_cached_config_without_weights_is_one_line_before_any_worker(cache: Path, tmp_path: Path,
                                                                       capfd: pytest.CaptureFixture[str]) -> None:
    snapshot = cached_snapshot(cache, "acme/bare", weights_seed=None)
    code = cli_main(["run", "--gpus", "1", "--model", "acme/bare", "--steps", "1", "--out", str(tmp_path / "out")])
    err = capfd.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err == (f"error: acme/bare: the Hugging Face cache holds its config ({snapshot}) but no safetensors "
                   "weights, and HF_HUB_OFFLINE is set; download it first (hf download acme/bare) or unset "
                   "HF_HUB_OFFLINE")


def test_run_trains_on_a_cached_hub_datasets_chosen_configuration(cache: Path, tmp_path: Path,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """`--data org/name --data-config C --data-split S` reaches the planner and every worker: the default
    configuration here holds no record field, so a worker reading it would fail the run."""
    pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    snapshot = cache / "datasets--acme--mixed" / "snapshots" / "0123abcd"
    readme = ("---\nconfigs:\n- config_name: raw\n  default: true\n  data_files:\n  - split: train\n"
              "    path: raw.parquet\n- config_name: alpaca\n  data_files:\n  - split: train\n"
              "    path: alpaca.parquet\n---\n")
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text(readme)
    pq.write_table(pa.Table.from_pylist([{"a": "x", "b": "y"}]), snapshot / "raw.parquet")
    rows = [{"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), snapshot / "alpaca.parquet")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    argv = ["run", "--gpus", "1", "--model", "tiny-llama", "--data", "acme/mixed", "--data-config", "alpaca",
            "--data-split", "train[:32]", "--steps", "1", "--seq-len", "256", "--microbatch-size", str(MBS),
            "--batch-tokens", str(256 * MBS * MB), "--no-save"]  # Alpaca's prompt alone is 150 tokens
    code = cli_main([*argv, "--out", str(tmp_path / "out")])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert ("data      acme/mixed: Hugging Face dataset, configuration alpaca, split train[:32] (Alpaca), 32 examples"
            in captured.out + captured.err)
    code = cli_main([*argv, "--eval-data", "acme/mixed", "--out", str(tmp_path / "out2")])
    assert code == 2
    assert capfd.readouterr().err.strip() == (
        "error: --eval-data acme/mixed: a Hugging Face dataset is read as --data only (its --data-split); hold out a "
        "share of it with --eval-fraction, or give a held-out file")


def test_a_split_or_configuration_without_a_dataset_is_one_line(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "--data-split", "test", "--out", str(tmp_path / "out")]) == 2
    assert capfd.readouterr().err.strip() == ("error: --data-split: give --data ORG/NAME, the Hugging Face dataset to "
                                              "read it of")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello there"}\n')
    assert cli_main(["run", "--data", str(data), "--data-config", "x", "--out", str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err
    assert "d.jsonl: a split or configuration (--data-split, --data-config) is chosen within a Hugging Face" in err
