"""Attention per document without an [s, s] mask (`doc_attention`): FlexAttention's tiles against the rule they
stand for, the flex path's outputs against the other paths, where the mask path stays, and that a block's
forward and backward over a packed 4,096-token window create no tensor of s x s elements."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import TINY_QWEN3  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tinypipe.backends.model import doc_attention  # noqa: E402
from tinypipe.backends.model.doc_attention import document_runs, tile_classes  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.model.layers import Block, LayerStack  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


def rule(runs: torch.Tensor, window: int | None) -> torch.Tensor:
    """[b, s, s]: query q may attend to key k (the [s, s] mask the paths here never build)."""
    s = runs.shape[1]
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (k <= q) & (runs[:, :, None] == runs[:, None, :])
    return allowed & (q - k < window) if window is not None else allowed


def tiles(allowed: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of `allowed` [b, s, s]: some pair may attend, every pair (of the positions that exist) may."""
    b, s, _ = allowed.shape
    n = -(-s // tile)
    some, every = torch.zeros(b, n, n, dtype=torch.bool), torch.zeros(b, n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            cell = allowed[:, i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]
            some[:, i, j], every[:, i, j] = cell.flatten(1).any(1), cell.flatten(1).all(1)
    return some, every


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=6), min_size=1, max_size=3),
       tile=st.sampled_from([4, 8, 16]), window=st.one_of(st.none(), st.integers(1, 40)))
def test_tiles_are_what_the_rule_says(lengths: list[list[int]], tile: int, window: int | None) -> None:
    """Rows of documents of any lengths, cut to one window length: a tile is listed (partial or full) iff some
    pair in it may attend, and full only if every pair may; with the length a multiple of the tile, full iff
    every pair may (a last, shorter tile may be listed partial though full)."""
    s = max(sum(row) for row in lengths)
    docs = torch.tensor([sum(([d] * n for d, n in enumerate(row)), [])[:s] + [-1] * (s - sum(row)) for row in lengths])
    partial, full = tile_classes(document_runs(docs), window=window, tile=tile)
    some, every = tiles(rule(document_runs(docs), window), tile)
    assert not (partial & full).any()
    assert torch.equal(partial | full, some)
    assert not (full & ~every).any()
    if s % tile == 0:
        assert torch.equal(full, every)


def test_runs_split_at_every_change_of_document() -> None:
    docs = torch.tensor([[3, 3, 0, 0, 0, -1, -1], [7, 7, 7, 7, 7, 7, 7], [1, 2, 1, 1, 2, 2, 2]])
    assert document_runs(docs).tolist() == [[0, 0, 1, 1, 1, 2, 2], [0] * 7, [0, 1, 2, 2, 3, 3, 3]]


# Qwen3 whose first and last layers attend within 70 positions: documents longer than that, windows across tiles
QWEN3_WINDOWED = {**TINY_QWEN3, "use_sliding_window": True, "sliding_window": 70,
                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


def logits(stack: LayerStack, ids: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    hidden = stack.layers[0](ids)
    for block in stack.layers[1:-1]:
        hidden = block(hidden, documents)
    out: torch.Tensor = stack.layers[-1].logits(hidden)
    return out


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor's CPU kernels need a C++ compiler")
def test_flex_path_equals_the_segments_and_the_mask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flex path (forced on the CPU, compiled as on CUDA; forward only: FlexAttention has no CPU backward) gives
    the logits of the segments path and of the [s, s] mask path (eager attention, which is not routed), over two
    300-token rows: documents inside one 128-token tile, across tiles, and a row of one document; through a
    Qwen3 with a windowed layer and a full one."""
    path = tmp_path / "qwen3-windowed.json"
    path.write_text(json.dumps(QWEN3_WINDOWED))
    name = str(path)
    routed, masked = build_model(name, seed=0), build_model(name, seed=0, attn_implementation="eager")
    assert {b.attention_path(CPU) for b in masked.layers[1:-1] if isinstance(b, Block)} == {"mask"}
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 20 + [1] * 150 + [2] * 100 + [-1] * 30, [4] * 300])
    with torch.no_grad():
        segments, mask = logits(routed, ids, docs), logits(masked, ids, docs)
        monkeypatch.setattr(doc_attention, "FUSED_FLEX_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(doc_attention, "_compiled_flex", None)
        for block in routed.layers[1:-1]:
            assert isinstance(block, Block)
            block.packed_attention = "flex"
        flex = logits(routed, ids, docs)
    torch.testing.assert_close(segments, mask, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(flex, segments, rtol=1e-4, atol=1e-5)


def test_the_mask_path_stays_where_attention_cannot_be_routed(tmp_path: Path) -> None:
    """Eager attention (not in transformers' registry) and attention dropout (which neither path applies) keep
    the [s, s] mask; SDPA without dropout is routed, and the model's own config keeps its implementation."""
    path = tmp_path / "dropout.json"
    path.write_text(json.dumps({**TINY_QWEN3, "attention_dropout": 0.1}))
    for stack, want in ((build_model("tiny-llama", seed=0), "segments"),
                        (build_model("tiny-llama", seed=0, attn_implementation="eager"), "mask"),
                        (build_model(str(path), seed=0), "mask")):
        assert {b.attention_path(CPU) for b in stack.layers[1:-1] if isinstance(b, Block)} == {want}
        assert stack.config._attn_implementation in ("sdpa", "eager")


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any op's output."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_a_packed_block_creates_no_tensor_of_s_by_s_elements() -> None:
    """One block's forward and backward over a 4,096-token window of three documents, on the segments path:
    no op's output has s x s elements or more (the largest is s x the MLP's width); the same block on the
    mask path creates one (so the check can fail)."""
    s = 4096
    block = build_model("tiny-llama", seed=0).layers[1]
    assert isinstance(block, Block) and block.attention_path(CPU) == "segments"
    docs = torch.tensor([[0] * 1000 + [1] * 3000 + [2] * 96])
    hidden = torch.randn(1, s, 64)

    def largest() -> int:
        x = hidden.clone().requires_grad_()
        with LargestTensor() as seen:
            block(x, docs).square().sum().backward()
        return seen.largest

    assert largest() < s * s // 16
    block.packed_attention = "mask"
    assert largest() >= s * s
