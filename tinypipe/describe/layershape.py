"""What a profile trace measured, layer by layer: each kind's shape, so traces match models by shape, not name.

A profile times one layer of each kind (embed, block, head). Its times hold for any model whose layers
of that kind have the same shape: the same parameters (owned and on the GPU), FLOPs per token and
activation bytes per token (`LayerSpec`). A 12-layer Llama-3.1-8B from a local config.json has the
8B's embed, blocks and head, so the shipped 8B traces describe it; a model of another name with other
shapes does not borrow them. A trace written by `tinypipe profile` carries its kinds' shapes (`layers`);
for an older one, its model name is read as a shipped model to recover them.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.describe.model import LayerSpec, ModelSpec

FIELDS = ("params", "gpu_params", "linear_flops_per_token", "attn_flops_per_token_per_ctx",
          "saved_act_bytes_per_token", "boundary_bytes_per_token")

Shapes = dict[str, dict[str, float]]  # kind -> FIELDS -> value


def layer_shape(layer: LayerSpec) -> dict[str, float]:
    return {f: float(getattr(layer, f)) for f in FIELDS}


def model_shapes(model: ModelSpec) -> Shapes | None:
    """Each kind's shape in `model`; None when two layers of one kind differ (no one trace describes them)."""
    out: Shapes = {}
    for layer in model.layers:
        shape = layer_shape(layer)
        if out.setdefault(layer.kind.value, shape) != shape:
            return None
    return out


@lru_cache(maxsize=32)
def _named_shapes(name: str) -> tuple[tuple[str, tuple[tuple[str, float], ...]], ...] | None:
    from tinypipe.describe.hfconfig import load_model, shipped_models

    if name.casefold() not in {n.casefold() for n in shipped_models()}:
        return None
    try:
        shapes = model_shapes(load_model(name.lower()))
    except InputError:
        return None
    return None if shapes is None else tuple((k, tuple(v.items())) for k, v in shapes.items())


def trace_shapes(model_name: str, layers: Shapes | None) -> Shapes | None:
    """A trace's kinds' shapes: those it carries, else those of the shipped model it names, else None."""
    if layers is not None:
        return layers
    named = _named_shapes(model_name) if model_name else None
    return None if named is None else {k: dict(v) for k, v in named}


def same_layers(model_name: str, layers: Shapes | None, model: ModelSpec) -> bool:
    """Whether a trace (of `model_name`, carrying `layers`) measured the layers `model` has: every kind of
    `model` has the trace's shape for it. A trace whose shapes are unknown matches by name."""
    have = trace_shapes(model_name, layers)
    if have is None:
        return model_name.casefold() == model.name.casefold()
    want = model_shapes(model)
    return want is not None and all(have.get(k) == v for k, v in want.items())


def shapes_from_json(obj: Any, where: str) -> Shapes | None:
    """A trace's `layers` field (None when absent); InputError naming it when malformed."""
    if obj is None:
        return None
    try:
        return {str(k): {f: float(v[f]) for f in FIELDS} for k, v in obj.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise InputError(f"{where}: layers: expected, per layer kind, an object with {', '.join(FIELDS)}") from None


def borrowed_from(trace_model: str, model: ModelSpec) -> str:
    """What `simulate` and `run` print after "measured" when a measured trace of another model describes `model` by
    its layer shapes (`same_layers`): ` on {trace_model}, whose layer shapes {model} has`; "" for its own trace."""
    if not trace_model or trace_model.casefold() == model.name.casefold():
        return ""
    return f" on {trace_model}, whose layer shapes {model.name} has"
