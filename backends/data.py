"""Training data: JSONL or plain text, or the embedded synthetic addition task, packed into sequences.

Every source becomes a list of `Example(prompt, completion)` (a `text` record is a completion with
an empty prompt), tokenised by the model directory's own tokenizer (local files only) or, for models
without one, by `ByteTokenizer` (ids are UTF-8 bytes). Examples are concatenated, each followed by
the end-of-text token, and cut into windows of `seq_len + 1` tokens: the inputs are the first
`seq_len`, the labels the last `seq_len` (shifted, so position t predicts labels[t]), -100 where a
token carries no loss (prompts, padding). `Batches.step(k)` serves step k's microbatches; the same
arguments give the same batches in every process.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tinypipe.errors import InputError

from .hf import param_seed
from .layers import IGNORE_INDEX

JSONL_SUFFIXES = (".jsonl", ".ndjson")
ADDITION = "addition"  # the embedded default task's name
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
HELD_OUT_BUCKETS = 16  # 1 in 16 addition problems is kept out of training, for task_accuracy


class Tokenizer(Protocol):
    """What packing needs from a tokenizer."""

    bos_id: int | None  # put before each example when not None
    eos_id: int | None  # put after each example (with loss) when not None
    pad_id: int  # fills the last window; never has a loss

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Byte-level ids for the tiny models: 0..255 are UTF-8 bytes; 256 ends a text and 257 pads
    when the vocabulary has room for them (with 256 ids there is no end-of-text and 0 pads)."""

    def __init__(self, vocab_size: int = 256) -> None:
        if vocab_size < 256:
            raise InputError(f"a byte-level tokenizer needs a vocabulary of at least 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_id: int | None = None
        self.eos_id: int | None = 256 if vocab_size > 256 else None
        self.pad_id: int = 257 if vocab_size > 257 else 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local model directory, with BOS added only where its own
    encoding adds one."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise InputError(f"{directory}: cannot load the tokenizer ({exc})") from exc
        bos = self.tok.bos_token_id
        self.bos_id = bos if bos is not None and self.tok("a")["input_ids"][:1] == [bos] else None
        self.eos_id = self.tok.eos_token_id
        pad = self.tok.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))


def load_tokenizer(model_dir: str | Path | None, *, vocab_size: int) -> Tokenizer:
    """The model directory's own tokenizer when it has tokenizer files, else `ByteTokenizer(vocab_size)`."""
    if model_dir is not None and any((Path(model_dir) / m).is_file() for m in TOKENIZER_MARKERS):
        return HFTokenizer(Path(model_dir))
    return ByteTokenizer(vocab_size)


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


# --- batches per optimizer step ----------------------------------------------------------------------

class Batches:
    """Step k's microbatches: `microbatches` pairs (input_ids, labels), each [microbatch_size, seq_len].

    Step k, microbatch m, row r is sequence ((k * replicas + replica) * microbatches + m) *
    microbatch_size + r of the source, so data-parallel replicas read disjoint sequences and any
    step can be served again (after a resume) without replaying the ones before it.
    """

    def __init__(self, source: SequenceSource, *, microbatch_size: int, microbatches: int,
                 replica: int = 0, replicas: int = 1) -> None:
        if microbatch_size < 1 or microbatches < 1:
            raise InputError(f"microbatch_size and microbatches must be >= 1, got {microbatch_size}, "
                             f"{microbatches}")
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} outside 0..{replicas - 1}")
        self.source = source
        self.microbatch_size, self.microbatches = microbatch_size, microbatches
        self.replica, self.replicas = replica, replicas

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    def step(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        first = (k * self.replicas + self.replica) * self.microbatches * self.microbatch_size
        out = []
        for m in range(self.microbatches):
            rows = [self.source[first + m * self.microbatch_size + r] for r in range(self.microbatch_size)]
            out.append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
        return out

    def __iter__(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        k = 0
        while True:
            yield self.step(k)
            k += 1


def make_batches(data: str | Path | None, *, tokenizer: Tokenizer, seq_len: int, microbatch_size: int,
                 microbatches: int, seed: int, replica: int = 0, replicas: int = 1,
                 task: AdditionTask | None = None) -> Batches:
    """Batches from a data file, or from the addition task when `data` is None or "addition"."""
    if seq_len < 1:
        raise InputError(f"seq_len must be >= 1, got {seq_len}")
    source: SequenceSource
    if data is None or (str(data) == ADDITION and not Path(ADDITION).exists()):
        source = AdditionSequences(task or AdditionTask(seed=seed), tokenizer, seq_len)
    else:
        inputs, labels = pack(read_examples(data), tokenizer, seq_len)
        source = PackedSequences(inputs, labels, seed=seed)
    return Batches(source, microbatch_size=microbatch_size, microbatches=microbatches,
                   replica=replica, replicas=replicas)


# --- evaluation ----------------------------------------------------------------------------------------

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
