"""Examples from JSONL or plain-text files, tokenised and packed into fixed-length windows.

Every source becomes a list of `Example(prompt, completion)` (a `text` record is a completion with
an empty prompt). Examples are concatenated, each followed by the end-of-text token, and cut into
windows of `seq_len + 1` tokens: the inputs are the first `seq_len`, the labels the last `seq_len`
(shifted, so position t predicts labels[t]), -100 where a token carries no loss (prompts, padding).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tinypipe.common.errors import InputError

from ..hf import param_seed
from ..layers import IGNORE_INDEX
from .tokenizers import Tokenizer

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class Example:
    """One training example: the loss falls on `completion` only (a plain text has no prompt)."""

    prompt: str
    completion: str


# --- reading files --------------------------------------------------------------------------------

def read_examples(path: str | Path) -> list[Example]:
    """Examples from a JSONL file (`text`, or `prompt` + `completion`, per line) or a plain text
    file (one example, loss on all of it). Bad input raises InputError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such data file" + (" (it is a directory)" if p.is_dir() else ""))
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{p}:{line}: not UTF-8 text (byte {exc.start})") from exc
    if not text.strip():
        raise InputError(f"{p}: empty file: no training examples")
    if p.suffix.lower() not in JSONL_SUFFIXES:
        return [Example("", text)]
    examples = [_parse_record(line, p, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    return examples


def _parse_record(line: str, path: Path, n: int) -> Example:
    where = f"{path}:{n}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not a JSON object ({exc.msg} at column {exc.colno}); each line of a "
                         f"JSONL file is one {{\"text\": ...}} or {{\"prompt\": ..., \"completion\": ...}}"
                         ) from exc
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    has_text, has_pair = "text" in record, "prompt" in record or "completion" in record
    if has_text and has_pair:
        raise InputError(f"{where}: give either \"text\" or \"prompt\" and \"completion\", not both")
    if has_text:
        return Example("", _string(record, "text", where))
    if "prompt" in record and "completion" in record:
        return Example(_string(record, "prompt", where), _string(record, "completion", where))
    found = ", ".join(sorted(map(str, record))) or "none"
    raise InputError(f"{where}: needs a \"text\" field, or \"prompt\" and \"completion\" fields "
                     f"(found: {found})")


def _string(record: dict[str, Any], key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise InputError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value


# --- packing ----------------------------------------------------------------------------------------

def tokenize(example: Example, tokenizer: Tokenizer, *, eos: bool = True) -> tuple[list[int], list[bool]]:
    """An example's tokens and, per token, whether it carries loss (as a label)."""
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
         eos: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """All examples concatenated and cut into windows: (input_ids, labels), each [n, seq_len].

    Window k holds tokens [k*seq_len, (k+1)*seq_len] (one token of overlap: the last label of a
    window is the first input of the next), so every token but the first is a label exactly once.
    """
    ids: list[int] = []
    loss: list[bool] = []
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
