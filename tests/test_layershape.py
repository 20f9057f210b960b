"""Profiles match models by the layers they measured (each kind's shape), not by the model's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.layershape import borrowed_from, model_shapes, same_layers
from tinypipe.describe.trace import ProfileTrace, find_trace, load_trace, trace_for

ROOT = Path(__file__).resolve().parent.parent
H200 = load_hardware("h200x1").gpus[0]


def _config(tmp_path: Path, name: str, **change: object) -> str:
    cfg = json.loads((ROOT / "traces" / "models" / "llama-3.1-8b.json").read_text())
    cfg.update(change)
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_a_local_12_layer_8b_takes_the_shipped_8b_profile(tmp_path: Path) -> None:
    """A config.json with num_hidden_layers=12 and another name has the 8B's embed, block and head: the
    shipped measured 8B trace (not an analytic one) is its trace, at each profiled microbatch size."""
    model = load_model(_config(tmp_path, "my-8b-12", num_hidden_layers=12))
    assert model.name == "my-8b-12" and model.num_blocks == 12
    for mbs in (1, 4):
        t = trace_for(model, H200, mbs, 2048, "bf16")
        assert not t.analytic and t.model == "llama-3.1-8b" and t.microbatch_size == mbs


def test_simulate_says_whose_profile_a_local_model_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`simulate` of a local 12-layer 8B directory says its measured trace is the 8B's, taken for its layer shapes
    (`run`'s summary says it with the same words); the 8B itself, or an analytic trace, says nothing of the kind."""
    from tinypipe.cli import main

    local = _config(tmp_path, "my-8b-12", num_hidden_layers=12)
    argv = ["simulate", "--hardware", "h200x1", "--policy", "tinypipe", "--seq-len", "2048", "--microbatch-size", "4",
            "--microbatches", "2", "--iterations", "1", "--workers", "1", "--model"]
    assert main([*argv, local]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("trace for"))
    assert line.startswith("trace for microbatch size 4: measured on llama-3.1-8b, whose layer shapes my-8b-12 has (")
    assert main([*argv, "llama-3.1-8b"]) == 0
    assert "trace for microbatch size 4: measured (" in capsys.readouterr().out
    assert borrowed_from("", load_model(local)) == borrowed_from("Llama-3.1-8B", load_model("llama-3.1-8b")) == ""


def test_other_shapes_do_not_borrow_a_profile_by_name(tmp_path: Path) -> None:
    """A model that calls itself llama-3.1-8b but has other layers gets the analytic trace; so does one
    whose blocks differ while its embed and head match."""
    wider = load_model(_config(tmp_path, "llama-3.1-8b", intermediate_size=8192))
    assert wider.name == "llama-3.1-8b"
    assert trace_for(wider, H200, 4, 2048, "bf16").analytic
    assert not same_layers("llama-3.1-8b", None, wider)


def test_a_trace_carries_its_layer_shapes_through_json(tmp_path: Path) -> None:
    """A trace written with `layers` (as `tinypipe profile` writes it) matches any model with those shapes,
    whatever either is called, and only those; malformed `layers` is an InputError naming the field."""
    tiny = load_model("tiny-llama")
    shipped = load_trace("h200-llama-3.1-8b-mb4-seq2048")
    mine = ProfileTrace.from_json({**shipped.to_json(), "model": "my-own", "layers": model_shapes(tiny)})
    assert ProfileTrace.from_json(mine.to_json()) == mine
    assert find_trace([mine], tiny, "H200", 4, 2048, "bf16") is mine
    assert find_trace([mine], load_model("llama-3.1-8b"), "H200", 4, 2048, "bf16") is None
    with pytest.raises(InputError, match="layers: expected"):
        ProfileTrace.from_json({**shipped.to_json(), "layers": {"block": {"params": 1}}}, where="t.json")


def test_model_shapes_are_one_per_kind() -> None:
    shapes = model_shapes(load_model("llama-3.1-8b"))
    assert shapes is not None and sorted(shapes) == ["block", "embed", "head"]
    assert shapes["block"]["params"] == 218_112_000
