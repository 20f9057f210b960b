"""The embedded default task: `a+b=c` lines generated from a seed, and its held-out accuracy."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tinypipe.errors import InputError

from ..hf import param_seed
from .examples import Example, tokenize, window
from .tokenizers import ByteTokenizer, Tokenizer

ADDITION = "addition"  # the embedded default task's name
HELD_OUT_BUCKETS = 16  # 1 in 16 addition problems is kept out of training, for task_accuracy


@dataclass(frozen=True)
class AdditionTask:
    """The embedded default task: `a+b=c` lines, operands of 1..`digits` digits (each digit count
    equally likely), loss on the answers `c\\n` (or on everything with `loss_on="all"`).

    Problems are split by a hash of (a, b): one in `HELD_OUT_BUCKETS` is never trained on and is
    what `task_accuracy` asks.
    """

    seed: int = 0
    digits: int = 2
    loss_on: str = "answer"  # "answer" | "all"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise InputError(f"addition task: digits must be >= 1, got {self.digits}")
        if self.loss_on not in ("answer", "all"):
            raise InputError(f"addition task: loss_on must be 'answer' or 'all', got {self.loss_on!r}")

    def _operand(self, rng: random.Random) -> int:
        n = rng.randint(1, self.digits)
        return rng.randrange(0 if n == 1 else 10 ** (n - 1), 10**n)

    def problems(self, rng: random.Random, *, held_out: bool) -> Iterator[tuple[int, int]]:
        """An endless stream of (a, b) from the training or the held-out part."""
        while True:
            a, b = self._operand(rng), self._operand(rng)
            if is_held_out(a, b) == held_out:
                yield a, b

    def example(self, a: int, b: int) -> Example:
        prompt, answer = f"{a}+{b}=", f"{a + b}\n"
        return Example(prompt, answer) if self.loss_on == "answer" else Example("", prompt + answer)

    def held_out(self, n: int) -> list[tuple[int, int]]:
        """The first n held-out problems for this seed."""
        stream = self.problems(random.Random(param_seed(self.seed, "addition/held-out")), held_out=True)
        return [next(stream) for _ in range(n)]


def is_held_out(a: int, b: int) -> bool:
    return zlib.crc32(f"{a}+{b}".encode()) % HELD_OUT_BUCKETS == 0


class AdditionSequences:
    """Sequence j: training problems drawn from a generator seeded by (seed, j), packed from
    position 0 up to `seq_len + 1` tokens (the last problem is cut where the window ends)."""

    def __init__(self, task: AdditionTask, tokenizer: Tokenizer, seq_len: int) -> None:
        self.task, self.tokenizer, self.seq_len = task, tokenizer, seq_len

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = self.task.problems(random.Random(param_seed(self.task.seed, f"addition/{j}")), held_out=False)
        ids: list[int] = []
        loss: list[bool] = []
        while len(ids) < self.seq_len + 1:
            t, m = tokenize(self.task.example(*next(stream)), self.tokenizer, eos=False)
            ids += t
            loss += m
        inputs, labels = window(ids, loss, self.seq_len, self.tokenizer.pad_id)
        return torch.tensor(inputs, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


@torch.no_grad()
def task_accuracy(logits_fn: Callable[[torch.Tensor], torch.Tensor], *, n: int = 200,
                  task: AdditionTask | None = None, tokenizer: Tokenizer | None = None) -> float:
    """Exact-match fraction of greedy-decoded answers to `n` held-out addition problems.

    `logits_fn(input_ids [b, s]) -> logits [b, s, vocab]` (e.g. `LayerStack.logits`). Prompts of
    equal length are decoded together, without a cache, for `digits + 2` tokens.
    """
    task = task or AdditionTask()
    tokenizer = tokenizer or ByteTokenizer()
    problems = task.held_out(n)
    groups: dict[int, list[tuple[list[int], int]]] = {}
    for a, b in problems:
        prompt = tokenize(Example("", f"{a}+{b}="), tokenizer, eos=False)[0]
        groups.setdefault(len(prompt), []).append((prompt, a + b))
    correct = 0
    for items in groups.values():
        ids = torch.tensor([p for p, _ in items], dtype=torch.long)
        start = ids.shape[1]
        for _ in range(task.digits + 2):
            next_ids = logits_fn(ids)[:, -1].argmax(-1)
            ids = torch.cat([ids, next_ids[:, None].to(ids.device)], dim=1)
        for row, (_, answer) in zip(ids[:, start:].tolist(), items):
            correct += tokenizer.decode(row).split("\n")[0] == str(answer)
    return correct / max(1, len(problems))
