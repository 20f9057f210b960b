"""Tokenizers for training data: the model directory's own (local files only), else byte-level ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tinypipe.common.errors import InputError

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


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
