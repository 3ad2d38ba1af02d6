"""FP8 (e4m3) dequantization and block quantization.

Conventions:
- DeepSeek-V3 block FP8 (``quant_method: fp8``): ``weight_scale_inv`` [ceil(N/bh), ceil(K/bw)]
  is a *multiplier*: ``W[i, j] = fp8(W[i, j]) * s[i // bh, j // bw]``; edge blocks are partial
  and use the same scale index (DeepSeek-V3 ``inference/kernel.py`` weight_dequant_kernel,
  compressed-tensors ``FP8BlockDequantizer``). Products are kept in float32.
- compressed-tensors ``float-quantized`` FP8: ``weight_scale`` is also a multiplier, shaped
  [1] (tensor), [N, 1] (channel), [N, ceil(K/g)] (group) or [ceil(N/bh), ceil(K/bw)] (block).
"""

import torch

from quantize.kernels.dtypes import E4M3_MAX

__all__ = ["dequantize_fp8_block", "dequantize_fp8_broadcast", "quantize_fp8_block"]


def _expand(scale: torch.Tensor, n: int, k: int, bh: int, bw: int) -> torch.Tensor:
    return scale.repeat_interleave(bh, dim=0)[:n].repeat_interleave(bw, dim=1)[:, :k]


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """Dequantize block-scaled FP8 to float32.

    Args:
        weight: float8_e4m3fn [N, K].
        scale: float32 or bfloat16 [ceil(N/bh), ceil(K/bw)], multiplier direction.
        block: (bh, bw) from config ``weight_block_size`` (never inferred from shapes).

    Returns:
        float32 [N, K].

    Raises:
        ValueError: the scale grid does not match ``ceil(N/bh) x ceil(K/bw)``.
    """
    n, k = weight.shape
    bh, bw = block
    want = (-(-n // bh), -(-k // bw))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match weight {n}x{k} with block "
            f"{bh}x{bw} (expected {want[0]}x{want[1]})"
        )
    return weight.to(torch.float32) * _expand(scale.to(torch.float32), n, k, bh, bw)


def dequantize_fp8_broadcast(weight: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Dequantize FP8 with a per-tensor [1], per-channel [N, 1] or per-group [N, K/g] scale.

    Args:
        weight: float8_e4m3fn [N, K]. scale: float [1] | [N, 1] | [N, ceil(K/g)].
        group: group size along K for the group strategy.

    Returns:
        float32 [N, K].
    """
    s = scale.to(torch.float32)
    if group is not None:
        n, k = weight.shape
        s = s.repeat_interleave(group, dim=1)[:, :k]
    elif s.ndim == 1:
        s = s.reshape(1, 1) if s.numel() == 1 else s.reshape(-1, 1)
    return weight.to(torch.float32) * s


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float weights to DeepSeek-style block FP8 (``scale = block_amax / 448``).

    Used to build real FP8 sources from dense checkpoints (the demo and test fixtures).

    Args:
        w: float [N, K]. block: (bh, bw).

    Returns:
        ``(weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/bh), ceil(K/bw)])``.
        An all-zero block gets scale 1.0.
    """
    w = w.to(torch.float32)
    n, k = w.shape
    bh, bw = block
    pn, pk = -(-n // bh) * bh, -(-k // bw) * bw
    padded = torch.zeros(pn, pk, dtype=torch.float32)
    padded[:n, :k] = w
    amax = padded.view(pn // bh, bh, pk // bw, bw).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, n, k, bh, bw)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale
