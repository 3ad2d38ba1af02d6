"""CUDA path: one Triton kernel from block-scaled FP8 bytes to packed NVFP4 (see fused.py).

Each program takes a tile of ``ROWS x COLS`` weights: it loads the e4m3 bytes and their FP8
scales, multiplies (float32), reduces every 16 columns to a block amax, derives the e4m3
block scale exactly as :func:`quantize.kernels.nvfp4.nvfp4_block_scale`, divides each weight
by ``block_scale / global`` and rounds to e2m1 with the reference's threshold table, then packs
column pairs into bytes. Divisions use ``div_rn`` (IEEE round-to-nearest) because Triton's
``/`` on float32 is the approximate ``div.full``; the float32 -> e4m3 cast rounds to nearest
even. Only this module imports triton.
"""

import torch
import triton
import triton.language as tl

from quantize.kernels.dtypes import (
    CT_ZERO_BLOCK_SCALE,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    NVFP4_GROUP_SIZE,
)
from quantize.kernels.prepared import Prepared

__all__ = ["TritonFp8", "fp8_to_nvfp4_triton"]

_ROWS, _COLS = 16, 256


@triton.jit
def _fp8_nvfp4_kernel(w_ptr, s_ptr, g_ptr, packed_ptr, scale_ptr, n, k, s_stride, bh, bw,
                      ROWS: tl.constexpr, COLS: tl.constexpr, E4M3_MAX: tl.constexpr,
                      E2M1_MAX: tl.constexpr, MIN_SUB: tl.constexpr, ZERO_SCALE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    inside = (rows[:, None] < n) & (cols[None, :] < k)
    x = tl.load(w_ptr + rows[:, None].to(tl.int64) * k + cols[None, :], mask=inside, other=0.0)
    s = tl.load(s_ptr + (rows[:, None] // bh) * s_stride + cols[None, :] // bw, mask=inside,
                other=0.0)
    w = tl.reshape(x.to(tl.float32) * s, (ROWS, COLS // 16, 16))
    g = tl.load(g_ptr)
    block_amax = tl.max(tl.abs(w), axis=2)
    pre = g * tl.math.div_rn(block_amax, tl.full(block_amax.shape, E2M1_MAX, tl.float32))
    pre = tl.minimum(tl.maximum(pre, -E4M3_MAX), E4M3_MAX)
    pre = tl.where((block_amax > 0) & (pre < MIN_SUB), MIN_SUB, pre)
    sf = pre.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    sf = tl.where(sf == 0, ZERO_SCALE, sf)
    eff = tl.math.div_rn(sf, tl.full(sf.shape, 1.0, tl.float32) * g)
    q = tl.math.div_rn(w, tl.broadcast_to(eff[:, :, None], w.shape))
    q = tl.minimum(tl.maximum(q, -E2M1_MAX), E2M1_MAX)
    a = tl.abs(q)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    code = code | ((q < 0).to(tl.int32) << 3)
    lo, hi = tl.split(tl.reshape(code, (ROWS, COLS // 2, 2)))
    pcols = tl.program_id(1) * (COLS // 2) + tl.arange(0, COLS // 2)
    pmask = (rows[:, None] < n) & (pcols[None, :] < k // 2)
    tl.store(packed_ptr + rows[:, None].to(tl.int64) * (k // 2) + pcols[None, :],
             (lo | (hi << 4)).to(tl.uint8), mask=pmask)
    scols = tl.program_id(1) * (COLS // 16) + tl.arange(0, COLS // 16)
    smask = (rows[:, None] < n) & (scols[None, :] < k // 16)
    tl.store(scale_ptr + rows[:, None].to(tl.int64) * (k // 16) + scols[None, :],
             sf.to(tl.float8e4nv), mask=smask)


def fp8_to_nvfp4_triton(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                        global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize block-scaled FP8 to NVFP4 on the weight's CUDA device.

    Args:
        weight: float8_e4m3fn [N, K] (K a multiple of 16), CUDA.
        scale: float32 [ceil(N/bh), ceil(K/bw)] multiplier grid, same device; bw % 16 == 0.
        block: (bh, bw). global_scale: float32 [1] (``2688 / amax``), same device.

    Returns:
        ``(packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16])`` on the device, equal
        byte for byte to the reference on the dequantized weight.
    """
    n, k = weight.shape
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    block_scale = torch.empty(n, k // NVFP4_GROUP_SIZE, dtype=torch.float8_e4m3fn,
                              device=weight.device)
    scale = scale.to(torch.float32).contiguous()
    grid = (triton.cdiv(n, _ROWS), triton.cdiv(k, _COLS))
    _fp8_nvfp4_kernel[grid](weight.contiguous(), scale, global_scale.to(torch.float32).reshape(1),
                            packed, block_scale, n, k, scale.stride(0), block[0], block[1],
                            ROWS=_ROWS, COLS=_COLS, E4M3_MAX=E4M3_MAX, E2M1_MAX=E2M1_MAX,
                            MIN_SUB=E4M3_MIN_SUBNORMAL, ZERO_SCALE=CT_ZERO_BLOCK_SCALE)
    return packed, block_scale


class TritonFp8(Prepared):
    """:class:`Prepared` for the CUDA path: the bytes go to the device once; amax is the
    plain-PyTorch max of the dequantized weight there (memory-bound, exact)."""

    def __init__(self, weight, scale, block, device: torch.device):
        self.weight = weight.to(device, non_blocking=True)
        self.scale = scale.to(device=device, dtype=torch.float32, non_blocking=True)
        self.block = block
        from quantize.kernels.fp8 import dequantize_fp8_block

        self.amax = dequantize_fp8_block(self.weight, self.scale, block).abs().amax()

    def quantize(self, global_scale):
        g = global_scale.to(self.weight.device, torch.float32)
        p, s = fp8_to_nvfp4_triton(self.weight, self.scale, self.block, g)
        return p.cpu(), s.cpu()
