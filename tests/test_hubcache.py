"""Hugging Face Hub model ids through the local Hugging Face cache: read offline when cached, a one-line error
naming the id and the cache when not, downloaded into the cache only when the network is allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinypipe.cli import main
from tinypipe.common.errors import InputError
from tinypipe.describe.hfconfig import load_config, load_model
from tinypipe.describe.hubcache import RUN_FILES, hub_cache, is_hub_id, model_dir

hub = pytest.importorskip("huggingface_hub")

TINY = load_config("tiny-llama")  # a config as the Hub serves one (tinypipe's own keys left out)


def cached_model(cache: Path, repo_id: str, files: dict[str, str], commit: str = "0123abcd") -> Path:
    """A model in the Hugging Face cache's layout: models--org--name/{refs/main, snapshots/<commit>/files}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache under HF_HOME, offline."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hf" / "hub"


def test_hub_ids_are_told_from_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`org/name` as the Hub spells it, and no local path of that name."""
    monkeypatch.chdir(tmp_path)
    assert [is_hub_id(s) for s in ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-0.6B", "a/b.c_d-e")] == [True] * 3
    assert not any(is_hub_id(s) for s in ("tiny-llama", "a/b/c", "./a/b", "/a/b", "a/cfg.json", "a--b/c", "a/..",
                                           "a/b c", "-a/b", "a/"))
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    assert not is_hub_id("acme/tiny")


def test_the_cache_is_where_huggingface_hub_keeps_it(cache: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub_cache() == cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache() == tmp_path / "elsewhere"


def test_inspect_simulate_and_search_read_a_cached_id_offline(cache: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The snapshot `refs/main` names is the model: its config, read with HF_HUB_OFFLINE=1 and nothing else."""
    snapshot = cached_model(cache, "acme/tiny-llama", {"config.json": json.dumps(TINY)})
    assert main(["inspect", "model", "acme/tiny-llama", "--json", "--hardware", "h200x1"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"] == "tiny-llama" and rep["params"] == load_model("tiny-llama").params
    assert rep["source"] == str(snapshot / "config.json")
    assert main(["simulate", "--model", "acme/tiny-llama", "--policy", "tinypipe", "--microbatches", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["tokens_per_step"] == 8192
    assert main(["search", "--model", "acme/tiny-llama", "--workers", "1", "--hardware", "h200x2", "--batch-tokens",
                 "4096", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-llama"


def test_an_uncached_id_offline_is_one_line_naming_it_and_the_cache(cache: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "model", "acme/absent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err == (f"error: acme/absent: not in the Hugging Face cache ({cache}), and HF_HUB_OFFLINE is set; "
                   "download it first (hf download acme/absent) or unset HF_HUB_OFFLINE")
    cached_model(cache, "acme/noweights", {"config.json": json.dumps(TINY)})
    with pytest.raises(InputError, match=r"acme/noweights: the Hugging Face cache holds its config \(.*\) but no "
                                         "safetensors weights, and HF_HUB_OFFLINE is set"):
        model_dir("acme/noweights", weights=True)


def test_a_local_directory_wins_over_the_id(cache: Path, tmp_path: Path) -> None:
    cached_model(cache, "acme/tiny", {"config.json": json.dumps(TINY)})
    local = tmp_path / "acme" / "tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 2}))
    assert load_model("acme/tiny").num_blocks == 2 and load_model("acme/tiny").source == "acme/tiny/config.json"


def test_downloads_only_when_the_network_is_allowed(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not cached and HF_HUB_OFFLINE unset: the config (inspect) or the config, safetensors and tokenizer files
    (run) are downloaded into the cache, once; offline, nothing is asked of the Hub."""
    calls: list[tuple[str, str, Path, tuple[str, ...]]] = []

    def fake_file(repo_id: str, filename: str, *, cache_dir: Path) -> str:
        calls.append(("file", repo_id, cache_dir, (filename,)))
        return str(cached_model(cache_dir, repo_id, {filename: json.dumps(TINY)}) / filename)

    def fake_snapshot(repo_id: str, *, cache_dir: Path, allow_patterns: list[str]) -> str:
        calls.append(("snapshot", repo_id, cache_dir, tuple(allow_patterns)))
        snapshot = cache_dir / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abcd"
        (snapshot / "model.safetensors").write_text("weights")
        return str(snapshot)

    monkeypatch.setattr(hub, "hf_hub_download", fake_file)
    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot)
    with pytest.raises(InputError, match="not in the Hugging Face cache"):
        model_dir("acme/fetched")
    assert calls == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert load_model("acme/fetched").params == load_model("tiny-llama").params
    assert load_model("acme/fetched").params == load_model("tiny-llama").params  # from the cache now
    assert calls == [("file", "acme/fetched", cache, ("config.json",))]
    folder = model_dir("acme/fetched", weights=True)
    assert calls[1:] == [("snapshot", "acme/fetched", cache, RUN_FILES)]
    assert (folder / "model.safetensors").is_file() and model_dir("acme/fetched", weights=True) == folder
    assert len(calls) == 2
    assert "*.safetensors" not in RUN_FILES and "model-*.safetensors" in RUN_FILES  # not a repository's copies


def test_a_failed_download_is_one_line(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(repo_id: str, filename: str, *, cache_dir: Path) -> str:
        raise OSError("Name or service not known\n  (huggingface.co)")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "hf_hub_download", refuse)
    with pytest.raises(InputError) as info:
        load_model("acme/gone")
    assert str(info.value) == (f"acme/gone: cannot download it from the Hugging Face Hub into {cache} (OSError: "
                               "Name or service not known (huggingface.co))")
