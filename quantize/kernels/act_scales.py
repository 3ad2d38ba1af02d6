"""Activation-side scales from calibration amax: NVFP4 input global scales, FP8 KV-cache
scales, and NVFP4 activation fake-quantization (what a W4A4 GEMM does to its input).

Conventions:
- NVFP4 activations (W4A4): 16-element blocks along K, e4m3 block scale computed at run
  time, static global scale from calibration, ``2688 / amax_in`` in the compressed-tensors
  direction (``input_global_scale``); ModelOpt stores the reciprocal ``amax_in / 2688``
  (``input_scale``) [docs/formats.md §B.0; compressed-tensors NVFP4 preset ``dynamic:
  "local"``; modelopt ``NVFP4QTensor.get_activation_scaling_factor``].
- FP8 e4m3 KV cache: one per-tensor scale in the dequant direction, ``amax / 448``, for K and
  for V (compressed-tensors ``k_scale``/``v_scale``, ModelOpt ``k_proj.k_scale`` /
  ``v_proj.v_scale``: "kv cache scale as amax / 448") [docs/formats.md §B.4].
"""

import torch

from quantize.kernels.dtypes import E4M3_MAX
from quantize.kernels.nvfp4 import (
    dequantize_nvfp4,
    global_scale_from_amax,
    quantize_nvfp4,
    scale_2_from_amax,
)

__all__ = ["input_global_scale_from_amax", "input_scale_from_amax", "fp8_kv_scale_from_amax",
           "fake_quantize_nvfp4_activation"]


def input_global_scale_from_amax(amax: float | torch.Tensor) -> torch.Tensor:
    """float32 [1] ``2688 / amax_in`` (same arithmetic and guards as the weight global scale,
    compressed-tensors ``generate_gparam``)."""
    return global_scale_from_amax(amax)


def fp8_kv_scale_from_amax(amax: float | torch.Tensor) -> torch.Tensor:
    """float32 [1] ``amax / 448``, dequant direction; a zero or non-finite amax gives 1.0
    (the value engines use when no scale is stored)."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    ok = torch.isfinite(a) & (a > 0)
    return torch.where(ok, a / E4M3_MAX, torch.ones_like(a))


def fake_quantize_nvfp4_activation(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize activations as a W4A4 NVFP4 GEMM sees them.

    Args:
        x: float tensor [..., K], K a multiple of 16.
        input_global_scale: float32 [1], ``2688 / amax_in`` (static, from calibration).

    Returns:
        same shape and dtype as ``x``: each 16-element block along K rounded to e2m1 against
        an e4m3 block scale computed from the block (dynamic), over the static global scale.
    """
    k = x.shape[-1]
    flat = x.reshape(-1, k).to(torch.float32)
    packed, scale = quantize_nvfp4(flat, input_global_scale)
    return dequantize_nvfp4(packed, scale, input_global_scale).reshape(x.shape).to(x.dtype)


def input_scale_from_amax(amax: float | torch.Tensor) -> torch.Tensor:
    """0-dim float32 ``amax_in / 2688``, dequant direction: ModelOpt's ``input_scale``
    (``NVFP4QTensor.get_activation_scaling_factor``, same arithmetic and zero guard as the
    weight's ``weight_scale_2``)."""
    return scale_2_from_amax(amax)
