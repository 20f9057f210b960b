"""NF4 through bitsandbytes: a frozen base's linear weights as 4-bit codes and an fp32 absmax per block of 64.

QLoRA's 4-bit NormalFloat (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", NeurIPS 2023, §3),
as Hugging Face's `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")` holds it: bitsandbytes'
`quantize_4bit` at blocksize 64 without double quantisation (`tinypipe.estimate.lora_costs.NF4_BYTES_PER_PARAM`),
`dequantize_4bit` into the compute dtype, on whichever device the codes are (a CUDA kernel on the GPU, the
library's C++ one on the CPU). tinypipe keeps only the layout: where each weight's codes and absmax lie.

bitsandbytes was chosen over torchao's NF4 tensor (bench/qlora_codec.py measures both): on a 2-core CPU with
torch 2.13, a 4096 x 14336 bf16 matrix dequantised in 33 ms against torchao's 334 ms and quantised in 2.3 s
against 4.4 s, at the same error (NF4 at block 64: relative error 0.092 for both); its functional API has kept
its names since 0.39 where torchao's NF4 moved module (`torchao.dtypes.nf4tensor` to
`torchao.quantization.quantize_.workflows.nf4`); and peft trains LoRA on its `Linear4bit`, the QLoRA that TRL
and Unsloth users run, which tests/backends/test_qlora_run.py trains beside tinypipe.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import ModuleType

import torch

from tinypipe.estimate.lora_costs import NF4_BLOCK, nf4_tensor_bytes

INSTALL = "pip install 'tinypipe[qlora]'"  # the extra that brings bitsandbytes (pyproject.toml)


@contextlib.contextmanager
def hub_kernels_hidden() -> Iterator[None]:
    """Imports inside run with the Hugging Face `kernels` package unable to fetch: where it is installed,
    bitsandbytes' CPU backend fetches a kernel from the Hub when it is first imported (on a CPU with AVX512-BF16;
    peft imports bitsandbytes when it is installed), and nothing downloads at run time. bitsandbytes then uses its
    own C++ kernels, and its note that the Hub kernel did not load is silenced. (`kernels` stays importable:
    transformers caches whether it is.)"""
    try:
        import kernels
    except ImportError:  # nothing could fetch a kernel
        kernels = None
    fetch = getattr(kernels, "get_kernel", None)
    if kernels is not None:
        kernels.get_kernel = _no_hub_kernel
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(level)
        if kernels is not None:
            kernels.get_kernel = fetch


def _no_hub_kernel(*args: object, **kwargs: object) -> None:
    raise RuntimeError("tinypipe downloads nothing at run time: no kernel from the Hugging Face Hub")


def functional() -> ModuleType:
    """`bitsandbytes.functional` (ImportError when it is not installed or does not load)."""
    with hub_kernels_hidden():
        import bitsandbytes.functional as F
    return F


def packed_sizes(numel: int) -> tuple[int, int]:
    """(code bytes, absmax floats) of one weight of `numel` elements as NF4."""
    blocks = -(-numel // NF4_BLOCK)
    codes = nf4_tensor_bytes(numel) - 4 * blocks
    return codes, blocks


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes: uint8, flat; absmax: fp32, flat) of `weight` as NF4, computed on its device from its values in
    its own dtype (Hugging Face quantises the weights as loaded, in the model's dtype)."""
    codes, state = functional().quantize_4bit(weight.contiguous(), blocksize=NF4_BLOCK, quant_type="nf4")
    return codes.reshape(-1), state.absmax.reshape(-1).float()


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
               ) -> torch.Tensor:
    """A new `dtype` tensor of `shape` from its NF4 codes and absmax, on their device."""
    F = functional()
    state = F.QuantState(absmax=absmax, shape=torch.Size(shape), blocksize=NF4_BLOCK, quant_type="nf4", dtype=dtype)
    out: torch.Tensor = F.dequantize_4bit(codes.reshape(-1, 1), state)
    return out
