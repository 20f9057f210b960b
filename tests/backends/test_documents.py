"""Per-document attention in packed windows: a document never attends to another one in its window, and
its positions count from its own start, so a packed window computes what each document alone computes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import TINY_QWEN3  # noqa: E402
from test_interpreter import LLAMA, MBS, MBS_PER_STEP, OPTIM, SEQ, assert_same_training, compiled, job  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.examples import Example, pack_documents  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.model.layers import IGNORE_INDEX, Block, LayerStack, document_positions  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def logits(stack: LayerStack, ids: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    hidden = stack.layers[0](ids)
    for block in stack.layers[1:-1]:
        hidden = block(hidden) if documents is None else block(hidden, documents)
    return stack.layers[-1].logits(hidden)


def loss(stack: LayerStack, ids: torch.Tensor, labels: torch.Tensor, denom: float,
         documents: torch.Tensor | None) -> torch.Tensor:
    hidden = stack.layers[0](ids)
    for block in stack.layers[1:-1]:
        hidden = block(hidden) if documents is None else block(hidden, documents)
    out: torch.Tensor = stack.layers[-1](hidden, labels, denom)
    return out


# Qwen3 with a 5-position window on its first and last layers: documents longer than it attend in chunks
QWEN3_WINDOWED = {**TINY_QWEN3, "use_sliding_window": True, "sliding_window": 5,
                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


def model_name(family: str, tmp_path: Path) -> str:
    if family == "llama":
        return LLAMA
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(TINY_QWEN3 if family == "qwen3" else QWEN3_WINDOWED))
    return str(path)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-windowed"])
def test_packed_loss_and_gradients_are_the_documents_alone(family: str, tmp_path: Path) -> None:
    """Through the per-document path (`segments` on the CPU, no [s, s] mask), a packed window's loss and every
    parameter's gradient equal the sums of its documents' losses and gradients, each document run alone from
    position 0 with the labels it has in the window (the last one, cut by the window's end, too)."""
    stack = build_model(model_name(family, tmp_path), seed=0)
    blocks = [b for b in stack.layers[1:-1] if isinstance(b, Block)]
    assert [b.attention_path(torch.device("cpu")) for b in blocks] == ["segments"] * len(blocks)
    if family == "qwen3-windowed":
        assert [b.sliding_window for b in blocks] == [5, None, 5]
    texts = ["the first one", "hi", "a longer document of text", "and a last one cut off by the end"]
    inputs, labels, docs = pack_documents([Example("", t) for t in texts], ByteTokenizer(256), seq_len=48)
    inputs, labels, docs = inputs[:1], labels[:1], docs[:1]
    assert docs[0].unique().tolist() == [0, 1, 2, 3]
    denom = float((labels != IGNORE_INDEX).sum())
    params = [p for layer in stack.layers if layer is not None for p in layer.parameters()]

    packed = loss(stack, inputs, labels, denom, docs)
    packed_grads = torch.autograd.grad(packed, params)
    alone = torch.zeros(())
    alone_grads = [torch.zeros_like(p) for p in params]
    for d in docs[0].unique().tolist():
        where = (docs[0] == d).nonzero().flatten()
        one = loss(stack, inputs[:, where], labels[:, where], denom, None)
        alone = alone + one.detach()
        for acc, g in zip(alone_grads, torch.autograd.grad(one, params), strict=True):
            acc += g
    torch.testing.assert_close(packed.detach(), alone, rtol=1e-5, atol=1e-6)
    for p, a in zip(packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(p, a, rtol=1e-4, atol=1e-6)
    mixed = loss(stack, inputs, labels, denom, None)  # one causal sequence: the documents would see each other
    assert abs(float(mixed.detach()) - float(packed.detach())) > 1e-4


def test_positions_restart_at_each_document() -> None:
    docs = torch.tensor([[0, 0, 1, 1, 1, -1, -1], [4, 4, 4, 4, 4, 4, 4]])
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6]]


def test_one_document_per_window_changes_nothing() -> None:
    """A window that is one document (with or without padding after it) gives the logits of the plain
    causal model at every position of the document."""
    stack = build_model(LLAMA, seed=0)
    ids = torch.randint(0, 256, (2, 12))
    docs = torch.tensor([[0] * 12, [5] * 9 + [-1] * 3])
    with torch.no_grad():
        plain, masked = logits(stack, ids, None), logits(stack, ids, docs)
    torch.testing.assert_close(masked[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked[1, :9], plain[1, :9], rtol=1e-5, atol=1e-5)


def test_a_packed_window_computes_what_each_document_computes_alone() -> None:
    """Three documents packed into one window (the first cut short by the window's start): each position's
    logits equal those of its document run alone from position 0."""
    stack = build_model(LLAMA, seed=0)
    inputs, _, docs = pack_documents([Example("", "abc"), Example("", "hello there"), Example("", "xyz!")],
                                     ByteTokenizer(256), seq_len=32)
    assert inputs.shape == (1, 32) and docs[0, :17].tolist() == [0] * 3 + [1] * 11 + [2] * 3
    with torch.no_grad():
        packed = logits(stack, inputs, docs)
        for d in (0, 1, 2):
            where = (docs[0] == d).nonzero().flatten()
            alone = logits(stack, inputs[:, where], None)
            torch.testing.assert_close(packed[0, where], alone[0], rtol=1e-5, atol=1e-5)
        unmasked = logits(stack, inputs, None)
    assert not torch.allclose(unmasked[0, 3:14], packed[0, 3:14], atol=1e-3)  # without the mask, they would mix


def test_pipeline_with_document_masks_trains_like_the_reference(tmp_path: Path) -> None:
    """Four steps of packed text (several documents a window) through two ranks: the reference, given the
    same document ids, gives the same losses and weights."""
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(f'{{"text": "document {i} says {"ab" * (i % 5)}"}}\n' for i in range(40)))
    sched = compiled(LLAMA, PRESETS["tinypipe"].replace(optimizer="sync"), 2)
    results = run_threads(dataclasses.replace(job(LLAMA, sched, 4), data=str(f)), 2)
    batches = make_batches(f, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS,
                           microbatches=MBS_PER_STEP, seed=0)
    assert batches.documents(0) is not None and any(len(set(d.flatten().tolist())) > 2 for d in batches.documents(0))
    ref = reference_train(LLAMA, batches, steps=4, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                          weight_decay=OPTIM.weight_decay, seed=0, documents=batches.documents)
    assert_same_training(results, ref)
