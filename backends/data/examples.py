"""Examples tokenised and packed into fixed-length windows (or, without packing, one example a window).

Every source becomes a list of `formats.Example`s (a `text` record is a completion with an empty
prompt; a `messages` record is rendered by the tokenizer's chat template). Packed, examples are
concatenated, each followed by the end-of-text token, and cut into windows of `seq_len + 1` tokens:
the inputs are the first `seq_len`, the labels the last `seq_len` (shifted, so position t predicts
labels[t]), -100 where a token carries no loss (prompts, non-assistant turns, padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tinypipe.common.errors import InputError

from ..hf import param_seed
from ..layers import IGNORE_INDEX
from .formats import Example, read_examples
from .tokenizers import Tokenizer

__all__ = ["Example", "read_examples", "tokenize", "window", "pack", "SequenceSource", "PackedSequences"]


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
    """All examples concatenated and cut into windows: (input_ids, labels), each [n, seq_len].

    Window k holds tokens [k*seq_len, (k+1)*seq_len] (one token of overlap: the last label of a
    window is the first input of the next), so every token but the first is a label exactly once.
    Without `packing`, each example is a window of its own: its first `seq_len + 1` tokens (the rest
    cut off), padded without loss; an example left with no loss token is dropped.
    """
    ids: list[int] = []
    loss: list[bool] = []
    if not packing:
        rows = []
        for ex in examples:
            t, m = tokenize(ex, tokenizer, eos=eos)
            if len(t) >= 2 and any(m[1: seq_len + 1]):
                rows.append(window(t, m, seq_len, tokenizer.pad_id))
        if not rows:
            raise InputError(f"no example keeps a loss token within its first {seq_len + 1} tokens: nothing to "
                             "train on (raise --seq-len, or pack the examples)")
        inputs, labels = zip(*rows)
        return torch.tensor(inputs, dtype=torch.long), torch.tensor(labels, dtype=torch.long)
    for ex in examples:
        t, m = tokenize(ex, tokenizer, eos=eos)
        ids += t
        loss += m
    if len(ids) < 2:
        raise InputError("the data has fewer than two tokens: nothing to train on")
    rows = [window(ids[k: k + seq_len + 1], loss[k: k + seq_len + 1], seq_len, tokenizer.pad_id)
            for k in range(0, len(ids) - 1, seq_len)]
    inputs, labels = zip(*rows)
    return torch.tensor(inputs, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


# --- sources of sequences -----------------------------------------------------------------------

class SequenceSource(Protocol):
    """Sequence j of an endless stream: (input_ids, labels), each a LongTensor [seq_len]."""

    seq_len: int

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PackedSequences:
    """A fixed set of packed windows, served in a fresh seeded order every epoch."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, *, seed: int) -> None:
        self.inputs, self.labels, self.seed = inputs, labels, seed
        self.seq_len = inputs.shape[1]
        self._order: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, r = divmod(j, len(self))
        if epoch not in self._order:
            g = torch.Generator().manual_seed(param_seed(self.seed, f"data/epoch/{epoch}"))
            self._order = {epoch: torch.randperm(len(self), generator=g)}
        i = int(self._order[epoch][r])
        return self.inputs[i], self.labels[i]
