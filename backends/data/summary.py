"""What a run read from its data file, in the two lines it prints at the start.

The format (told from the content), the examples, the training windows they became (and those held
out), the share of the windows' label positions that carry loss (prompts, non-assistant turns and
padding carry none), how the text was tokenised, and what the windows lost: without packing, the
examples cut at the window's length and those dropped without a loss token; packed, none is cut, and
the examples a window's end splits are counted (each part attends only within its own window).
"""

from __future__ import annotations

from dataclasses import dataclass

INDENT = " " * 10  # the summary's column: `data      `, then continuation lines


@dataclass(frozen=True, kw_only=True)
class DataSummary:
    """A data file as the run packed it (`batches.make_batches` fills it)."""

    path: str
    format: str  # formats.DataFile.format
    examples: int
    windows: int  # training windows (sequences) of `seq_len` tokens
    held_out: int  # windows held out for evaluation (--eval-fraction)
    seq_len: int
    loss_share: float  # of the training windows' label positions, those with loss
    tokens: str  # how the text was tokenised (tokenizers.describe)
    packing: bool
    truncated: int = 0  # examples.Packed
    dropped: int = 0
    split: int = 0

    def lines(self) -> tuple[str, str]:
        """`data ...`: file, format, examples, windows, loss share; then tokenisation and what was cut."""
        held = f" (+ {self.held_out:,} held out)" if self.held_out else ""
        first = (f"data      {self.path}: {self.format}, {self.examples:,} example{'s' if self.examples != 1 else ''} "
                 f"-> {self.windows:,} training window{'s' if self.windows != 1 else ''} of {self.seq_len} tokens"
                 f"{held}; {self.loss_share:.1%} of their tokens carry loss")
        if self.packing:
            cut = "packed: none truncated" + (f", {self.split:,} split across windows" if self.split else "")
        else:
            cut = (f"unpacked: {self.truncated:,} truncated at {self.seq_len + 1} tokens"
                   + (f", {self.dropped:,} dropped without a loss token" if self.dropped else ""))
        return first, f"{INDENT}tokenised as {self.tokens}; {cut}"
