"""The model every system builds: the shipped model's shapes with N decoder layers, written as one
config.json that transformers and tinypipe both read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peers.modelconfig import model_config, params_of, write_config
from tinypipe.common.errors import InputError
from tinypipe.describe.hfconfig import load_model

# Llama-3.1-8B: embedding and LM head 128256 x 4096 each, final norm 4096; a decoder layer: q and o
# 4096 x 4096, k and v 1024 x 4096, gate/up/down 3 x 4096 x 14336, two norms of 4096.
EMBED_HEAD_NORM = 2 * 128256 * 4096 + 4096
LAYER = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096


def test_llama_8b_shapes_with_12_layers(tmp_path: Path) -> None:
    """12 layers of Llama-3.1-8B: 3,668,017,152 parameters; the file keeps every shape but the layer
    count, drops the weights' dtype (each system casts) and tinypipe's own keys, turns the KV cache off,
    and lands in a folder named after the model (tinypipe finds its measured traces by that name)."""
    name, config = model_config("llama-3.1-8b", 12, 2048)
    directory = write_config(tmp_path, name, config)
    written = json.loads((directory / "config.json").read_text())
    assert directory == tmp_path / "llama-3.1-8b"
    assert written["num_hidden_layers"] == 12 and written["use_cache"] is False
    assert (written["hidden_size"], written["num_attention_heads"], written["num_key_value_heads"],
            written["intermediate_size"], written["vocab_size"]) == (4096, 32, 8, 14336, 128256)
    assert not [k for k in written if k.startswith("_") or k in ("torch_dtype", "dtype")]
    assert params_of(directory) == EMBED_HEAD_NORM + 12 * LAYER == 3_668_021_248
    assert load_model("llama-3.1-8b").params == EMBED_HEAD_NORM + 32 * LAYER  # the formula is the 8B's


def test_models_the_peers_cannot_run_are_refused(tmp_path: Path) -> None:
    """A family RoundPipe has no preset for, zero layers, or a sequence longer than the model's
    positions is an input error naming the option."""
    with pytest.raises(InputError, match="--model gpt2-xl: .* llama or qwen3 .* 'gpt2'"):
        model_config("gpt2-xl", 2, 1024)
    with pytest.raises(InputError, match="--layers: must be >= 1, got 0"):
        model_config("llama-3.1-8b", 0, 2048)
    with pytest.raises(InputError, match="--model tiny-llama: handles at most 2048 positions, --seq-len is 4096"):
        model_config("tiny-llama", 2, 4096)
