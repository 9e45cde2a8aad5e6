"""Model FLOPs and utilisation (MFU) for ``seqpar train``'s step records.

Model FLOPs of a step (forward + backward, no recomputation counted):
``6 * params * tokens`` (every parameter in one multiply-add per token forward, two backward) plus
the attention scores and their weighted sum, ``6 * layers * heads * head_dim * sum(L_d**2)`` over the
step's documents ``d`` of length ``L_d`` (causal: half of the ``4 L^2 H D`` forward of full attention,
times 3 for forward + backward). MFU divides them by the step time and the world's peak dense FLOP/s
(vendor datasheet values below; None where the device is not in the table, e.g. CPUs).
"""

from __future__ import annotations

import torch

# dense peak FLOP/s per GPU by compute dtype ("tf32": fp32 with TF32 tensor cores allowed)
_PEAKS = (  # (substring of torch.cuda.get_device_name, {dtype: FLOP/s}); first match wins
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "tf32": 378e12, "float32": 51e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float16": 835e12, "tf32": 418e12, "float32": 60e12}),
    ("H100", {"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12}),
    ("H200", {"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12}),
    ("A100", {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
)


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak dense FLOP/s of one ``device`` computing in ``dtype`` (None when unknown, e.g. CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if dtype == "float32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    for key, peaks in _PEAKS:
        if key in name:
            return peaks[dtype]
    return None


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, query heads, head dim) of a transformers config."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, heads, head_dim


def step_flops(params: int, tokens: int, doc_sq_sum: float, shape: tuple[int, int, int]) -> float:
    """Model FLOPs of one step: ``doc_sq_sum`` is the sum of squared document (segment) lengths."""
    layers, heads, head_dim = shape
    return 6.0 * params * tokens + 6.0 * layers * heads * head_dim * doc_sq_sum


def squared_lengths(cu_seqlens) -> float:
    cu = [int(c) for c in cu_seqlens]
    return float(sum((b - a) ** 2 for a, b in zip(cu, cu[1:])))


__all__ = ["attention_shape", "peak_flops", "squared_lengths", "step_flops"]
