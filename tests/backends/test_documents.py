"""Per-document attention in packed windows: a document never attends to another one in its window, and
its positions count from its own start, so a packed window computes what each document alone computes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import LLAMA, MBS, MBS_PER_STEP, OPTIM, SEQ, assert_same_training, compiled, job  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.examples import Example, pack_documents  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.model.layers import LayerStack, document_positions  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def logits(stack: LayerStack, ids: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    hidden = stack.layers[0](ids)
    for block in stack.layers[1:-1]:
        hidden = block(hidden) if documents is None else block(hidden, documents)
    return stack.layers[-1].logits(hidden)


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
