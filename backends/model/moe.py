"""Mixture-of-experts blocks (Qwen3-MoE, Mixtral): their routers' logits, and transformers' load-balancing loss
split by layer, so that a pipeline, which runs the layers at different times, computes it exactly.

transformers' `load_balancing_loss_func` over the router logits of one forward call, with L MoE layers, E experts,
k experts a token and N tokens, is

    aux = E * sum_e F[e] * P[e],   F = (1/L) sum_l f_l,   P = (1/L) sum_l p_l
    f_l[e] = (tokens whose top k at layer l hold e) / N          (a count: no gradient)
    p_l[e] = the mean over the tokens of softmax(layer l's router logits)[e]

and `ForCausalLM` adds `router_aux_loss_coef` x aux to its loss. So a MoE block's forward records f_l and p_l
(`layer_stats`); their sums over the layers travel with the activations to the head, which adds the value
(`aux_value`) to the loss it reports; and each MoE block's backward adds the gradient of the loss through its
own p_l, coef E / L^2 x sum_l' f_l' (the sums' F row, complete by then: every forward of a microbatch runs
before its backward), by back-propagating `aux_term` beside its output (a recompute gives the same p_l).

A step's microbatches are separate forward calls, as in a plain loop over them: each has its own aux, and the
step's loss adds the mean of them, (coef / M) x aux per microbatch of M, beside the token cross-entropy summed
over the step and divided by its loss tokens (`layers.Head`). The experts' own compute is transformers'
(`config._experts_implementation`, as `from_config` sets it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

KEPT = "tinypipe_router_logits"  # the attribute a router's forward hook keeps its logits under
ROUTING = "tinypipe_routing"  # the attribute each layer of a MoE model carries its `Routing` under


@dataclass(frozen=True)
class Routing:
    """What the load-balancing loss needs of a MoE model: its experts, experts a token, the loss's coefficient
    (`router_aux_loss_coef`) and its MoE layers (Qwen3-MoE may make some layers dense)."""

    experts: int
    top_k: int
    coef: float
    layers: int


def routing(layers: list[nn.Module], config: Any) -> Routing | None:
    """The `Routing` of the model whose layers (every one) are `layers`; None for a dense model."""
    found = [router for layer in layers for router in routers(layer)]
    if not found:
        return None
    first: Any = found[0]  # transformers' TopKRouter: `num_experts`, `top_k`
    return Routing(experts=int(first.num_experts), top_k=int(first.top_k),
                   coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0), layers=len(found))


def mark(layers: list[nn.Module], r: Routing | None) -> None:
    """Give every layer of a model its `Routing` (`hf.split_meta` does), so that a rank finds it (`routing_of`)
    whichever layers it owns, and make each MoE block's routers keep their logits (`watch`)."""
    for layer in layers:
        setattr(layer, ROUTING, r)
        watch(layer)


def routing_of(layers: Sequence[nn.Module | None]) -> Routing | None:
    """The `Routing` that `mark` gave the layers (None: a dense model, or none marked)."""
    found: Routing | None = next((getattr(x, ROUTING, None) for x in layers if x is not None), None)
    return found


def routers(module: nn.Module) -> list[nn.Module]:
    """The routers of `module`'s MoE MLPs (a module with `experts` and a router `gate`), in module order."""
    out: list[nn.Module] = []
    for m in module.modules():
        gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
        if isinstance(gate, nn.Module) and isinstance(experts, nn.Module):
            out.append(gate)
    return out


def _keep(router: nn.Module, args: Any, output: Any) -> None:
    setattr(router, KEPT, output[0])  # transformers' routers return (logits, top-k weights, top-k indices)


def watch(module: nn.Module) -> None:
    """Make every router of `module` keep the logits of its latest forward (`take_logits` hands them out)."""
    for router in routers(module):
        router.register_forward_hook(_keep)


def take_logits(module: nn.Module) -> list[torch.Tensor]:
    """The router logits [tokens, experts] of `module`'s latest forward, one per MoE MLP, each handed out once."""
    out: list[torch.Tensor] = []
    for router in routers(module):
        logits = router.__dict__.pop(KEPT, None)
        if logits is not None:
            out.append(logits)
    return out


def layer_stats(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(f_l, p_l), fp32 [experts], of one layer's router logits [tokens, experts], as `load_balancing_loss_func`
    computes them: the softmax in the logits' dtype, its top k counted per expert over the tokens (f_l, no
    gradient), its mean over the tokens in fp32 (p_l, with the logits' gradient)."""
    probs = torch.softmax(logits, dim=-1)
    experts = probs.shape[-1]
    with torch.no_grad():
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=experts).float()
    return counts / probs.shape[0], probs.float().mean(dim=0)


def aux_value(sums: torch.Tensor, r: Routing, microbatches: int) -> torch.Tensor:
    """A microbatch's share of the step's loss: coef / M x E x sum_e (F[e] / L)(P[e] / L), from `sums` [2,
    experts] (row 0: sum_l f_l, row 1: sum_l p_l, over all the model's MoE layers)."""
    return r.coef / microbatches * r.experts * (sums[0] / r.layers * sums[1] / r.layers).sum()


def aux_term(p: torch.Tensor, f_sum: torch.Tensor, r: Routing, microbatches: int) -> torch.Tensor:
    """A scalar whose gradient through one layer's p_l is the loss's: coef / M x E / L^2 x sum_e f_sum[e] p_l[e]
    (`f_sum`: sum_l f_l over all the MoE layers, constant)."""
    return r.coef / microbatches * r.experts / r.layers**2 * (f_sum.to(p.device) * p).sum()


def call_aux(logits: list[torch.Tensor], r: Routing, microbatches: int) -> torch.Tensor:
    """coef / M x aux of one forward call from its MoE layers' router logits (all L of them), with the gradient
    through each p_l: what a plain loop over a step's M microbatches adds to each one's loss."""
    sums = torch.stack([torch.stack(layer_stats(x, r.top_k)) for x in logits]).sum(dim=0)
    return aux_value(sums, r, microbatches)
