"""`tinypipe run`'s command-line options: registration only (`settings.settle` fills and checks them)."""

from __future__ import annotations

import argparse
import importlib.util

if importlib.util.find_spec("torch") is None:  # the CLI registers `run` only when this imports
    raise ImportError("torch is not installed")

import tinypipe.cli.flags as flags  # noqa: E402 - after the torch check

from ..host.optim_rules import SCHEDULES  # noqa: E402 - after the torch check
from .frugal import add_frugal_arguments  # noqa: E402 - after the torch check
from .machine import add_machine_arguments  # noqa: E402 - after the torch check
from .settings import DEFAULT_BETAS, DEFAULTS  # noqa: E402 - after the torch check


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Register `tinypipe run`'s options on `p` (the CLI's subparser).

    Options a checkpoint records default to None here (see `settings.settle`): a new run takes
    `DEFAULTS`, `--resume` takes the checkpoint's record of the run.
    """
    _add_job(p)
    _add_optimizer(p)
    _add_outputs(p)
    add_frugal_arguments(p)
    add_machine_arguments(p)
    flags.add_lora(p)
    p.add_argument("--merge", action="store_true", help="LoRA: also write the base with the adapters folded in, "
                   "a Hugging Face model in OUT/merged")
    p.add_argument("--trace-memory", action="store_true",
                   help="CUDA: sample the caching allocator at each action, its bytes in use (the trace's memory "
                        "counter) and its peak while the action is issued (otherData.action_peaks); two statistics "
                        "reads per action, ~0.2 ms each on the thread that issues the GPU's work")
    flags.add_profile(p, "measured traces (`tinypipe profile --out DIR`) for the schedule and the prediction: a "
                         "directory or a trace JSON, repeatable; a matching one is used before the shipped ones")


def _add_job(p: argparse.ArgumentParser) -> None:
    """What is trained where: the devices, the model, the data, the policy and the batch."""
    d = DEFAULTS
    flags.add_backend(p, "cpu: worker processes stand in for GPUs (gloo); cuda: one process per GPU (NCCL) "
                         f"(default {d['backend']})")
    p.add_argument("--gpus", type=int, default=None,
                   help=f"devices = worker processes (default: every visible GPU with --backend cuda, {d['gpus']} "
                        "on the cpu)")
    flags.add_model(p, "shipped model name, config.json, a local model directory with safetensors, or a Hugging "
                       "Face Hub id (org/name: from its cache, downloaded unless HF_HUB_OFFLINE) (default "
                       f"{d['model']})")
    p.add_argument("--data", default=None,
                   help="training data: JSON Lines, a JSON array, CSV or Parquet of {\"text\"}, {\"prompt\", "
                        "\"completion\"}, {\"messages\"} (chat template, loss on assistant turns), ShareGPT or Alpaca "
                        "records, plain text, or a Hugging Face dataset id (org/name); the format is read from the "
                        "content (default: the embedded synthetic addition task)")
    p.add_argument("--data-split", default=None, metavar="SPLIT",
                   help="the split of a Hugging Face dataset --data reads, e.g. train[:90%%] (default train)")
    p.add_argument("--data-config", default=None, metavar="NAME",
                   help="the configuration of a Hugging Face dataset --data reads (default: its default one)")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--eval-data", default=None, metavar="FILE",
                      help="held-out data (any --data format): its loss every --eval-every steps and at the end, in "
                           "the summary and metrics.jsonl")
    held.add_argument("--eval-fraction", type=float, default=None, metavar="F",
                      help="hold out the last F of --data's sequences (at least one) for the same evaluation")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="evaluate every N steps as well as at the end (default: 10 times a run); each held-out "
                        "step costs a training step's device work, without the optimizer")
    p.add_argument("--byte-tokens", action="store_true", default=None,
                   help="train on UTF-8 byte ids when the model has no tokenizer files (default: byte ids only for a "
                        "byte-level vocabulary of 256-258 ids, such as tiny-llama's; a larger one is an error with "
                        "--data)")
    p.add_argument("--no-packing", dest="packing", action="store_false", default=None,
                   help="one example per sequence, cut at --seq-len and padded (default: examples packed end to end)")
    flags.add_policy(p, f"preset name or policy JSON (default {d['policy']}, with {d['microbatch_size']} sequences "
                        "per microbatch)")
    flags.add_microbatch_size(p, "sequences per microbatch (default: the policy's)", metavar="N")
    flags.add_gpu_mem(p, "CUDA: GPU memory each rank may use, e.g. 24GiB: the schedule is planned for it, the "
                         "caching allocator is capped at it, and a policy that does not fit is refused before "
                         "training (default: the whole GPU)", metavar="BYTES")
    flags.add_hardware(p, "CUDA only: hardware preset or JSON the schedule is compiled for (default: the preset of "
                          "the local GPU model)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {d['steps']}; with "
                        "--resume, the resumed run's)")
    length.add_argument("--epochs", type=float, default=None, metavar="E",
                        help="train for E passes over --data instead of --steps (steps = ceil(E x sequences / "
                             "sequences per step))")
    flags.add_seq_len(p, f"tokens per sequence (default {d['seq_len']})", default=None)
    flags.add_batch_tokens(p, "tokens per optimizer step, all microbatches together; microbatches = batch-tokens / "
                              f"(policy microbatch_size x seq-len) (default {d['batch_tokens']})")
    flags.add_dtype(p, "compute dtype (default: fp32 on cpu, bf16 on cuda); masters are always fp32",
                    choices=("fp32", "bf16"), default=None)


def _add_optimizer(p: argparse.ArgumentParser) -> None:
    """AdamW, its learning rate schedule, clipping, the seed."""
    d = DEFAULTS
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW peak learning rate (default: by the model's size, 3e-3 up to 10M parameters, then "
                        "3e-3 x sqrt(1e7 / parameters), at least 3e-5: 1.1e-4 for 8B)")
    p.add_argument("--lr-schedule", default=None, metavar="NAME",
                   help=f"learning rate after the warmup, by transformers' lr_scheduler_type names, the same "
                        f"functions: {', '.join(SCHEDULES)} (default {d['lr_schedule']}; constant keeps the warmup)")
    p.add_argument("--lr-schedule-kwargs", default=None, metavar="JSON",
                   help="the schedule's parameters, as transformers' lr_scheduler_kwargs, e.g. "
                        "'{\"min_lr_rate\": 0.1}' for cosine_with_min_lr, '{\"num_decay_steps\": 100}' for "
                        "warmup_stable_decay")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                      help="steps of linear warmup from lr 0 (default: --warmup-ratio)")
    warm.add_argument("--warmup-ratio", type=float, default=None, metavar="R",
                      help=f"warmup as a share of the run's steps, rounded up (default {d['warmup_ratio']})")
    p.add_argument("--max-grad-norm", type=float, default=None, metavar="X",
                   help="clip by the global gradient norm over all ranks, as torch.nn.utils.clip_grad_norm_ "
                        "(default: off). Every layer's optimizer step then waits for the step's last gradient: "
                        "the schedule says so and the prediction includes it. Either host layout (compact then holds a "
                        "whole gradient in the compute dtype in place of its ring); with --lora, the adapters' "
                        "gradients (their steps on the GPU wait for the step's last backward)")
    p.add_argument("--decay-all", action="store_true", default=None,
                   help="apply --weight-decay to every parameter (default: not to norms, biases and the embedding)")
    p.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"),
                   help=f"AdamW betas, each in [0, 1) (default {' '.join(map(str, DEFAULT_BETAS))})")
    p.add_argument("--eps", type=float, default=None, help=f"AdamW epsilon (default {d['eps']})")
    p.add_argument("--weight-decay", type=float, default=None, help=f"AdamW weight decay (default {d['weight_decay']})")
    flags.add_seed(p, f"initialisation and data seed (default {d['seed']})")
    p.add_argument("--no-grad-norm", dest="grad_norm", action="store_false", default=True,
                   help="leave the gradient norm out of metrics.jsonl: measuring it is one more pass over each "
                        "layer's gradients in the host optimizer (bench/grad_norm_cost.py: 9-23%% of a fused AdamW "
                        "step on one CPU thread)")


def _add_outputs(p: argparse.ArgumentParser) -> None:
    """What a run writes and when: the model, checkpoints, the trace, and where its numbers go."""
    d = DEFAULTS
    p.add_argument("--no-save", dest="save", action="store_false",
                   help="do not write the fine-tuned model at the end (benchmarks; checkpoints as set)")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="also write the model (Hugging Face format) to OUT/step-N every N steps (default 0: off); "
                        "a run stopped by Ctrl-C writes it to OUT/step-K")
    p.add_argument("--save-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="dtype of the saved model's weights (default: the model's own, its config's torch_dtype; "
                        "fp32 for a model built from a config without one)")
    p.add_argument("--out", default=None, help="output directory: the fine-tuned model and checkpoints "
                   "(default runs/run-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in --out, with its "
                   "settings (options given again must match them; --steps may extend the run)")
    p.add_argument("--checkpoint-minutes", type=float, default=None, metavar="M",
                   help=f"checkpoint after every M minutes of training and at the end (default "
                        f"{d['checkpoint_minutes']:g}; 0: only by --checkpoint-every and on Ctrl-C); "
                        "--keep-checkpoints are kept")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="also checkpoint every N steps (default 0: off)")
    flags.add_compile(p, "torch.compile the decoder blocks: one graph per block structure, fused elementwise work; "
                         "the first step pays the compilation (default: on for cuda, off for cpu)")
    p.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (Perfetto) of all ranks")
    p.add_argument("--report-to", choices=("wandb",), default=None,
                   help="also log metrics.jsonl's numbers to Weights & Biases (needs the wandb package; WANDB_PROJECT, "
                        "WANDB_MODE=offline and the other WANDB_* variables apply; the run's files go to OUT/wandb)")
