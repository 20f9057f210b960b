"""LoRA through the pipeline equals plain peft training; the base stays bit-identical; the adapter directory is
peft's; resume is bit-exact; the asynchronous optimizer mode trains the same."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from conftest import TINY_QWEN3, plan_run  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.model.layers import IGNORE_INDEX  # noqa: E402
from tinypipe.backends.model.lora_adapters import initial_value, peft_config  # noqa: E402
from tinypipe.backends.options import frugal  # noqa: E402
from tinypipe.backends.options.run_flags import add_run_arguments  # noqa: E402
from tinypipe.backends.save import checkpoint  # noqa: E402
from tinypipe.backends.save.hf_save import to_hf_state_dict  # noqa: E402
from tinypipe.backends.save.lora_save import ADAPTER_WEIGHTS  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.estimate.hostmem import CHECKPOINT_SLACK_BYTES  # noqa: E402
from tinypipe.policy.lora_spec import LoraSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, MBS, MB = 16, 2, 2
LR, SEED = 1e-2, 0
RANK, ALPHA = 4, 8.0
# Tolerances against peft's own training of the Hugging Face model (fp32 on the CPU): the pipeline computes
# the same mathematics in another order (layer by layer, a chunked loss, per-layer fused AdamW), so losses
# agree to float32 rounding and the adapters to a few ulps of their size after a handful of steps.
LOSS_RTOL, ADAPTER_ATOL, ADAPTER_RTOL = 1e-5, 2e-5, 1e-4


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    return ap.parse_args(["--seq-len", str(SEQ), "--batch-tokens", str(SEQ * MBS * MB), "--lr", str(LR),
                          "--lr-schedule", "constant", "--warmup-ratio", "0", "--seed", str(SEED), *argv])


def policy_file(tmp: Path, **fields: object) -> str:
    base = {"name": "test", "swap": "layer", "microbatch_size": MBS, "resident": "none"}
    path = tmp / "policy.json"
    path.write_text(json.dumps({**base, **fields}))
    return str(path)


def config(tmp: Path, **changes: Any) -> str:
    path = tmp / "tiny.json"
    path.write_text(json.dumps({**TINY_QWEN3, **changes}))
    return str(path)


def pipeline(tmp: Path, model: str, gpus: int, *extra: str, **replace: Any) -> tuple[Any, list[Any]]:
    plan = plan_run(parse("--gpus", str(gpus), "--model", model, "--out", str(tmp / "out"), "--lora", str(RANK),
                               "--lora-alpha", str(ALPHA), "--lora-targets", "all", *extra))
    job = dataclasses.replace(plan.job, progress=False, keep_masters=True, checkpoint_s=0.0, **replace)
    return plan, run_threads(job, gpus)


def hf_model(model: str) -> Any:
    """The Hugging Face model with the pipeline's initial weights (`build_model`'s seeded draw)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {k: v for k, v in json.loads(Path(model).read_text()).items() if k != "model_type"}
    cfg = AutoConfig.for_model(TINY_QWEN3["model_type"], **raw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).float()
    hf.load_state_dict(to_hf_state_dict(build_model(model, seed=SEED)), strict=False)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf


def peft_reference(model: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """peft's LoRA on the Hugging Face model, the pipeline's data and initial adapters, loss as the pipeline's
    (token cross-entropy summed over a step, divided by its loss tokens), AdamW over the adapters."""
    lora = LoraSpec(rank=RANK, alpha=ALPHA, targets=("q", "k", "v", "o", "gate", "up", "down"))
    pm = peft.get_peft_model(hf_model(model), peft_config(lora))
    named = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(initial_value(n.replace(".default", ""), tuple(p.shape), SEED))
    opt = torch.optim.AdamW(list(named.values()), lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0, fused=True)
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS, microbatches=MB,
                           seed=SEED)
    losses = []
    for step in range(steps):
        mbs = batches.step(step)
        denom = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in mbs)
        total = 0.0
        for ids, labels in mbs:
            logits = pm(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=IGNORE_INDEX, reduction="sum") / denom
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {n.replace(".default", ""): p.detach().clone() for n, p in named.items()}


def saved(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / ADAPTER_WEIGHTS))


@pytest.mark.parametrize(("tied", "gpus", "packing", "mapping"), [
    (False, 3, [1, 1, 1, 1, 1], [0, 1, 2, 0, 1]),  # untied, five one-layer packs on 3 workers
    (True, 2, [2, 1, 2], [0, 1, 0]),  # tied: the head's pack on the embedding's worker
])
def test_lora_through_the_pipeline_equals_peft(tmp_path: Path, tied: bool, gpus: int, packing: list[int],
                                               mapping: list[int]) -> None:
    """Losses per step and the final adapters equal peft's training of the same model on the same data (to the
    tolerances above); the base's weights come out bit-identical; the directory is a peft adapter that
    `PeftModel.from_pretrained` loads, with the trained values, and generates with."""
    model = config(tmp_path, tie_word_embeddings=tied)
    pol = policy_file(tmp_path, packing=packing, mapping=mapping)
    steps = 4
    plan, ranks = pipeline(tmp_path, model, gpus, "--policy", pol, "--steps", str(steps))
    assert len(plan.schedule.pack_layers) == len(packing) and plan.schedule.lora is not None
    # the base is built as shapes and filled layer by layer into the frozen copy: never held twice
    assert all("model built (shapes only)" in r.rss_phases for r in ranks)
    losses = {k: v for r in ranks for k, v in r.losses.items()}
    want_losses, want_adapters = peft_reference(model, steps)
    assert [losses[k] for k in range(steps)] == pytest.approx(want_losses, rel=LOSS_RTOL)
    got = saved(tmp_path / "out")
    assert sorted(got) == sorted(want_adapters)
    for key, want in want_adapters.items():
        torch.testing.assert_close(got[key], want, atol=ADAPTER_ATOL, rtol=ADAPTER_RTOL)
    assert any(float(t.abs().max()) > 0 for k, t in got.items() if ".lora_B." in k)  # B moved off zero
    # the base: bit-identical to the initial weights on every rank
    base = build_model(model, seed=SEED).state()
    for r in ranks:
        for i, tensors in r.masters.items():
            for n, t in tensors.items():
                assert torch.equal(t, base[i][n]), (i, n)
    # peft loads the directory: the same values, and the model generates
    loaded = peft.PeftModel.from_pretrained(hf_model(model), str(tmp_path / "out"))
    params = {n.replace(".default", ""): p for n, p in loaded.named_parameters() if "lora_" in n}
    for key, t in got.items():
        assert torch.equal(params[key].detach(), t), key
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (
        RANK, ALPHA, sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    text = loaded.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert text.shape == (1, 7)


def test_resume_is_bit_exact_and_async_trains_the_same(tmp_path: Path) -> None:
    """Stopped after 2 of 5 steps and resumed, the adapters equal an uninterrupted run's bit for bit (the
    checkpoint on disk is the size `check_disk` plans for); under the
    asynchronous optimizer mode (nothing runs on the host: the adapters step on the device in stream order)
    the losses and adapters equal the synchronous run's."""
    model = config(tmp_path)
    whole_dir, part_dir, async_dir = tmp_path / "whole", tmp_path / "part", tmp_path / "async"
    for d in (whole_dir, part_dir, async_dir):
        d.mkdir()
    _, whole = pipeline(whole_dir, model, 2, "--steps", "5")
    _, first = pipeline(part_dir, model, 2, "--steps", "5", "--checkpoint-every", "2", stop_after=2)
    assert all(r.interrupted for r in first) and checkpoint.find(part_dir / "out") is not None
    plan = plan_run(parse("--gpus", "2", "--out", str(part_dir / "out"), "--resume"))
    # the checkpoint holds the adapters and their moments, not the base: the formula `check_disk` sizes it by
    formula = frugal.checkpoint_plan_bytes(plan.spec, plan.schedule)
    assert formula - 2 * CHECKPOINT_SLACK_BYTES <= checkpoint.held_bytes(part_dir / "out") <= formula
    assert plan.schedule.lora == LoraSpec(rank=RANK, alpha=ALPHA, targets=("q", "k", "v", "o", "gate", "up", "down"))
    second = run_threads(dataclasses.replace(plan.job, progress=False, checkpoint_s=0.0), 2)
    assert [r.start_step for r in second] == [2, 2]
    a, b = saved(whole_dir / "out"), saved(part_dir / "out")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    wl = {k: v for r in whole for k, v in r.losses.items()}
    pl = {k: v for r in [*first, *second] for k, v in r.losses.items()}
    assert [pl[k] for k in range(5)] == [wl[k] for k in range(5)]
    pol = policy_file(async_dir, optimizer="async", packing="holistic")
    _, asy = pipeline(async_dir, model, 2, "--steps", "5", "--policy", pol)
    al = {k: v for r in asy for k, v in r.losses.items()}
    assert [al[k] for k in range(5)] == pytest.approx([wl[k] for k in range(5)], rel=1e-6)
    c = saved(async_dir / "out")
    for k in a:
        torch.testing.assert_close(c[k], a[k], atol=1e-6, rtol=1e-6)


def test_continue_from_an_adapter_directory_and_merge(tmp_path: Path) -> None:
    """`--model ADAPTER_DIR` trains on from the adapter (its base and LoraSpec from its config); `--merge` writes
    the base with W + (alpha / r) B A folded in, which Hugging Face loads and which computes what the adapter
    model computes."""
    model = config(tmp_path)
    first = tmp_path / "first"
    first.mkdir()
    pipeline(first, model, 1, "--steps", "2")
    cont = plan_run(parse("--gpus", "1", "--model", str(first / "out"), "--steps", "2", "--merge",
                               "--out", str(tmp_path / "second")))
    assert cont.job.lora_files.adapter == str(first / "out") and cont.job.model == model
    run_threads(dataclasses.replace(cont.job, progress=False, checkpoint_s=0.0), 1)
    before, after = saved(first / "out"), saved(tmp_path / "second")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "second" / "merged"))
    with_adapter = peft.PeftModel.from_pretrained(hf_model(model), str(tmp_path / "second"))
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_bad_lora_options_are_one_line_errors(tmp_path: Path) -> None:
    """A LoRA flag without --lora, dropout with recompute, --merge without LoRA: InputErrors before any worker."""
    for argv, match in ((["--lora-alpha", "4"], "needs --lora R"),
                        (["--lora", "4", "--lora-dropout", "0.1"], "without recompute"),
                        (["--merge"], "only for a LoRA run"),
                        (["--lora", "4", "--lora-targets", "q,zz"], "--lora-targets")):
        with pytest.raises(InputError, match=match):
            plan_run(parse("--gpus", "1", "--out", str(tmp_path / "o"), *argv))


def test_compiled_lora_blocks_train_like_eager(tmp_path: Path) -> None:
    """`--compile` (dynamo's aot_eager on the CPU: the same capture and autograd split as on a GPU) over blocks that
    carry peft's modules, recomputing and not: the same losses and adapters as eager, bit for bit."""
    model = config(tmp_path)
    for recompute in (True, False):
        pol = policy_file(tmp_path, packing="holistic", recompute=recompute)
        runs = []
        for comp in (False, True):
            d = tmp_path / f"r{int(recompute)}c{int(comp)}"
            d.mkdir()
            _, ranks = pipeline(d, model, 2, "--steps", "3", "--policy", pol, compile_blocks=comp,
                                compile_backend="aot_eager")
            runs.append(({k: v for r in ranks for k, v in r.losses.items()}, saved(d / "out")))
        (el, ea), (cl, ca) = runs
        assert cl == el
        assert all(torch.equal(ca[k], ea[k]) for k in ea)


def test_held_out_loss_is_a_plain_forward_of_the_adapters_and_leaves_training_alone(tmp_path: Path) -> None:
    """--eval-data with --lora, evaluated after steps 2 and 4 (the adapters saved there too): each held-out loss
    equals peft's forward of the base with the adapters saved at that step, on the same held-out windows (one
    example each, --no-packing), and the run's losses and adapters equal those of the same run without
    evaluation, bit for bit (the evaluation's backward leaves no gradient in the adapters)."""
    from tinypipe.backends.rank.evaluation import eval_steps

    model = config(tmp_path)
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(f'{{"text": "sum {i} plus {i * 3} is {i * 4}"}}\n' for i in range(40)))
    held.write_text("".join(f'{{"text": "held {i}: {"ab" * (i % 5)}"}}\n' for i in range(12)))
    common = ("--steps", "4", "--data", str(train), "--byte-tokens", "--no-packing", "--save-every", "2")
    runs = {}
    for name, extra in (("eval", ("--eval-data", str(held), "--eval-every", "2")), ("plain", ())):
        (tmp_path / name).mkdir()
        runs[name] = pipeline(tmp_path / name, model, 2, *common, *extra)[1]
    losses = {name: {k: v for r in ranks for k, v in r.losses.items()} for name, ranks in runs.items()}
    assert losses["eval"] == losses["plain"] and sorted(losses["eval"]) == [0, 1, 2, 3]
    for where in ("out/step-2", "out"):
        a, b = saved(tmp_path / "eval" / where), saved(tmp_path / "plain" / where)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    got = runs["eval"][0].eval_losses
    assert sorted(got) == [1, 3]
    batches = make_batches(held, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS, microbatches=MB,
                           seed=SEED, packing=False, part="eval")
    assert eval_steps(batches) >= 1
    for step, where in ((1, "out/step-2"), (3, "out")):
        pm = peft.PeftModel.from_pretrained(hf_model(model), str(tmp_path / "eval" / where))
        total = tokens = 0.0
        with torch.no_grad():
            for k in range(eval_steps(batches)):
                for ids, labels in batches.step(k):
                    logits = pm(input_ids=ids).logits.float()
                    total += float(torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                        reduction="sum"))
                    tokens += int((labels != IGNORE_INDEX).sum())
        assert got[step] == pytest.approx(total / tokens, rel=LOSS_RTOL), where
    assert got[1] != pytest.approx(got[3], rel=1e-4)  # the adapters moved between the evaluations
