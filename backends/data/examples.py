"""Examples tokenised and packed into fixed-length windows (or, without packing, one example a window).

Every source becomes a list of `formats.Example`s (a `text` record is a completion with an empty
prompt; a `messages` record is rendered by the tokenizer's chat template). Packed, examples are
concatenated, each followed by the end-of-text token, and cut into windows of `seq_len + 1` tokens:
the inputs are the first `seq_len`, the labels the last `seq_len` (shifted, so position t predicts
labels[t]), -100 where a token carries no loss (prompts, non-assistant turns, padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tinypipe.common.errors import InputError

from ..model.hf import param_seed
from ..model.layers import IGNORE_INDEX
from .formats import Example, read_examples
from .tokenizers import Tokenizer

__all__ = ["Example", "read_examples", "tokenize", "window", "pack", "pack_documents", "pack_examples", "Packed",
           "SequenceSource", "PackedSequences"]


# --- packing ----------------------------------------------------------------------------------------

def tokenize(example: Example, tokenizer: Tokenizer, *, eos: bool = True) -> tuple[list[int], list[bool]]:
    """An example's tokens and, per token, whether it carries loss (as a label). A conversation is
    the tokenizer's chat template's rendering (which ends its turns itself: no end-of-text added)."""
    if example.messages is not None:
        return tokenizer.chat(example.messages)
    prompt = tokenizer.encode(example.prompt) if example.prompt else []
    completion = tokenizer.encode(example.completion)
    ids = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + prompt + completion
    loss = [False] * (len(ids) - len(completion)) + [True] * len(completion)
    if eos and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
        loss.append(True)
    return ids, loss


def window(ids: Sequence[int], loss: Sequence[bool], seq_len: int, pad_id: int) -> tuple[list[int], list[int]]:
    """Inputs and shifted labels of one window of up to `seq_len + 1` tokens, padded to `seq_len`."""
    ids, loss = list(ids[: seq_len + 1]), list(loss[: seq_len + 1])
    inputs = ids[:-1] + [pad_id] * (seq_len + 1 - len(ids))
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], loss[1:])]
    return inputs, labels + [IGNORE_INDEX] * (seq_len - len(labels))


def pack(examples: Sequence[Example], tokenizer: Tokenizer, seq_len: int, *,
         eos: bool = True, packing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """All examples concatenated and cut into windows: (input_ids, labels), each [n, seq_len]
    (`pack_documents` without the document ids)."""
    inputs, labels, _ = pack_documents(examples, tokenizer, seq_len, eos=eos, packing=packing)
    return inputs, labels


@dataclass(frozen=True)
class Packed:
    """Examples in windows (`pack_examples`), and what the windows lost of them."""

    inputs: torch.Tensor  # [n, seq_len] input ids
    labels: torch.Tensor  # [n, seq_len] next-token labels, IGNORE_INDEX where no loss
    documents: torch.Tensor  # [n, seq_len] the example each input position comes from (-1: padding)
    truncated: int = 0  # without packing: examples kept, cut at seq_len + 1 tokens
    dropped: int = 0  # without packing: examples left without a loss token, not trained on
    split: int = 0  # packed: examples that run on into the next window (each part attends only within its own)


def pack_documents(examples: Sequence[Example], tokenizer: Tokenizer, seq_len: int, *, eos: bool = True,
                   packing: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, documents) of `pack_examples`."""
    p = pack_examples(examples, tokenizer, seq_len, eos=eos, packing=packing)
    return p.inputs, p.labels, p.documents


def pack_examples(examples: Sequence[Example], tokenizer: Tokenizer, seq_len: int, *, eos: bool = True,
                  packing: bool = True) -> Packed:
    """All examples concatenated and cut into windows: input_ids, labels and documents, each [n, seq_len].

    Window k holds tokens [k*seq_len, (k+1)*seq_len] (one token of overlap: the last label of a
    window is the first input of the next), so every token but the first is a label exactly once.
    `documents` holds, per input position, the index of the example it comes from (-1 for padding),
    for the per-document attention mask (`layers.Block`). Without `packing`, each example is a
    window of its own: its first `seq_len + 1` tokens (the rest cut off), padded without loss; an
    example left with no loss token is dropped.
    """
    ids: list[int] = []
    loss: list[bool] = []
    doc: list[int] = []
    rows = []
    truncated = 0
    split: set[int] = set()  # the examples a window's end cuts
    if not packing:
        for n, ex in enumerate(examples):
            t, m = tokenize(ex, tokenizer, eos=eos)
            if len(t) >= 2 and any(m[1: seq_len + 1]):
                kept = min(len(t) - 1, seq_len)
                truncated += int(len(t) > seq_len + 1)
                rows.append((*window(t, m, seq_len, tokenizer.pad_id), [n] * kept + [-1] * (seq_len - kept)))
        if not rows:
            raise InputError(f"no example keeps a loss token within its first {seq_len + 1} tokens: nothing to "
                             "train on (raise --seq-len, or pack the examples)")
    else:
        for n, ex in enumerate(examples):
            t, m = tokenize(ex, tokenizer, eos=eos)
            ids += t
            loss += m
            doc += [n] * len(t)
        if len(ids) < 2:
            raise InputError("the data has fewer than two tokens: nothing to train on")
        for k in range(0, len(ids) - 1, seq_len):
            part = doc[k: k + seq_len]
            if k > 0 and doc[k] == doc[k - 1]:
                split.add(doc[k])
            rows.append((*window(ids[k: k + seq_len + 1], loss[k: k + seq_len + 1], seq_len, tokenizer.pad_id),
                         part + [-1] * (seq_len - len(part))))
    inputs, labels, docs = zip(*rows)
    return Packed(torch.tensor(inputs, dtype=torch.long), torch.tensor(labels, dtype=torch.long),
                  torch.tensor(docs, dtype=torch.long), truncated=truncated,
                  dropped=len(examples) - len(rows) if not packing else 0, split=len(split))


# --- sources of sequences -----------------------------------------------------------------------

class SequenceSource(Protocol):
    """Sequence j of an endless stream: (input_ids, labels), each a LongTensor [seq_len]."""

    seq_len: int

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PackedSequences:
    """A fixed set of packed windows, served in a fresh seeded order every epoch; with `documents`
    (`pack_documents`), each window's document ids for the attention mask (`documents_of`)."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, *, seed: int,
                 documents: torch.Tensor | None = None) -> None:
        self.inputs, self.labels, self.seed, self.documents = inputs, labels, seed, documents
        self.seq_len = inputs.shape[1]
        self._order: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def _index(self, j: int) -> int:
        epoch, r = divmod(j, len(self))
        if epoch not in self._order:
            g = torch.Generator().manual_seed(param_seed(self.seed, f"data/epoch/{epoch}"))
            self._order = {epoch: torch.randperm(len(self), generator=g)}
        return int(self._order[epoch][r])

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index(j)
        return self.inputs[i], self.labels[i]

    def documents_of(self, j: int) -> torch.Tensor | None:
        """Sequence j's document id per position (None without documents)."""
        return None if self.documents is None else self.documents[self._index(j)]
