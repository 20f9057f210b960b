"""Helpers for the pipeline-execution tests: fixed stand-in hardware, a tiny Qwen3 config, one thread."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tinypipe.describe.hardware import GPU, Hardware, Host, Link  # noqa: E402

# A small Qwen3 (untied embeddings, q/k norms), byte-level vocabulary, for the second model family.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "attention_bias": False, "initializer_range": 0.02,
}

# The same with its LM head tied to the token embedding (tie_word_embeddings, as Qwen3-1.7B).
TINY_QWEN3_TIED = {**TINY_QWEN3, "tie_word_embeddings": True}


def fixed_cpu_hardware(n: int) -> Hardware:
    """N stand-in devices with fixed (not measured) rates, so compiled schedules are reproducible."""
    mem = 64 * 2**30
    return Hardware(
        name=f"test-cpu-x{n}", provenance="spec", source="fixed numbers for tests",
        host=Host(memory_bytes=mem, dma_gbps=10.0, cpu_cores=2, adam_params_per_s=1e8),
        gpus=tuple(GPU(f"gpu{i}", "CPU", mem, 2e10, 10.0) for i in range(n)), switches=("rc0",),
        links=(Link("host", "rc0", "mem", 10.0, 0.0),)
        + tuple(Link("rc0", f"gpu{i}", "pcie", 10.0, 2e-6) for i in range(n)))


@pytest.fixture(scope="session")
def qwen3_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a tiny Qwen3 config.json (trained from a seeded random initialisation)."""
    path = Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3.json"
    path.write_text(json.dumps(TINY_QWEN3))
    return str(path)


@pytest.fixture(scope="session")
def tied_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a tiny tied-embedding Qwen3 config.json (seeded random initialisation)."""
    path = Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3-tied.json"
    path.write_text(json.dumps(TINY_QWEN3_TIED))
    return str(path)


@pytest.fixture
def one_thread() -> object:
    """Tiny tensors on a shared 2-core machine: one intra-op thread is fastest and steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def plan_run(args: argparse.Namespace, **kw: Any) -> Any:
    """`make_run_plan` of a parsed `tinypipe run` command line, its options settled at the CLI's edge
    (`cli.edge.run_options`) as the command settles them."""
    from tinypipe.backends.launch.prepare import make_run_plan
    from tinypipe.cli.edge import run_options

    return make_run_plan(run_options(args), **kw)


def parse_run(*argv: str, seq_len: int = 16) -> argparse.Namespace:
    """`tinypipe run`'s parsed options for a 2-step run of 4 sequences of `seq_len` tokens, plus `argv`."""
    from tinypipe.backends.options.run_flags import add_run_arguments

    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    return ap.parse_args(["--seq-len", str(seq_len), "--batch-tokens", str(seq_len * 4), "--steps", "2", *argv])
