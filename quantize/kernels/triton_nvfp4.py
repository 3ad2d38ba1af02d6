"""CUDA path: one Triton kernel from block-scaled FP8 bytes to packed NVFP4 (see fused.py).

Each program takes a tile of ``ROWS x COLS`` weights: it loads the e4m3 bytes and their FP8
scales, multiplies (float32), reduces every 16 columns to a block amax, derives the e4m3
block scale exactly as :func:`quantize.kernels.nvfp4.nvfp4_block_scale` (compressed-tensors
order) or :func:`quantize.kernels.nvfp4.nvfp4_block_scale_scale2` (nvidia-modelopt order),
divides each weight by the order's divisor and rounds to e2m1 with the reference's threshold
table, then packs column pairs into bytes. Divisions use ``div_rn`` (IEEE round-to-nearest)
because Triton's ``/`` on float32 is the approximate ``div.full``; the float32 -> e4m3 cast
rounds to nearest even; the kernel is compiled with ``enable_fp_fusion=False`` so that no
multiply and add become one FMA (the reference rounds both).

With more than one block-scale candidate (``quantize.kernels.scale_search``) each program
also scores every candidate of its blocks in registers, in the reference's order of
operations (``q = w / eff``, ``d = e2m1(q) - q``, ``d * d`` times the channel weight, a
pairwise tree over the 16 elements, times ``sf * sf``) and keeps the first of least score
before it codes the block. Only this module imports triton.
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
from quantize.kernels.scale_search import (
    RTN,
    check_candidates,
    normalized_channel_weight,
)

__all__ = ["TritonFp8", "fp8_to_nvfp4_triton"]

_ROWS, _COLS = 16, 256


@triton.jit
def _scale(block_amax, scalar, target, SCALE2: tl.constexpr, E4M3_MAX: tl.constexpr,
           MIN_SUB: tl.constexpr, ZERO_SCALE: tl.constexpr):
    # float32 e4m3 block scale mapping block_amax to the e2m1 value `target` (6 is RTN)
    t = tl.full(block_amax.shape, target, tl.float32)
    if SCALE2:  # fp8(clamp(amax / (t * scale_2), 2^-9, 448)), 0 -> 1.0 first
        pre = tl.math.div_rn(block_amax, t * scalar)
        pre = tl.where(pre == 0, 1.0, pre)
        pre = tl.minimum(tl.maximum(pre, MIN_SUB), E4M3_MAX)
        sf = pre.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    else:  # fp8(clamp(global * (amax / t), +-448)), underflow -> 2^-9, 0 -> 0.125
        pre = scalar * tl.math.div_rn(block_amax, t)
        pre = tl.minimum(tl.maximum(pre, -E4M3_MAX), E4M3_MAX)
        pre = tl.where((block_amax > 0) & (pre < MIN_SUB), MIN_SUB, pre)
        sf = pre.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
        sf = tl.where(sf == 0, ZERO_SCALE, sf)
    return sf


@triton.jit
def _code_of(sf):  # float32 e4m3 value -> its byte as int32
    return sf.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def _value_of(code):  # e4m3 byte (int32) -> float32
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _divisor(sf, scalar, SCALE2: tl.constexpr):
    if SCALE2:
        eff = sf * scalar
    else:
        eff = tl.math.div_rn(sf, tl.full(sf.shape, 1.0, tl.float32) * scalar)
    return eff


@triton.jit
def _e2m1(q, E2M1_MAX: tl.constexpr):
    # codes 0..15 of q (reference threshold table, ties to the even code, saturating at 6)
    a = tl.abs(tl.minimum(tl.maximum(q, -E2M1_MAX), E2M1_MAX))
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    return code | ((q < 0).to(tl.int32) << 3)


@triton.jit
def _fp8_nvfp4_kernel(w_ptr, s_ptr, g_ptr, cand_ptr, cw_ptr, packed_ptr, scale_ptr, n, k,
                      s_stride, bh, bw, ROWS: tl.constexpr, COLS: tl.constexpr,
                      SCALE2: tl.constexpr, NC: tl.constexpr, HAS_CW: tl.constexpr,
                      E4M3_MAX: tl.constexpr, E2M1_MAX: tl.constexpr, MIN_SUB: tl.constexpr,
                      ZERO_SCALE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    inside = (rows[:, None] < n) & (cols[None, :] < k)
    x = tl.load(w_ptr + rows[:, None].to(tl.int64) * k + cols[None, :], mask=inside, other=0.0)
    s = tl.load(s_ptr + (rows[:, None] // bh) * s_stride + cols[None, :] // bw, mask=inside,
                other=0.0)
    w = tl.reshape(x.to(tl.float32) * s, (ROWS, COLS // 16, 16))
    scalar = tl.load(g_ptr)
    block_amax = tl.max(tl.abs(w), axis=2)
    sf = _scale(block_amax, scalar, 6.0, SCALE2, E4M3_MAX, MIN_SUB, ZERO_SCALE)
    if NC > 1:  # block-scale search: candidates (target flag 0 = amax to 6, 1 = to 4; offset)
        if HAS_CW:
            cw = tl.load(cw_ptr + cols, mask=cols < k, other=0.0)
            cw = tl.broadcast_to(tl.reshape(cw, (1, COLS // 16, 16)), (ROWS, COLS // 16, 16))
        c6 = _code_of(sf)
        c4 = _code_of(_scale(block_amax, scalar, 4.0, SCALE2, E4M3_MAX, MIN_SUB, ZERO_SCALE))
        live = block_amax > 0
        best_code = c6
        best = tl.full(block_amax.shape, float("inf"), tl.float32)
        for i in tl.static_range(NC):
            four = tl.load(cand_ptr + 2 * i)
            off = tl.load(cand_ptr + 2 * i + 1)
            code = tl.minimum(tl.maximum(tl.where(four != 0, c4, c6) + off, 0x01), 0x7E)
            code = tl.where(live, code, c6)
            csf = _value_of(code)
            eff = _divisor(csf, scalar, SCALE2)
            q = tl.math.div_rn(w, tl.broadcast_to(eff[:, :, None], w.shape))
            mag = _e2m1(q, E2M1_MAX) & 7
            v = tl.where(mag < 4, mag.to(tl.float32) * 0.5,
                         tl.where(mag < 6, (mag - 2).to(tl.float32), ((mag - 4) * 2).to(tl.float32)))
            d = tl.where(q < 0, -v, v) - q
            e = d * d
            if HAS_CW:
                e = e * cw
            a, b = tl.split(tl.reshape(e, (ROWS, COLS // 16, 8, 2)))
            a, b = tl.split(tl.reshape(a + b, (ROWS, COLS // 16, 4, 2)))
            a, b = tl.split(tl.reshape(a + b, (ROWS, COLS // 16, 2, 2)))
            a, b = tl.split(tl.reshape(a + b, (ROWS, COLS // 16, 1, 2)))
            score = tl.reshape(a + b, (ROWS, COLS // 16)) * (csf * csf)
            better = score < best
            best = tl.where(better, score, best)
            best_code = tl.where(better, code, best_code)
        sf = _value_of(best_code)
    eff = _divisor(sf, scalar, SCALE2)
    q = tl.math.div_rn(w, tl.broadcast_to(eff[:, :, None], w.shape))
    code = _e2m1(q, E2M1_MAX)
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
                        scalar: torch.Tensor, order: str = "global",
                        candidates: tuple[tuple[int, int], ...] = RTN,
                        channel_weight: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize block-scaled FP8 to NVFP4 on the weight's CUDA device.

    Args:
        weight: float8_e4m3fn [N, K] (K a multiple of 16), CUDA.
        scale: float32 [ceil(N/bh), ceil(K/bw)] multiplier grid, same device; bw % 16 == 0.
        block: (bh, bw). scalar: the global scale of ``order`` (float32 [1] ``2688 / amax``
            for ``global``, ``amax / 2688`` for ``scale_2``), same device.
        candidates: block-scale candidates (``quantize.kernels.scale_search``); RTN by default.
        channel_weight: float32 [K] >= 0 weighting the search per input channel, or None.

    Returns:
        ``(packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16])`` on the device, equal
        byte for byte to the reference (``quantize_nvfp4_search``) on the dequantized weight.
    """
    n, k = weight.shape
    dev = weight.device
    candidates = check_candidates(candidates)
    cw = normalized_channel_weight(channel_weight, k) if candidates != RTN else None
    cand = torch.tensor([[int(t == 4), o] for t, o in candidates], dtype=torch.int32, device=dev)
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=dev)
    block_scale = torch.empty(n, k // NVFP4_GROUP_SIZE, dtype=torch.float8_e4m3fn, device=dev)
    scale = scale.to(torch.float32).contiguous()
    grid = (triton.cdiv(n, _ROWS), triton.cdiv(k, _COLS))
    _fp8_nvfp4_kernel[grid](weight.contiguous(), scale, scalar.to(torch.float32).reshape(1), cand,
                            cand if cw is None else cw.to(dev), packed, block_scale, n, k,
                            scale.stride(0), block[0], block[1], ROWS=_ROWS, COLS=_COLS,
                            SCALE2=order == "scale_2", NC=len(candidates), HAS_CW=cw is not None,
                            E4M3_MAX=E4M3_MAX, E2M1_MAX=E2M1_MAX, MIN_SUB=E4M3_MIN_SUBNORMAL,
                            ZERO_SCALE=CT_ZERO_BLOCK_SCALE, enable_fp_fusion=False)
    return packed, block_scale


class TritonFp8(Prepared):
    """:class:`Prepared` for the CUDA path: the bytes go to the device once; amax is the
    plain-PyTorch max of the dequantized weight there (memory-bound, exact)."""

    def __init__(self, weight, scale, block, device: torch.device, order: str = "global",
                 candidates: tuple[tuple[int, int], ...] = RTN,
                 channel_weight: torch.Tensor | None = None):
        self.weight = weight.to(device, non_blocking=True)
        self.scale = scale.to(device=device, dtype=torch.float32, non_blocking=True)
        self.block, self.order = block, order
        self.candidates, self.channel_weight = candidates, channel_weight
        from quantize.kernels.fp8 import dequantize_fp8_block

        self.amax = dequantize_fp8_block(self.weight, self.scale, block).abs().amax()

    def quantize(self, scalar):
        s = self._scalar(scalar).to(self.weight.device)
        p, bs = fp8_to_nvfp4_triton(self.weight, self.scale, self.block, s, self.order,
                                    self.candidates, self.channel_weight)
        return p.cpu(), bs.cpu()
