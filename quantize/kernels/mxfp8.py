"""MXFP8 (OCP Microscaling v1.0): float8_e4m3fn elements with one e8m0 scale per 32 along K.

Scale rule of nvidia-modelopt 0.47 ``MXFP8QTensor`` (``_compute_e8m0_exponent``): the block
exponent is ``ceil(log2(block_amax / 448))`` clamped to [-127, 127] (an all-zero block gets
-127), stored biased by 127 as uint8; elements are ``e4m3(clamp(x / 2^e, +-448))``. The
ceiling never lets a block overflow e4m3. Dequant: ``W = e4m3(q) * 2^(scale - 127)``
(compressed-tensors ``mx_utils.decompress_mx_scale``, vLLM ModelOptMxFp8LinearMethod).
"""

import torch

from quantize.kernels.dtypes import E4M3_MAX

__all__ = ["MXFP8_GROUP_SIZE", "quantize_mxfp8", "dequantize_mxfp8"]

MXFP8_GROUP_SIZE = 32
E8M0_BIAS = 127


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 [N, K] (K a multiple of 32) to MXFP8.

    Returns:
        ``(weight float8_e4m3fn [N, K], scale uint8 [N, K/32])`` (biased e8m0 exponents).

    Raises:
        ValueError: not 2-D float32, or K not a multiple of 32.
    """
    if w.ndim != 2 or w.dtype != torch.float32:
        raise ValueError(f"quantize_mxfp8 needs a 2-D float32 tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if k % MXFP8_GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the MXFP8 group size {MXFP8_GROUP_SIZE}")
    blocks = w.view(n, k // MXFP8_GROUP_SIZE, MXFP8_GROUP_SIZE)
    descale = blocks.abs().amax(dim=-1) / E4M3_MAX
    log2 = torch.where(descale > 0, torch.log2(descale), torch.full_like(descale, -127.0))
    exp = torch.ceil(log2).clamp(-127, 127)
    q = (blocks * torch.exp2(-exp).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.view(n, k).to(torch.float8_e4m3fn), (exp + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(weight) * 2^(scale - 127)`` per 32 elements along K, as float32 [N, K]."""
    s = torch.exp2(scale.to(torch.float32) - E8M0_BIAS).repeat_interleave(MXFP8_GROUP_SIZE, dim=1)
    return weight.to(torch.float32) * s
