"""Tokenizers for training data: the model directory's own (local files only), or byte-level ids when asked
or when the model has no tokenizer files and a vocabulary of bytes (tinypipe's tiny models)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tinypipe.common.errors import InputError

from .chatspans import assistant_spans

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
BYTE_VOCAB_IDS = 258  # ByteTokenizer's ids at most: 256 bytes, end-of-text, padding


class Tokenizer(Protocol):
    """What packing needs from a tokenizer."""

    bos_id: int | None  # put before each example when not None
    eos_id: int | None  # put after each example (with loss) when not None
    pad_id: int  # fills the last window; never has a loss

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[tuple[str, str]]) -> tuple[list[int], list[bool]]:
        """A conversation's tokens through the chat template and, per token, whether it is an assistant's."""
        ...


class ByteTokenizer:
    """Byte-level ids for the tiny models: 0..255 are UTF-8 bytes; 256 ends a text and 257 pads
    when the vocabulary has room for them (with 256 ids there is no end-of-text and 0 pads)."""

    def __init__(self, vocab_size: int = 256, *, why: str = "") -> None:
        if vocab_size < 256:
            raise InputError(f"a byte-level tokenizer needs a vocabulary of at least 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.why = why  # why byte ids, for the run's account of its data (`describe`)
        self.bos_id: int | None = None
        self.eos_id: int | None = 256 if vocab_size > 256 else None
        self.pad_id: int = 257 if vocab_size > 257 else 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def chat(self, messages: Sequence[tuple[str, str]]) -> tuple[list[int], list[bool]]:
        raise InputError("\"messages\" data needs the model's tokenizer and its chat template; byte-level ids "
                         "have no chat template")


class HFTokenizer:
    """A Hugging Face tokenizer from a local model directory, with BOS added only where its own
    encoding adds one."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        self.directory = directory
        try:
            self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:  # corrupt or foreign tokenizer files raise many kinds of errors
            why = " ".join(str(exc).split())[:300]
            raise InputError(f"{directory}: cannot load the tokenizer ({type(exc).__name__}: {why})") from None
        bos = self.tok.bos_token_id
        self.bos_id = bos if bos is not None and self.tok("a")["input_ids"][:1] == [bos] else None
        self.eos_id = self.tok.eos_token_id
        pad = self.tok.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    def __len__(self) -> int:
        return len(self.tok)

    def chat(self, messages: Sequence[tuple[str, str]]) -> tuple[list[int], list[bool]]:
        """The chat template's rendering of `messages`, tokenised, with loss on the assistant turns as the
        template renders them in the whole conversation (`chatspans.assistant_spans`: for ChatML, each turn's
        content and `<|im_end|>\\n`; for Qwen3's, the last turn's thinking block too, and no earlier turn's,
        which the template drops)."""
        if not getattr(self.tok, "chat_template", None):
            raise InputError(f"{self.directory}: the tokenizer has no chat template, which \"messages\" data needs "
                             "(add chat_template to tokenizer_config.json, or give prompt/completion records)")
        full, spans = assistant_spans(self._render, messages, str(self.directory))
        if self.tok.is_fast:
            enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            loss = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
            return ids, loss
        ids, loss, at = [], [], 0
        for a, b in spans:  # a slow tokenizer: piece by piece
            for text, keep in ((full[at:a], False), (full[a:b], True)):
                t = self.encode(text) if text else []
                ids += t
                loss += [keep] * len(t)
            at = b
        tail = self.encode(full[at:]) if full[at:] else []
        return ids + tail, loss + [False] * len(tail)

    def _render(self, msgs: list[dict[str, str]], generation_prompt: bool) -> str:
        if not msgs:
            return ""
        try:
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # the template is user data: any error it raises is the template's
            raise InputError(f"{self.directory}: the chat template failed on a conversation ({exc})") from None
        return str(text)


def has_tokenizer(model_dir: str | Path | None) -> bool:
    return model_dir is not None and any((Path(model_dir) / m).is_file() for m in TOKENIZER_MARKERS)


def byte_level(vocab_size: int) -> bool:
    """A vocabulary with no more ids than `ByteTokenizer` uses (256 bytes and its two specials): its ids can
    only be bytes, so a model of it without tokenizer files trains on byte ids unasked."""
    return 256 <= vocab_size <= BYTE_VOCAB_IDS


def load_tokenizer(model_dir: str | Path | None, *, vocab_size: int, byte_tokens: bool = True) -> Tokenizer:
    """The model directory's own tokenizer when it has tokenizer files; else `ByteTokenizer(vocab_size)`
    if `byte_tokens` or the vocabulary is `byte_level`, else an InputError (a model of a larger vocabulary
    without a tokenizer trains on byte ids only when asked).
    InputError when the tokenizer's ids do not fit the model's vocabulary."""
    if has_tokenizer(model_dir):
        assert model_dir is not None
        tok = HFTokenizer(Path(model_dir))
        if len(tok) > vocab_size:
            raise InputError(f"{model_dir}: the tokenizer has {len(tok):,} tokens, more than the model's vocabulary "
                             f"of {vocab_size:,}")
        return tok
    if byte_level(vocab_size):
        return ByteTokenizer(vocab_size, why=f"no tokenizer files, a byte-level vocabulary of {vocab_size} ids")
    if not byte_tokens:
        where = "the model" if model_dir is None else str(model_dir)
        raise InputError(f"{where}: no tokenizer files ({', '.join(TOKENIZER_MARKERS)}) and a vocabulary of "
                         f"{vocab_size:,} ids; give a model directory with its tokenizer, or --byte-tokens to train "
                         "on UTF-8 byte ids")
    return ByteTokenizer(vocab_size, why="--byte-tokens")


def describe(tokenizer: Tokenizer) -> str:
    """How the data was tokenised, in words: the model's tokenizer and its size, or byte ids and why."""
    if isinstance(tokenizer, HFTokenizer):
        return f"the tokenizer of {tokenizer.directory} ({len(tokenizer):,} tokens)"
    why = getattr(tokenizer, "why", "")
    return "UTF-8 byte ids" + (f" ({why})" if why else "")
