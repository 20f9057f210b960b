"""Attention in packed windows without an [s, s] mask: FlexAttention block masks on CUDA, SDPA per document elsewhere.

A packed window holds several documents; each position attends to the earlier positions of its own document
(within the sliding window, where the layer has one). The mask path (`layers.document_mask`) states this as a
[b, 1, s, s] boolean tensor: 1 GiB at 32k tokens, and SDPA then leaves its flash kernel. Here the same rule runs
as one of two paths, chosen by `packed_path`:

- `flex` (CUDA): torch's FlexAttention with a `BlockMask` built from the documents' runs, 128 x 128 tiles at a
  time: a tile inside one document and the window is full, a tile no position of which may attend is skipped,
  the rest apply the rule per element. The tiles are classified from each tile's first and last run, so the
  [s, s] rule is never evaluated whole: (s / 128)^2 tiles per row. Compiled once per shape (`torch.compile`),
  forward and backward.
- `segments` (any device; the CPU's, where FlexAttention has no backward): one causal SDPA call per document
  run, which stays on SDPA's flash kernel; a document longer than the sliding window is attended in chunks
  of the window's length, each against the keys it can see, under a [w, 2w - 1] band.

`route` makes a decoder layer's attention module take a `DocumentAttention` as its `attention_mask`: it gets a
copy of the config whose attention implementation is a dispatcher registered with transformers'
`AttentionInterface`, which runs this module for a `DocumentAttention` and the configured implementation for
anything else. Where that cannot be done (transformers without `AttentionInterface`, below 4.48; `eager`
attention, which is not in the registry; attention dropout, which neither path applies), the block keeps
the mask path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PATHS = ("flex", "segments", "mask")  # how a packed window may attend (`layers.Block.attention_path`)
FLEX_TILE = 128  # FlexAttention's default block size: the BlockMask's tiles are FLEX_TILE x FLEX_TILE positions
ROUTED_PREFIX = "tinypipe_documents+"  # the dispatcher's name in transformers' AttentionInterface, + the base


@dataclass(frozen=True, eq=False)
class DocumentAttention:
    """A packed window's attention rule, passed to a routed decoder layer as its `attention_mask`.

    `runs` [b, s]: each position's document run in its row (0, 1, ... counted from the row's start; a change of
    document id starts a run, padding is a run of its own). `window`: the sliding window in positions, or None.
    """

    runs: torch.Tensor
    window: int | None
    path: str  # "flex" or "segments"

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
               scaling: float | None) -> torch.Tensor:
        """Attention output [b, hq, s, d] of `query` [b, hq, s, d] against `key`, `value` [b, hkv, s, d]."""
        if self.path == "flex":
            return _flex(query, key, value, flex_block_mask(self.runs, window=self.window), scaling)
        return _segments(query, key, value, self.runs, self.window, scaling)


def document_runs(documents: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, s] run index: 0 from each row's start, + 1 wherever the id changes."""
    starts = torch.zeros_like(documents, dtype=torch.long)
    starts[:, 1:] = (documents[:, 1:] != documents[:, :-1]).long()
    return starts.cumsum(dim=1)


def packed_path(device: torch.device) -> str:
    """The path a packed window takes on `device`: `flex` on CUDA where torch has FlexAttention, else `segments`."""
    return "flex" if device.type == "cuda" and _has_flex() else "segments"


def document_attention(documents: torch.Tensor, *, sliding_window: int | None,
                       path: str | None = None) -> DocumentAttention:
    """The attention rule of a window whose positions belong to `documents` [b, s] (ids, one run per document),
    to run on `path` (`flex` or `segments`; None: `packed_path`'s choice)."""
    chosen = packed_path(documents.device) if path is None else path
    if chosen not in ("flex", "segments"):
        raise ValueError(f"path {chosen!r}: a DocumentAttention runs on flex or segments")
    return DocumentAttention(runs=document_runs(documents), window=sliding_window, path=chosen)


# --- routing a decoder layer's attention ------------------------------------------------------------

def route(layer: nn.Module, attn_implementation: str) -> bool:
    """Make `layer`'s attention module take a `DocumentAttention` mask (see the module docstring); False
    where it cannot, and the layer is left as it was."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    except ImportError:  # transformers < 4.48: one attention class per implementation
        return False
    attention = getattr(layer, "self_attn", None)
    config = getattr(attention, "config", None)
    if not isinstance(attention, nn.Module) or config is None or attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        return False
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0:
        return False
    name = ROUTED_PREFIX + attn_implementation
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _dispatcher(attn_implementation))
    own = copy.copy(config)
    own._attn_implementation = name
    attention.config = own
    return True


def _dispatcher(base: str) -> Callable[..., tuple[torch.Tensor, None]]:
    """An attention function in transformers' interface: a `DocumentAttention` mask runs here, any other
    mask (a tensor or None) runs the `base` implementation."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kwargs: Any) -> Any:
        if isinstance(attention_mask, DocumentAttention):
            out = attention_mask.attend(query, key, value, scaling=kwargs.get("scaling"))
            return out.transpose(1, 2).contiguous(), None  # [b, s, h, d], as transformers' implementations return
        return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, **kwargs)

    return attend


# --- the segments path ------------------------------------------------------------------------------

def run_bounds(runs: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of `runs` [b, s], each run's [start, end) positions, in order."""
    s = runs.shape[1]
    bounds = []
    for row in runs:
        cuts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        edges = [0, *cuts, s]
        bounds.append(list(zip(edges[:-1], edges[1:], strict=True)))
    return bounds


def _segments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: torch.Tensor,
              window: int | None, scaling: float | None) -> torch.Tensor:
    gqa = key.shape[1] != query.shape[1]
    rows = []
    for r, bounds in enumerate(run_bounds(runs)):
        parts = [_one_document(query[r:r + 1, :, a:e], key[r:r + 1, :, a:e], value[r:r + 1, :, a:e], window,
                               scaling=scaling, gqa=gqa) for a, e in bounds]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def _one_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, *, scaling: float | None,
                  gqa: bool) -> torch.Tensor:
    """Causal attention within one document run (q, k, v [1, h, n, d]), under the sliding window if any."""
    n = q.shape[2]
    if window is None or n <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    chunks = []
    for c in range(0, n, window):  # queries [c, c + w) see keys [c - w + 1, c + w)
        e, k0 = min(c + window, n), max(0, c - window + 1)
        qpos = torch.arange(c, e, device=q.device)[:, None]
        kpos = torch.arange(k0, e, device=q.device)[None, :]
        band = (kpos <= qpos) & (qpos - kpos < window)
        chunks.append(F.scaled_dot_product_attention(q[:, :, c:e], k[:, :, k0:e], v[:, :, k0:e], attn_mask=band,
                                                     scale=scaling, enable_gqa=gqa))
    return torch.cat(chunks, dim=2)


# --- the flex path ----------------------------------------------------------------------------------

def _has_flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
    except ImportError:  # torch < 2.5
        return False
    return True


def tile_classes(runs: torch.Tensor, *, window: int | None, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `runs` [b, s], which tiles of the attention rule are partial and which full: two [b, n, n]
    boolean tensors, n = ceil(s / tile), indexed [row, query tile, key tile].

    Tile (i, j) holds queries [i t, (i + 1) t) and keys [j t, (j + 1) t). Runs only grow along a row, so a
    tile's runs are those from its first position's to its last's: some query may attend to some key of
    tile (i, j) iff j <= i, the key tile's last run is at least the query tile's first, and the closest
    pair is within the window; every pair may iff j < i, both tiles lie in one run, and the farthest pair
    is within the window. A tile that is neither holds no pair that may attend, and is skipped.
    """
    b, s = runs.shape
    n = -(-s // tile)
    padded = torch.cat([runs, runs[:, -1:].expand(b, n * tile - s)], dim=1).view(b, n, tile)  # last run repeats
    first, last = padded[:, :, 0], padded[:, :, -1]
    i = torch.arange(n, device=runs.device)[:, None]
    j = torch.arange(n, device=runs.device)[None, :]
    some = (j <= i) & (last[:, None, :] >= first[:, :, None])
    full = (j < i) & (first[:, None, :] == last[:, :, None])
    if window is not None:
        some = some & (i * tile - (j * tile + tile - 1) < window)
        full = full & ((i * tile + tile - 1) - j * tile < window)
    return some & ~full, full


def flex_block_mask(runs: torch.Tensor, *, window: int | None, tile: int = FLEX_TILE) -> Any:
    """The FlexAttention `BlockMask` of causal attention within each run of `runs` [b, s] (and `window`): its
    tiles from `tile_classes`, the rule itself (`mask_mod`) applied per element in the partial ones."""
    from torch.nn.attention.flex_attention import BlockMask

    s = runs.shape[1]
    partial, full = tile_classes(runs, window=window, tile=tile)

    def mask_mod(bi: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        ok = (kv <= q) & (runs[bi, q] == runs[bi, kv])
        return ok & (q - kv < window) if window is not None else ok

    counts, indices = _ordered(partial)
    full_counts, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(s, s))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, nq, nk] booleans -> per query tile the number of key tiles set and their indices first: [b, 1, nq],
    [b, 1, nq, nk] int32, as `BlockMask.from_kv_blocks` takes them."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


FUSED_FLEX_DEVICES = ("cuda",)  # where `_flex` compiles FlexAttention into its fused kernels (the CPU's: forward only)
_compiled_flex: Callable[..., torch.Tensor] | None = None


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
          scaling: float | None) -> torch.Tensor:
    """FlexAttention under `block_mask`: compiled (its fused kernels, which skip the empty tiles; once per shape)
    on `FUSED_FLEX_DEVICES`, called as it is inside an outer compiled graph and elsewhere (unfused)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn: Callable[..., Any] = flex_attention
    if query.device.type in FUSED_FLEX_DEVICES and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    out = fn(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    assert isinstance(out, torch.Tensor)
    return out
