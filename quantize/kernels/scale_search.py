"""Better-than-round-to-nearest NVFP4 block scales: a per-block search over e4m3 scales.

This module is the plain-PyTorch reference of the search; the fused CPU (inductor) and CUDA
(Triton) kernels compute the same bytes (:mod:`quantize.kernels.fused`,
:mod:`quantize.kernels.triton_nvfp4`; tests/quantize/kernels/test_search_fused.py).

Round-to-nearest (RTN, :func:`quantize.kernels.nvfp4.quantize_nvfp4`) maps each 16-element
block's amax to the top e2m1 value 6. That is not always the scale of least error: a slightly
smaller scale clips the largest element a little and places the rest on a finer grid, and
mapping the amax to 4 instead (Four Over Six, Cook et al. 2025, arXiv 2512.02010) puts the
amax on a grid point with 3 (75 % of it) beside it, where 6 has only 4 (67 %). The search
tries, per block, the candidate e4m3 scale codes ``(target, offset)``: the code of the scale
that maps the block amax to ``target`` (6 = RTN, or 4), computed with every clamp of the
output format's order, plus ``offset`` e4m3 code steps (one step is 1/8 of a binade, about
9-12 %). It keeps the candidate of least (optionally weighted) squared error; ties keep the
earliest (the running best starts at +inf), and the first candidate is always RTN ``(6, 0)``, so with ``candidates=RTN`` the
bytes are :func:`quantize_nvfp4`'s (or :func:`quantize_nvfp4_scale2`'s). The global scale is
not searched: it is shared by a fused group and fixed by its amax; a 4-target scale above 448
(the blocks near the tensor's amax) is clamped to 448 like any other.

Score of a candidate with float32 block scale ``sf`` (the same expression, in the same order,
in every backend, so that all of them pick the same candidate): ``q = w / eff`` with the
order's divisor ``eff`` (``sf / global`` or ``sf * scale_2``, as the quantizer divides),
``d = e2m1(q) - q`` with ``e2m1(q)`` the value of the code the quantizer writes (``q``
unclamped, so clipping counts), ``e = d * d`` (times the channel weight), summed over the 16
elements as a fixed pairwise tree ((0+1)+(2+3))+..., then times ``sf * sf``. That is the
squared error ``sum (e2m1 * eff - w)^2`` divided by the block-independent ``1 / global^2``
(or ``scale_2^2``), computed in e2m1 units so that no product underflows. No step is a fused
multiply-add: the CPU reference and inductor round every product (``-ffp-contract=off``), the
Triton kernel is compiled with ``enable_fp_fusion=False``.

Weighting: with ``channel_weight[k] = E[x_k^2]`` over calibration activations, the block
error ``sum_k cw_k (dq_k - w_k)^2`` is the expected squared output error of that row's dot
product under a diagonal approximation of the activation covariance (the diagonal of the
GPTQ / OBQ Hessian ``X^T X``; Frantar et al. 2022). It is normalized to max 1 first
(:func:`normalized_channel_weight`), which changes no choice.
"""

import torch

from quantize.kernels.dtypes import E2M1_LUT, E2M1_MAX, NVFP4_GROUP_SIZE
from quantize.kernels.nvfp4 import (
    ORDERS,
    _blocks,
    dequantize_nvfp4,
    nvfp4_block_scale,
    nvfp4_block_scale_scale2,
    pack_e2m1,
    round_to_e2m1_codes,
)

__all__ = ["CANDIDATE_SETS", "DEFAULT_CANDIDATES", "FOUR_OVER_SIX", "METHOD_CANDIDATES", "RTN", "TARGETS",
           "block_errors", "check_candidates", "choose_block_scales", "normalized_channel_weight",
           "quantize_nvfp4_search"]

TARGETS = (6, 4)
"""e2m1 values a candidate maps the block amax to: 6 (round-to-nearest) or 4 (Four Over Six)."""

RTN = ((6, 0),)
"""Only the round-to-nearest scale: the bytes of the plain quantizers."""

FOUR_OVER_SIX = ((6, 0), (4, 0))
"""Cook et al. 2025: the amax to 6 or to 4, whichever errs less."""

DEFAULT_CANDIDATES = ((6, 0), (4, 0), (6, -1), (6, 1), (4, -1), (4, 1))
"""The search of ``--scales mse`` / ``mse-act``: Four Over Six plus the neighbouring codes of
both targets (chosen by measurement, scripts/bench_kernels.py --candidates; docs/formats.md
§B.0 "Block-scale search")."""

CANDIDATE_SETS = {"rtn": RTN, "4over6": FOUR_OVER_SIX, "search": DEFAULT_CANDIDATES}
"""Named candidate sets (scripts and tests)."""

METHOD_CANDIDATES = {"rtn": RTN, "4over6": FOUR_OVER_SIX, "mse": DEFAULT_CANDIDATES,
                     "mse-act": DEFAULT_CANDIDATES}
"""The candidates of each ``--scales`` method (:data:`quantize.kernels.SCALE_METHODS`);
``mse-act`` also weighs the error by calibration activations."""

_E4M3_MIN_CODE, _E4M3_MAX_CODE = 0x01, 0x7E  # smallest subnormal, 448; 0x7F is NaN
_WEIGHT_FLOOR = 2.0**-40
"""Normalized channel weights below this are 0: such a channel is 10^12 times less important
than the largest, and no product of the score can then become a float32 subnormal (which a
flush-to-zero unit would treat differently)."""


def check_candidates(candidates: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """``candidates`` as a tuple of ``(target, offset)`` int pairs, after checking that the first
    is ``(6, 0)`` (RTN, which wins ties), every target is in :data:`TARGETS` and every offset is
    within +-16 e4m3 codes.

    Raises:
        ValueError: naming the bad candidate.
    """
    out = tuple((int(t), int(o)) for t, o in candidates)
    if not out or out[0] != (6, 0):
        raise ValueError(f"the first scale candidate must be (6, 0), round-to-nearest; got {candidates}")
    for t, o in out:
        if t not in TARGETS or not -16 <= o <= 16:
            raise ValueError(f"scale candidate {(t, o)}: target must be one of {TARGETS} and the "
                             "offset within -16..16 e4m3 codes")
    return out


def normalized_channel_weight(channel_weight: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """The per-input-channel weight of the search as float32 [K] on the CPU, divided by its
    max (values in [0, 1]; below 2^-40 set to 0). None stays None; an all-zero weight gives
    all-zero (every candidate then ties and RTN is kept).

    Raises:
        ValueError: a shape other than (K,), or a negative or non-finite value.
    """
    if channel_weight is None:
        return None
    cw = channel_weight.detach().to("cpu", torch.float32)
    if cw.shape != (k,):
        raise ValueError(f"channel_weight has shape {tuple(cw.shape)}, expected ({k},)")
    if not torch.isfinite(cw).all() or (cw < 0).any():
        raise ValueError("channel_weight must be finite and >= 0 (a mean of x^2 per input channel)")
    top = cw.max()
    if top > 0:
        cw = cw / top
    return torch.where(cw < _WEIGHT_FLOOR, torch.zeros_like(cw), cw)


def _code(scale_f: torch.Tensor) -> torch.Tensor:
    """float32 values exactly representable in e4m3 -> their bytes as int32."""
    return scale_f.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)


def _value(code: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (int32, 0x01..0x7E) -> float32 values."""
    return code.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _divisor(sf: torch.Tensor, scalar: torch.Tensor, order: str) -> torch.Tensor:
    """What the quantizer of ``order`` divides a block's weights by (see nvfp4.py)."""
    return sf * scalar if order == "scale_2" else sf / scalar


def _score(blocks, sf, scalar, order, weight):
    q = blocks / _divisor(sf, scalar, order).unsqueeze(-1)
    d = E2M1_LUT.to(blocks.device)[round_to_e2m1_codes(q.clamp(-E2M1_MAX, E2M1_MAX)).long()] - q
    e = d * d
    if weight is not None:
        e = e * weight
    while e.shape[-1] > 1:  # fixed pairwise tree: the same sums in every backend
        e = e[..., 0::2] + e[..., 1::2]
    return e[..., 0] * (sf * sf)


def choose_block_scales(blocks: torch.Tensor, scalar: torch.Tensor, order: str,
                        candidates: tuple[tuple[int, int], ...] = DEFAULT_CANDIDATES,
                        weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per 16-element block, the e4m3 block scale of least score among ``candidates`` (the
    choice of :func:`quantize_nvfp4_search`; also GPTQ's, :mod:`quantize.kernels.gptq`).

    Args:
        blocks: float32 [..., 16], finite.
        scalar: float32 broadcastable to ``blocks.shape[:-1]``: the global scale of ``order``
            (quantize direction ``2688 / amax`` for ``global``, dequant direction
            ``amax / 2688`` for ``scale_2``), one per tensor, fused group or row.
        order: ``global`` or ``scale_2``.
        candidates: checked ``(target, offset)`` pairs (:func:`check_candidates`), RTN first.
        weight: float32 >= 0 broadcastable to ``blocks`` (per-element importance, used as
            given), or None.

    Returns:
        float32 ``blocks.shape[:-1]``, each exactly an e4m3 value in codes 0x01..0x7E; an
        all-zero block keeps the order's RTN scale; ties keep the earliest candidate.
    """
    block_scale = nvfp4_block_scale_scale2 if order == "scale_2" else nvfp4_block_scale
    amax = blocks.abs().amax(-1)
    base = {t: _code(block_scale(amax, scalar, float(t))) for t in {6, *(t for t, _ in candidates)}}
    if candidates == RTN:
        return _value(base[6])
    live = amax > 0
    best_code, best = base[6], torch.full_like(amax, float("inf"))
    for t, off in candidates:
        code = torch.where(live, (base[t] + off).clamp(_E4M3_MIN_CODE, _E4M3_MAX_CODE), base[6])
        score = _score(blocks, _value(code), scalar, order, weight)
        better = score < best
        best = torch.where(better, score, best)
        best_code = torch.where(better, code, best_code)
    return _value(best_code)


def quantize_nvfp4_search(w: torch.Tensor, scalar: torch.Tensor, *, order: str = "global",
                          channel_weight: torch.Tensor | None = None,
                          candidates: tuple[tuple[int, int], ...] = DEFAULT_CANDIDATES
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 with, per block, the least-error e4m3 block scale among ``candidates``.

    Args:
        w: float32 [N, K], K a multiple of 16, finite.
        scalar: the tensor's (or fused group's) global scale in ``order``: float32 [1]
            quantize direction ``2688 / amax`` for ``global`` (compressed-tensors), 0-dim
            float32 dequant direction ``amax / 2688`` for ``scale_2`` (nvidia-modelopt).
        order: ``global`` or ``scale_2`` (:data:`quantize.kernels.nvfp4.ORDERS`).
        channel_weight: optional float32 [K] >= 0, the importance of each input channel
            (calibration mean of x^2); None weighs every element equally.
        candidates: ``(target, offset)`` pairs, see the module docstring and
            :func:`check_candidates`. Codes are kept in [0x01, 0x7E] so no scale is zero,
            negative or NaN (FC-11); all-zero blocks keep the RTN scale (0.125 in ``global``
            order, 1.0 in ``scale_2``).

    Returns:
        ``(packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16])``, dequantized like the
        order's RTN output. With ``candidates=RTN`` the bytes equal :func:`quantize_nvfp4`'s
        (``scale_2``: :func:`quantize_nvfp4_scale2`'s); per block the score never exceeds RTN's.

    Raises:
        ValueError: as :func:`quantize_nvfp4`; an unknown order; bad candidates; a
            ``channel_weight`` of the wrong shape or with negative / non-finite values.
    """
    if order not in ORDERS:
        raise ValueError(f"order {order!r} is not one of {', '.join(ORDERS)}")
    candidates = check_candidates(candidates)
    blocks = _blocks(w, "quantize_nvfp4_search")
    n, k = w.shape
    s = scalar.to(device=w.device, dtype=torch.float32).reshape(() if order == "scale_2" else (1,))
    cw = normalized_channel_weight(channel_weight, k)
    weight = None if cw is None else cw.to(w.device).view(1, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    sf = choose_block_scales(blocks, s, order, candidates, weight)
    q = blocks / _divisor(sf, s, order).unsqueeze(-1)
    codes = round_to_e2m1_codes(q.clamp(-E2M1_MAX, E2M1_MAX)).view(n, k)
    return pack_e2m1(codes), sf.to(torch.float8_e4m3fn)


def block_errors(w: torch.Tensor, packed_scale: tuple[torch.Tensor, torch.Tensor], global_scale: torch.Tensor,
                 channel_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-block (weighted) squared reconstruction error of an NVFP4 encoding of ``w``.

    Args:
        w: float32 [N, K]. packed_scale: (packed u8 [N, K/2], block scale e4m3 [N, K/16]).
        global_scale: float32 [1], quantize direction (for a ``scale_2`` encoding pass
            ``1 / scale_2``). channel_weight: float32 [K] (used as given) or None.

    Returns:
        float32 [N, K/16].
    """
    n, k = w.shape
    d = dequantize_nvfp4(packed_scale[0], packed_scale[1], global_scale) - w
    sq = (d * d).view(n, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    if channel_weight is not None:
        sq = sq * channel_weight.to(w.device, torch.float32).view(1, -1, NVFP4_GROUP_SIZE)
    return sq.sum(-1)
