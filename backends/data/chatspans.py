"""Where each assistant turn lies in a chat template's rendering of a whole conversation: the text its loss covers.

An assistant turn is the text the template adds for that message after the generation prompt (for ChatML: the
content and `<|im_end|>\\n`), as TRL's assistant-only loss marks it, as rendered in the whole conversation.
Most templates render a conversation prefix by prefix (each prefix's rendering starts the next), and the turn
is the rendering of the conversation up to it less that of the conversation before it with the generation
prompt. Some render an earlier turn otherwise once later messages follow: Qwen3's drops the thinking block
(`<think>...</think>`) of every assistant turn before the last user message, and gives the last turn one, empty
if it has none. There the turn is found in the whole rendering by a mark, a private-use code point pair with
the turn's number, put at the end of every assistant message's content before its trailing white space
(templates cut a turn's content at its start, as Qwen3's splits the thinking off, or strip white space, and keep
its end): the turn runs from the last generation prompt before its mark to the end of the text the template puts
after its content (what follows the mark when the turn is the last one), and the marks, taken out, must leave
the whole rendering as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tinypipe.common.errors import InputError

Render = Callable[[list[dict[str, str]], bool], str]  # (messages, add the generation prompt) -> text
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"  # Unicode private-use code points: no template or text means them


def assistant_spans(render: Render, messages: Sequence[tuple[str, str]],
                    where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendering of `messages` ((role, content) pairs) and, per assistant turn, its [start, end) characters
    in it; InputError naming `where` when a turn cannot be found."""
    msgs = [{"role": r, "content": c} for r, c in messages]
    full = render(msgs, False)
    spans: list[tuple[int, int]] = []
    marked: _Marked | None = None
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before, upto = render(msgs[:i], True), render(msgs[: i + 1], False)
        if upto.startswith(before) and full.startswith(upto):
            spans.append((len(before), len(upto)))
            continue
        marked = marked or _Marked(render, msgs, full, where)
        spans.append(marked.span(i))
    return full, spans


class _Marked:
    """The whole conversation rendered with every assistant turn's content marked, and the marks' places."""

    def __init__(self, render: Render, msgs: list[dict[str, str]], full: str, where: str) -> None:
        if any(MARK_OPEN in m["content"] or MARK_CLOSE in m["content"] for m in msgs):
            raise InputError(f"{where}: a message holds U+E000 or U+E001, which mark the turns for their loss")
        self.render, self.where = render, where
        self.msgs = [{**m, "content": _marked(m["content"], i)} if m["role"] == "assistant" else m
                     for i, m in enumerate(msgs)]
        self.text = render(self.msgs, False)
        marks = [(self.text.find(_mark(i)), i) for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if any(at < 0 for at, _ in marks) or sorted(marks) != marks or _unmark(self.text) != full:
            raise InputError(f"{where}: the chat template renders a turn differently once later messages follow, and "
                             "not only at its start, so the assistant turns cannot be told apart for their loss")
        self.at = {i: at for at, i in marks}

    def span(self, i: int) -> tuple[int, int]:
        """Turn i's [start, end) in the unmarked rendering."""
        mark = _mark(i)
        lo = max((at + len(_mark(j)) for j, at in self.at.items() if j < i), default=0)
        with_prompt, without = self.render(self.msgs[:i], True), self.render(self.msgs[:i], False)
        prompt = with_prompt[len(without):] if with_prompt.startswith(without) else ""
        alone = self.render(self.msgs[: i + 1], False)
        tail = alone[alone.find(mark) + len(mark):] if mark in alone else None
        at = self.at[i]
        start = self.text.rfind(prompt, lo, at) if prompt else -1
        end = at + len(mark) + len(tail or "")
        if start < 0 or tail is None or self.text[at + len(mark): end] != tail:
            raise InputError(f"{self.where}: the chat template renders assistant turn {i + 1} differently once later "
                             "messages follow, and its generation prompt or its ending is not found in the whole "
                             "conversation, so its tokens cannot be told apart for their loss")
        return self._plain(start + len(prompt)), self._plain(end)

    def _plain(self, k: int) -> int:
        """Index k of the marked text in the unmarked one (less the marks before it)."""
        return k - sum(len(_mark(i)) for i, at in self.at.items() if at < k)


def _mark(i: int) -> str:
    return f"{MARK_OPEN}{i}{MARK_CLOSE}"


def _marked(content: str, i: int) -> str:
    """`content` with turn i's mark before its trailing white space (which a template may strip)."""
    kept = content.rstrip()
    return kept + _mark(i) + content[len(kept):]


def _unmark(text: str) -> str:
    out, at = [], 0
    while (k := text.find(MARK_OPEN, at)) >= 0:
        close = text.find(MARK_CLOSE, k)
        out.append(text[at:k])
        at = close + 1 if close >= 0 else len(text)
    return "".join(out) + text[at:]
