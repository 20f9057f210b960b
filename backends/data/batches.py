"""Step k's microbatches from a source of sequences: a packed file or the addition task.

`Batches.step(k)` serves step k's microbatches; the same arguments give the same batches in every
process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from tinypipe.common.errors import InputError

from ..model.layers import IGNORE_INDEX
from .addition import ADDITION, AdditionSequences, AdditionTask
from .examples import PackedSequences, SequenceSource, pack_examples
from .formats import read_source
from .summary import DataSummary
from .tokenizers import Tokenizer, describe


class Batches:
    """Step k's microbatches: `microbatches` pairs (input_ids, labels), each [microbatch_size, seq_len].

    Step k, microbatch m, row r is sequence ((k * replicas + replica) * microbatches + m) *
    microbatch_size + r of the source, so data-parallel replicas read disjoint sequences and any
    step can be served again (after a resume) without replaying the ones before it. `summary`: what was
    read from a data file (None for the addition task).
    """

    def __init__(self, source: SequenceSource, *, microbatch_size: int, microbatches: int,
                 replica: int = 0, replicas: int = 1, summary: DataSummary | None = None) -> None:
        if microbatch_size < 1 or microbatches < 1:
            raise InputError(f"microbatch_size and microbatches must be >= 1, got {microbatch_size}, "
                             f"{microbatches}")
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} outside 0..{replicas - 1}")
        self.source = source
        self.microbatch_size, self.microbatches = microbatch_size, microbatches
        self.replica, self.replicas = replica, replicas
        self.summary = summary

    def lines(self) -> tuple[str, ...]:
        """What a run prints about its data at the start (`DataSummary.lines`; none for the addition task)."""
        return () if self.summary is None else self.summary.lines()

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    def _first(self, k: int) -> int:
        return (k * self.replicas + self.replica) * self.microbatches * self.microbatch_size

    def step(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        first = self._first(k)
        out = []
        for m in range(self.microbatches):
            rows = [self.source[first + m * self.microbatch_size + r] for r in range(self.microbatch_size)]
            out.append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
        return out

    def documents(self, k: int) -> list[torch.Tensor] | None:
        """Step k's document ids per microbatch ([microbatch_size, seq_len] each), for the per-document
        attention mask; None when the source has none (the addition task, or masking off)."""
        of = getattr(self.source, "documents_of", None)
        if of is None or of(0) is None:
            return None
        first = self._first(k)
        return [torch.stack([of(first + m * self.microbatch_size + r) for r in range(self.microbatch_size)])
                for m in range(self.microbatches)]

    def __iter__(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        k = 0
        while True:
            yield self.step(k)
            k += 1


def make_batches(data: str | Path | None, *, tokenizer: Tokenizer, seq_len: int, microbatch_size: int,
                 microbatches: int, seed: int, replica: int = 0, replicas: int = 1,
                 task: AdditionTask | None = None, packing: bool = True, document_mask: bool = True,
                 hold_out: float = 0.0, part: str = "train", split: str | None = None,
                 config: str | None = None) -> Batches:
    """Batches from a data file or a Hugging Face dataset id (`split` and `config` of it: `formats.read_source`),
    or from the addition task when `data` is None or "addition".
    `document_mask`: a file's windows carry their document ids (`Batches.documents`). `hold_out`: the
    share of a file's windows (the last ones, at least one) kept for evaluation: `part` "train" serves
    the others, "eval" those."""
    if seq_len < 1:
        raise InputError(f"seq_len must be >= 1, got {seq_len}")
    source: SequenceSource
    summary = None
    if data is None or (str(data) == ADDITION and not Path(ADDITION).exists()):
        source = AdditionSequences(task or AdditionTask(seed=seed), tokenizer, seq_len)
    else:
        read = read_source(data, split=split, config=config)
        packed = pack_examples(read.examples, tokenizer, seq_len, packing=packing)
        inputs, labels, docs = packed.inputs, packed.labels, packed.documents
        held = 0
        if hold_out:
            n = len(inputs)
            k = min(n - 1, max(1, math.ceil(hold_out * n)))
            if k < 1:
                raise InputError(f"{data}: {n} sequence(s): too few to hold any out for evaluation")
            cut = slice(n - k, n) if part == "eval" else slice(0, n - k)
            inputs, labels, docs = inputs[cut], labels[cut], docs[cut]
            held = k if part == "train" else 0
        source = PackedSequences(inputs, labels, seed=seed, documents=docs if document_mask else None)
        summary = DataSummary(path=str(data), format=read.format, examples=len(read.examples), windows=len(inputs),
                              held_out=held, seq_len=seq_len, loss_share=float((labels != IGNORE_INDEX).float().mean()),
                              tokens=describe(tokenizer), packing=packing, truncated=packed.truncated,
                              dropped=packed.dropped, split=packed.split)
    return Batches(source, microbatch_size=microbatch_size, microbatches=microbatches,
                   replica=replica, replicas=replicas, summary=summary)
