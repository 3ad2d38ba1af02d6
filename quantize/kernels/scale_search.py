"""Better-than-round-to-nearest NVFP4 block scales: a per-block search over e4m3 scales.

Round-to-nearest (RTN, :func:`quantize.kernels.nvfp4.quantize_nvfp4`) maps each 16-element
block's amax to the top e2m1 value 6. That is not the scale of least error: a slightly
smaller scale clips the largest element a little and places the rest on a finer grid. This
kernel tries, for every block, the e4m3 scale codes ``rtn_code + d`` for ``d`` in
``offsets`` (one e4m3 code step is 1/8 of a binade, about 9-12 %), quantizes the block
against each, and keeps the scale whose dequantized block has the least (optionally
weighted) squared error; ties keep the earliest offset, so offset 0 (RTN) wins unless
another candidate is strictly better. The global scale is not searched: it is shared by a
fused group and fixed by its amax.

Weighting: with ``channel_weight[k] = E[x_k^2]`` over calibration activations, the block
error ``sum_k w_k (dq_k - w_k)^2`` is the expected squared output error of that row's dot
product under a diagonal approximation of the activation covariance (the diagonal of the
GPTQ / OBQ Hessian ``X^T X``; Frantar et al. 2022).
"""

import torch

from quantize.kernels.dtypes import E2M1_LUT, E2M1_MAX, NVFP4_GROUP_SIZE
from quantize.kernels.nvfp4 import pack_e2m1, quantize_nvfp4, round_to_e2m1_codes

__all__ = ["DEFAULT_OFFSETS", "quantize_nvfp4_search", "block_errors"]

DEFAULT_OFFSETS = (0, -1, -2, -3, -4, 1, 2)
"""Candidate e4m3 code offsets from the RTN block scale, RTN first (scales about x0.6 to
x1.25). On Gaussian weights the chosen offsets fall in -3 .. +2, never below -4."""

_E4M3_MIN_CODE, _E4M3_MAX_CODE = 0x01, 0x7E  # smallest subnormal, 448; 0x7F is NaN


def _quantize_blocks(blocks: torch.Tensor, scale: torch.Tensor, g: torch.Tensor):
    """Codes [N, B, 16] and dequantized values for float32 block scales ``scale`` [N, B]."""
    eff = (scale / g).unsqueeze(-1)
    codes = round_to_e2m1_codes(torch.clamp(blocks / eff, -E2M1_MAX, E2M1_MAX))
    return codes, E2M1_LUT.to(blocks.device)[codes.long()] * eff


def block_errors(w: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor], global_scale: torch.Tensor,
                 channel_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-block (weighted) squared reconstruction error of an NVFP4 encoding of ``w``.

    Args:
        w: float32 [N, K]. packed_scale: (packed u8 [N, K/2], block scale e4m3 [N, K/16]).
        global_scale: float32 [1] (quantize direction). channel_weight: float32 [K] or None.

    Returns:
        float32 [N, K/16].
    """
    from quantize.kernels.nvfp4 import dequantize_nvfp4

    n, k = w.shape
    d = dequantize_nvfp4(packed_scale[0], packed_scale[1], global_scale) - w
    sq = (d * d).view(n, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    if channel_weight is not None:
        sq = sq * channel_weight.to(w.device, torch.float32).view(1, -1, NVFP4_GROUP_SIZE)
    return sq.sum(-1)


def quantize_nvfp4_search(w: torch.Tensor, global_scale: torch.Tensor, *,
                          channel_weight: torch.Tensor | None = None,
                          offsets: tuple[int, ...] = DEFAULT_OFFSETS) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 with the least-error e4m3 block scale among ``rtn_code + offsets``.

    Args:
        w: float32 [N, K], K a multiple of 16, finite.
        global_scale: float32 [1], quantize direction (2688 / amax of the tensor or its
            fused group), exactly as for :func:`quantize_nvfp4`.
        channel_weight: optional float32 [K] >= 0, the importance of each input channel
            (calibration mean of x^2); None weighs every element equally.
        offsets: e4m3 code offsets tried; must contain 0. Codes are kept in [0x01, 0x7E] so
            no scale is zero, negative or NaN (FC-11); all-zero blocks keep the RTN scale.

    Returns:
        ``(packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16])``, dequantized like
        RTN output (``e2m1 * block_scale / global_scale``). With ``offsets=(0,)`` the bytes
        equal :func:`quantize_nvfp4`'s; per block the error never exceeds RTN's.

    Raises:
        ValueError: as :func:`quantize_nvfp4`; ``offsets`` without 0; a ``channel_weight``
            of the wrong shape.
    """
    if 0 not in offsets:
        raise ValueError(f"offsets must include 0 (the RTN scale), got {offsets}")
    _, rtn_scale = quantize_nvfp4(w, global_scale)  # validates w
    n, k = w.shape
    nb = k // NVFP4_GROUP_SIZE
    g = global_scale.to(device=w.device, dtype=torch.float32)
    blocks = w.view(n, nb, NVFP4_GROUP_SIZE)
    if channel_weight is not None:
        if channel_weight.shape != (k,):
            raise ValueError(f"channel_weight has shape {tuple(channel_weight.shape)}, expected ({k},)")
        weight = channel_weight.to(w.device, torch.float32).view(1, nb, NVFP4_GROUP_SIZE)
    else:
        weight = None
    code0 = rtn_scale.view(torch.uint8).to(torch.int16)
    live = blocks.abs().amax(-1) > 0
    best_err = torch.full((n, nb), float("inf"), device=w.device)
    best_code = code0.clone()
    for d in (0, *[o for o in offsets if o != 0]):
        code = torch.where(live, (code0 + d).clamp(_E4M3_MIN_CODE, _E4M3_MAX_CODE), code0)
        scale = code.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        _, deq = _quantize_blocks(blocks, scale, g)
        sq = (deq - blocks) ** 2
        err = (sq * weight if weight is not None else sq).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_code = torch.where(better, code, best_code)
    scale_e4m3 = best_code.to(torch.uint8).view(torch.float8_e4m3fn)
    codes, _ = _quantize_blocks(blocks, scale_e4m3.to(torch.float32), g)
    return pack_e2m1(codes.view(n, k)), scale_e4m3
