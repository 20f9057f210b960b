"""Compiled decoder blocks (`tinypipe run --compile`): one `torch.compile`d function per block structure.

A run calls each layer as `functional_call(module, weights, args)` with the weights its LOAD put on
the device, so every call of a block brings new weight tensors. Compiling each `Block` module would
make one graph per layer (and past dynamo's cache limit fall back to eager); here one *template*
block per structure (its class, decoder-layer class, attention implementation and sliding window)
is compiled as a function of (weights, input), and every block of that structure calls it. The
weights are graph inputs, so a new version or another layer reuses the graph; what fuses is the
block's elementwise work (norms, rotary, the gated MLP's activation), which eager runs as separate
memory-bound kernels. The embedding and the head stay eager (a lookup; the head's chunked loss is
already its own autograd function), and so do MoE blocks (their routers' hooks, `moe.watch`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from . import moe
from .layers import Block

# "inductor" on a GPU; the tests pass "aot_eager", which traces the same graphs without generating code
COMPILE_BACKEND = "inductor"


def _structure(module: Block) -> Hashable:
    return (type(module.layer), module.attn_implementation, module.sliding_window)


def _apply(template: nn.Module, weights: dict[str, torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
    out: torch.Tensor = torch.func.functional_call(template, weights, args)
    return out


class LayerCaller:
    """`caller(module, weights, args)` = `functional_call(module, weights, args)`, blocks compiled when asked."""

    def __init__(self, *, compile_blocks: bool = False, backend: str = COMPILE_BACKEND) -> None:
        self.compile_blocks = compile_blocks
        self.backend = backend
        self._compiled: dict[Hashable, Callable[..., torch.Tensor]] = {}

    def __call__(self, module: nn.Module, weights: dict[str, torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
        # a MoE block runs eager: its routers hand their logits out through forward hooks (moe.py)
        if not (self.compile_blocks and isinstance(module, Block)) or moe.routers(module):
            return _apply(module, weights, args)
        key = _structure(module)
        fn = self._compiled.get(key)
        if fn is None:
            module.rotary_on(args[0].device)  # made before tracing: the template's first call would graph-break on it
            template = module

            def block(weights: dict[str, torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
                return _apply(template, weights, args)

            fn = self._compiled[key] = torch.compile(block, backend=self.backend, dynamic=False)
        return fn(weights, args)

    @property
    def graphs(self) -> int:
        """Compiled functions made so far (one per block structure)."""
        return len(self._compiled)
