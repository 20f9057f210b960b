"""Host RSS while a rank builds its layers and host state: layer by layer (now) against model-then-state.

For a medium Llama (hidden 1536, 16 blocks, vocab 32000: ~0.55 G parameters, 2.2 GB in fp32) and the
compact layout, each way runs in a fresh process on the CPU and records (resident now, peak so far) at
each phase, then takes one optimizer step of every layer (the AdamW moments appear) and records again:
- `model-then-state`: the whole model built in fp32, then the host state made beside it (what a rank did
  before `rank_state.build_rank_state`);
- `layer-by-layer`: `build_rank_state`: shapes first, the state's slab, then each layer's weights drawn
  and split into the planes one at a time.
Writes bench/results/rss_phases.json and prints the phases in GB.

    python bench/rss_phases.py [--optimizer-state fp32|bf16|8bit]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_json  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1536,
          "intermediate_size": 4096, "num_hidden_layers": 16, "num_attention_heads": 12, "num_key_value_heads": 4,
          "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "_source": "bench/rss_phases.py: a medium Llama for memory phases"}


def child(mode: str, config: str, state: str) -> dict[str, Any]:
    """One way of building, in this process: RSS (now, peak) bytes by phase."""
    from types import SimpleNamespace

    import torch

    from tinypipe.backends.host.layouts import make_host_state
    from tinypipe.backends.host.state import AdamWConfig
    from tinypipe.backends.model.hf import build_model
    from tinypipe.backends.rank.rank_state import build_rank_state, rss_now, strip_parameters
    from tinypipe.policy.modes import HostMemory, OptimizerMode, OptimizerState

    torch.set_num_threads(1)
    spec_layers = len(build_model(config, seed=0, only=set()).layers)
    layers = list(range(spec_layers))
    sched = SimpleNamespace(host_memory=HostMemory.COMPACT, num_layers=spec_layers, compute_dtype="fp32",
                            optimizer=OptimizerMode.SYNC, optimizer_state=OptimizerState(state))
    job = SimpleNamespace(model=config, seed=0, schedule=sched, optim=AdamWConfig())
    if mode == "layer-by-layer":
        stack, host, rss = build_rank_state(job, layers, torch.device("cpu"))
    else:
        rss = {"start": rss_now()}
        stack = build_model(config, seed=0, only=set(layers))
        rss["model built"] = rss_now()
        host = make_host_state(stack.state(), host_memory=HostMemory.COMPACT, compute_dtype=torch.float32,
                               optim=job.optim, optimizer_state=OptimizerState(state))
        rss["host state made"] = rss_now()
        for i in layers:
            strip_parameters(stack.layers[i])  # type: ignore[arg-type]
        rss["model's own weights dropped"] = rss_now()
    for i in layers:  # one step each: the moments exist
        host.receive_grads(i, {n: torch.zeros_like(t) for n, t in host.master(i).items()})
        host.step(i)
    rss["after one optimizer step"] = rss_now()
    held = host.held()
    return {"params": held.params, "state_bytes": held.total_bytes, "phases": rss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizer-state", default="fp32", choices=("fp32", "bf16", "8bit"))
    ap.add_argument("--child", nargs=2, metavar=("MODE", "CONFIG"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.optimizer_state)))
        return 0
    out: dict[str, Any] = {"config": CONFIG, "optimizer_state": a.optimizer_state, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "medium-llama.json"
        cfg.write_text(json.dumps(CONFIG))
        for mode in ("model-then-state", "layer-by-layer"):
            res = subprocess.run([sys.executable, __file__, "--optimizer-state", a.optimizer_state, "--child", mode,
                                  str(cfg)], capture_output=True, text=True, check=True)
            out["modes"][mode] = json.loads(res.stdout.strip().splitlines()[-1])
    for mode, r in out["modes"].items():
        print(f"{mode}: {r['params'] / 1e9:.3f} G params, host state {r['state_bytes'] / 1e9:.2f} GB")
        for phase, (now, peak) in r["phases"].items():
            print(f"  {phase:32s} RSS {now / 1e9:6.2f} GB   peak {peak / 1e9:6.2f} GB")
    print(f"wrote {write_json('rss_phases.json', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
