"""NVFP4 weight quantization: fp32 [N, K] -> packed e2m1 codes + e4m3 block scales.

The reference (plain PyTorch) path. It matches compressed-tensors 0.20
``NVFP4PackedCompressor`` byte for byte on finite inputs (see tests): the global scale is
``2688 / amax`` (``generate_gparam``), the block scale is ``fp8(global * block_amax / 6)``
(``calculate_qparams``), codes are ``round_e2m1(x / (fp32(block_scale) / global))``
(``forward_helpers._quantize`` then ``cast_to_fp4``), and two codes pack per byte with
the even column in the low nibble (``pack_fp4_to_uint8``).

One deliberate difference: a non-zero block whose e4m3 scale would underflow to 0 gets the
smallest subnormal 2^-9 (byte 0x01), where compressed-tensors would substitute 0.125 and
flush the block to zero (field case FC-11b). All-zero blocks get 0.125 as in
compressed-tensors, with all codes 0.

:func:`quantize_nvfp4_scale2` is the same quantizer in nvidia-modelopt 0.47's arithmetic
order (``NVFP4QTensor.quantize``): the dequant-direction ``scale_2 = amax / 2688`` is the
given scalar, block scales are ``fp8(clamp(block_amax / (6 * scale_2), 2^-9, 448))`` with
all-zero blocks set to 1.0, and codes are ``round_e2m1(x / (fp32(block_scale) * scale_2))``.
On values that sit on a coarse grid (dequantized FP8) the two orders round exact e2m1 ties
differently in ~0.4 % of bytes, so each output format uses its reference library's order.
"""

import torch

from quantize.kernels.dtypes import (
    CT_ZERO_BLOCK_SCALE,
    E2M1_LUT,
    E2M1_MAX,
    E2M1_THRESHOLDS,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    NVFP4_GLOBAL_NUMERATOR,
    NVFP4_GROUP_SIZE,
)

__all__ = [
    "ORDERS",
    "global_scale_from_amax",
    "nvfp4_block_scale",
    "nvfp4_block_scale_scale2",
    "scale_2_from_amax",
    "quantize_nvfp4_scale2",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "pack_e2m1",
    "unpack_e2m1",
    "round_to_e2m1_codes",
]

ORDERS = ("global", "scale_2")
"""Arithmetic orders: compressed-tensors' (:func:`quantize_nvfp4`, quantize-direction global
scale) and nvidia-modelopt's (:func:`quantize_nvfp4_scale2`, dequant-direction ``scale_2``)."""


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Quantize-direction global scale ``2688 / amax`` as float32 shape [1].

    Args:
        amax: max |w| over the tensor, or over every member of a fused group (float or
            0-dim/1-element tensor).

    Returns:
        float32 tensor [1]. amax is clamped to the smallest normal float32 first and any
        non-finite result becomes 1.0, exactly as compressed-tensors
        ``quantization/utils/helpers.py::generate_gparam``.
        ModelOpt's ``weight_scale_2`` is the reciprocal (amax / 2688).
    """
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1).abs()
    a = torch.clamp(a, min=torch.finfo(torch.float32).tiny)
    g = NVFP4_GLOBAL_NUMERATOR / a
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)


def scale_2_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Dequant-direction per-tensor scale ``amax / 2688`` as a 0-dim float32 tensor
    (nvidia-modelopt ``NVFP4QTensor.get_weights_scaling_factor_2``).

    An all-zero tensor (amax 0) gets 1.0, where modelopt would divide by zero and emit NaN
    block scales (docs/formats.md §L); 1.0 is the reciprocal of compressed-tensors' fallback.
    """
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(()).abs()
    s2 = a / NVFP4_GLOBAL_NUMERATOR
    return torch.where(s2 > 0, s2, torch.ones_like(s2))


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to 4-bit e2m1 codes.

    Saturates at +-6, rounds to nearest with ties to the even code, and sets the sign bit
    (0x8) for every strictly negative input, so a negative value that rounds to zero gives
    code 8 (-0), as compressed-tensors ``cast_to_fp4`` + ``pack_fp4_to_uint8`` do.

    Returns:
        uint8 tensor of the same shape, values 0..15.
    """
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in E2M1_THRESHOLDS:
        code += (a >= bound) if tie_up else (a > bound)
    code |= (x < 0).to(torch.uint8) << 3
    return code


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [N, K] (K even) into bytes [N, K/2]; column 2i -> low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: bytes [N, K/2] -> codes [N, K] (uint8, 0..15)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _blocks(w: torch.Tensor, fn: str) -> torch.Tensor:
    """``w`` [N, K] viewed as [N, K/16, 16], after checking it is 2-D float32 with K % 16 == 0."""
    if w.ndim != 2 or w.dtype != torch.float32:
        raise ValueError(f"{fn} needs a 2-D float32 tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if k % NVFP4_GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the NVFP4 group size {NVFP4_GROUP_SIZE}")
    return w.view(n, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)


def nvfp4_block_scale(block_amax: torch.Tensor, global_scale: torch.Tensor,
                      e2m1_max: float | torch.Tensor = E2M1_MAX) -> torch.Tensor:
    """e4m3 block scales of blocks with max |w| ``block_amax``, as float32 values
    (compressed-tensors order).

    ``fp8(clamp(global * (block_amax / 6), -448, 448))`` as in ``calculate_qparams``; a non-zero
    block whose scale would underflow gets 2^-9 (FC-11b); a zero scale becomes 0.125
    (compressed-tensors ``_get_dtype_eps``).

    Args:
        block_amax: float32, any shape, >= 0. global_scale: float32 [1] (``2688 / amax``).
        e2m1_max: 6; compiled callers pass it as a 0-dim tensor so that no compiler turns the
            division into a multiplication by 1/6 (not exact).

    Returns:
        float32, shape of ``block_amax``; every value is exactly representable in e4m3.
    """
    pre = global_scale * (block_amax / e2m1_max)
    pre = torch.clamp(pre, -E4M3_MAX, E4M3_MAX)
    # FC-11b: a non-zero block must not underflow to a zero scale.
    pre = torch.where((block_amax > 0) & (pre < E4M3_MIN_SUBNORMAL), E4M3_MIN_SUBNORMAL, pre)
    scale_f = pre.to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(scale_f == 0, CT_ZERO_BLOCK_SCALE, scale_f)


def nvfp4_block_scale_scale2(block_amax: torch.Tensor, scale_2: torch.Tensor,
                             e2m1_max: float | torch.Tensor = E2M1_MAX) -> torch.Tensor:
    """e4m3 block scales as float32 values in nvidia-modelopt's order:
    ``fp8(clamp(block_amax / (6 * scale_2), 2^-9, 448))``, an all-zero block getting 1.0.

    Args:
        block_amax: float32, any shape, >= 0. scale_2: 0-dim float32 (``amax / 2688``).
        e2m1_max: 6 (see :func:`nvfp4_block_scale`).
    """
    pre = block_amax / (e2m1_max * scale_2)
    pre = torch.where(pre == 0, torch.ones_like(pre), pre)
    return pre.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def quantize_nvfp4(
    w: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to NVFP4 against a given (possibly fused-group) global scale.

    Args:
        w: float32 [N, K] with K a multiple of 16. Must be finite.
        global_scale: float32 [1], quantize direction (``2688 / amax``), from
            :func:`global_scale_from_amax` over the tensor or its fused group.

    Returns:
        ``(packed, block_scale)``: packed uint8 [N, K/2] (even column in the low nibble),
        block_scale float8_e4m3fn [N, K/16]. Dequantize with
        ``e2m1(code) * float(block_scale) / global_scale``.

    Raises:
        ValueError: w is not 2-D float32 or K is not a multiple of 16.
    """
    blocks = _blocks(w, "quantize_nvfp4")
    n, k = w.shape
    g = global_scale.to(device=w.device, dtype=torch.float32)
    scale_f = nvfp4_block_scale(blocks.abs().amax(dim=-1), g)
    eff = scale_f / g
    q = blocks / eff.unsqueeze(-1)
    q = torch.clamp(q, -E2M1_MAX, E2M1_MAX)
    codes = round_to_e2m1_codes(q).view(n, k)
    return pack_e2m1(codes), scale_f.to(torch.float8_e4m3fn)


def quantize_nvfp4_scale2(
    w: torch.Tensor, scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to NVFP4 in nvidia-modelopt's arithmetic order.

    Args:
        w: float32 [N, K] with K a multiple of 16. Must be finite.
        scale_2: 0-dim (or 1-element) float32, dequant direction (``amax / 2688``), from
            :func:`scale_2_from_amax` over the tensor or its fused group.

    Returns:
        ``(packed, block_scale)``: packed uint8 [N, K/2] (even column in the low nibble),
        block_scale float8_e4m3fn [N, K/16]. Dequantize with
        ``e2m1(code) * float(block_scale) * scale_2``.

    Raises:
        ValueError: w is not 2-D float32 or K is not a multiple of 16.
    """
    blocks = _blocks(w, "quantize_nvfp4_scale2")
    n, k = w.shape
    s2 = scale_2.to(device=w.device, dtype=torch.float32).reshape(())
    scale_f = nvfp4_block_scale_scale2(blocks.abs().amax(dim=-1), s2)
    q = blocks / (scale_f * s2).unsqueeze(-1)
    codes = round_to_e2m1_codes(q.clamp(-E2M1_MAX, E2M1_MAX)).view(n, k)
    return pack_e2m1(codes), scale_f.to(torch.float8_e4m3fn)


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """Dequantize NVFP4 to float32.

    ``W[n, k] = e2m1(code[n, k]) * float(block_scale[n, k // 16]) / global_scale``
    (compressed-tensors direction; for ModelOpt pass ``1 / weight_scale_2``).

    Args:
        packed: uint8 [N, K/2]. block_scale: float8_e4m3fn [N, K/16]. global_scale: f32 [1].

    Returns:
        float32 [N, K].
    """
    codes = unpack_e2m1(packed).long()
    vals = E2M1_LUT.to(packed.device)[codes]
    n, k = vals.shape
    s = block_scale.to(torch.float32) / global_scale.to(packed.device, torch.float32)
    return (vals.view(n, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE) * s.unsqueeze(-1)).view(n, k)
