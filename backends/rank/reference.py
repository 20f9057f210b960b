"""Plain single-process training of a LayerStack: what the pipeline's losses and weights must equal.

Same layers and initialisation (`hf.build_model`), same loss normalisation (the head divides by the
step's loss-token count), same optimizer (`layer_adamw`: one AdamW per layer, which is the same
mathematics as one AdamW over all parameters), same data (`data.Batches`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tinypipe.policy.modes import OptimizerState

from ..host.optim_rules import LRSchedule, decays
from ..host.torch_adamw import layer_adamw
from ..model.hf import build_model
from ..model.layers import IGNORE_INDEX, LayerStack
from ..model.moe import call_aux, routing_of, take_logits

Step = Sequence[tuple[torch.Tensor, torch.Tensor]]  # one optimizer step: (input_ids, labels) per microbatch


@dataclass(frozen=True)
class ReferenceResult:
    """Per-step losses (the mean token loss of each step) and the final weights, as
    {layer index: {parameter name in layer: tensor}} (`LayerStack.state()`'s form, cloned);
    `grad_norms`: per step, the global L2 norm of its gradients (`torch.nn.utils.get_total_norm`)."""

    losses: list[float]
    state: dict[int, dict[str, torch.Tensor]]
    grad_norms: list[float] = dataclasses.field(default_factory=list)


def reference_train(model: LayerStack | str, batches: Iterable[Step], *, steps: int, lr: float,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, seed: int = 0, dtype: torch.dtype = torch.float32,
                    async_staleness: int = 0, schedule: LRSchedule | None = None,
                    decay_exempt: bool = False,
                    documents: Callable[[int], list[torch.Tensor] | None] | None = None,
                    optimizer_state: OptimizerState = OptimizerState.FP32,
                    max_grad_norm: float | None = None) -> ReferenceResult:
    """Train `model` (a LayerStack holding every layer, or a name built with `seed`) for `steps`.

    Step t takes the next item of `batches` (a list of (input_ids, labels) microbatches), runs each
    microbatch's forward and backward through every layer, and divides every microbatch's summed
    token loss by the step's number of labels != -100; its loss is the sum over microbatches. A MoE model's
    microbatch adds its load-balancing loss, coef / M x aux (`moe.call_aux`), as a plain loop does.
    The stack's parameters are the fp32 masters; with `dtype` other than fp32, forward and backward
    run on a copy of the layers cast to `dtype`, refreshed from the masters after each update, and
    each microbatch's gradients are cast to fp32 and summed. The stack is trained in place.

    `async_staleness=0`: after step t's backward, every layer's AdamW applies step t's gradient,
    so step t computes with the weights after the updates of steps <= t-1.
    `async_staleness=1`: the gradient of step t is applied after step t+1's forward and backward,
    so step t computes with the weights after the updates of steps <= t-2 (steps 0 and 1 both use
    the initial weights); after the last step its pending gradient is applied too, so the final
    weights hold all `steps` updates, each applied to the weights one update newer than those it
    was computed on.

    `schedule`: step t's gradient is applied at `schedule.lr(t)` (None: `lr` throughout);
    `decay_exempt`: weight decay only where `optim_rules.decays` says. `documents(t)`: step t's document
    ids per microbatch for the blocks' per-document mask (e.g. `Batches.documents`). `max_grad_norm`:
    each step's gradients clipped by their global norm as `torch.nn.utils.clip_grad_norm_` does.
    """
    if async_staleness not in (0, 1):
        raise ValueError(f"async_staleness must be 0 or 1, got {async_staleness}")
    stack = build_model(model, seed=seed) if isinstance(model, str) else model
    masters = [_layer(stack, i) for i in range(len(stack.layers))]
    own = [[n for n, _ in stack.own_parameters(i)] for i in range(len(masters))]
    optimizers = [layer_adamw([m.get_parameter(n) for n in names], lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay, optimizer_state=optimizer_state,
                              decay=[decays(n, m.get_parameter(n).dim()) for n in names] if decay_exempt else None)
                  for m, names in zip(masters, own)]
    # one deepcopy of the list keeps a tied matrix shared between the working copies too
    workers = masters if dtype == torch.float32 else [w.to(dtype) for w in copy.deepcopy(masters)]
    losses: list[float] = []
    grad_norms: list[float] = []
    pending: list[list[torch.Tensor]] | None = None
    data = iter(batches)

    def apply(grads: list[list[torch.Tensor]], t: int) -> None:
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr if schedule is None else schedule.lr(t)
        _apply(masters, optimizers, grads, workers)

    for t in range(steps):
        step = next(data)
        loss, grads = _forward_backward(workers, own, step, tied=stack.tied,
                                        documents=None if documents is None else documents(t))
        losses.append(loss)
        grad_norms.append(float(torch.nn.utils.get_total_norm([g for layer in grads for g in layer])))
        if max_grad_norm is not None:  # torch.nn.utils.clip_grad_norm_'s coefficient, on every gradient
            coef = min(1.0, max_grad_norm / (grad_norms[-1] + 1e-6))
            for layer in grads:
                for g in layer:
                    g.mul_(coef)
        if async_staleness == 0:
            apply(grads, t)
        else:
            if pending is not None:
                apply(pending, t - 1)
            pending = grads
    if pending is not None:
        apply(pending, steps - 1)
    state = {i: {n: m.get_parameter(n).detach().clone() for n in names} for i, (m, names) in
             enumerate(zip(masters, own))}
    return ReferenceResult(losses=losses, state=state, grad_norms=grad_norms)


def _layer(stack: LayerStack, i: int) -> nn.Module:
    layer = stack.layers[i]
    if layer is None:
        raise ValueError(f"reference_train needs every layer; layer {i} is not materialised")
    return layer


def _forward_backward(workers: list[nn.Module], own: list[list[str]], step: Step, *,
                      tied: tuple[str, str] | None = None, documents: list[torch.Tensor] | None = None
                      ) -> tuple[float, list[list[torch.Tensor]]]:
    """One step's loss and fp32 gradients (per layer, in `own` order), summed over microbatches.

    Tied embeddings (`tied` = the matrix's name in the head, in the embedding): the head computes
    with the embedding's matrix; the gradients of its two uses are summed over the step's
    microbatches each, then added (embedding's + head's): the same sum as letting autograd add them
    per microbatch, in the order a pipeline that accumulates per layer adds them, so that pipeline
    training equals this bit for bit.
    """
    denom = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in step)
    if denom == 0:
        raise ValueError("a step without any loss token (every label is -100)")
    params = [[w.get_parameter(n) for n in names] for w, names in zip(workers, own)]
    grads = [[torch.zeros(p.shape, dtype=torch.float32) for p in ps] for ps in params]
    shared = workers[0].get_parameter(tied[1]) if tied is not None else None
    head_share = None if shared is None else torch.zeros(shared.shape, dtype=torch.float32)
    total = 0.0
    routed = routing_of(workers)  # a MoE model: each microbatch adds its load-balancing loss (model/moe.py)
    for m, (input_ids, labels) in enumerate(step):
        doc = () if documents is None else (documents[m],)
        for w in workers:
            w.zero_grad(set_to_none=True)
        hidden = workers[0](input_ids)
        logits: list[torch.Tensor] = []
        for w in workers[1:-1]:
            hidden = w(hidden, *doc)
            logits += take_logits(w)
        if shared is None or tied is None:
            loss = workers[-1](hidden, labels, denom)
            alias = None
        else:  # the head's use of the shared matrix through a leaf of its own (same values)
            alias = shared.detach().requires_grad_()
            loss = torch.func.functional_call(workers[-1], {tied[0]: alias}, (hidden, labels, denom),
                                              strict=False)
        if routed is not None and logits:
            loss = loss + call_aux(logits, routed, len(step))
        loss.backward()
        total += float(loss.detach())
        for acc, ps in zip(grads, params):
            for g, p in zip(acc, ps):
                if p.grad is not None:
                    g += p.grad.float()
        if head_share is not None and alias is not None and alias.grad is not None:
            head_share += alias.grad.float()
    if head_share is not None and tied is not None:
        grads[0][own[0].index(tied[1])] += head_share
    return total, grads


def _apply(masters: list[nn.Module], optimizers: list[torch.optim.Optimizer], grads: list[list[torch.Tensor]],
           workers: list[nn.Module]) -> None:
    """One AdamW update per layer with `grads`, then refresh the low-precision working copies."""
    for master, opt, acc, worker in zip(masters, optimizers, grads, workers):
        params = [p for group in opt.param_groups for p in group["params"]]
        order = {id(p): k for k, p in enumerate(master.parameters())}  # `own` order: the optimizer's groups split it
        for p, g in zip(sorted(params, key=lambda t: order[id(t)]), acc):
            p.grad = g.to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if worker is not master:
            with torch.no_grad():
                for w, p in zip(worker.parameters(), master.parameters()):
                    w.copy_(p)
