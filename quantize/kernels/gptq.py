"""GPTQ for NVFP4: error-compensating quantization of a weight against a Hessian of its inputs.

GPTQ (Frantar et al. 2022, arXiv 2210.17323) quantizes the columns of ``W [R, K]`` one at a
time and moves each column's rounding error onto the columns not yet quantized, weighted by
the inverse Hessian ``H = 2/n X^T X`` of the calibration inputs ``X [n, K]``, so that
``|X W^T - X Wq^T|^2`` is small rather than ``|W - Wq|^2``. Here, as in the paper:

- damping ``H += damp * mean(diag H) * I`` (default 1 %); an input channel no token ever
  reached (``H[k, k] == 0``) gets ``H[k, k] = 1``: its column is quantized like RTN and
  moves no error (its weight is kept, not zeroed);
- the upper Cholesky factor of ``H^-1``, and blocked lazy updates: columns are processed in
  blocks of ``block`` (128), the errors of a block applied to the rest of the matrix once per
  block (inside a block: eagerly within each 16-column group, once per group beyond it);
- optional activation order (``act_order``): columns taken by decreasing ``H[k, k]``. NVFP4
  blocks of 16 columns share one scale, so the order is taken group-wise: the 16-column
  groups by decreasing sum of their diagonal, and the columns inside a group by decreasing
  diagonal; a group's columns stay together and every group sits inside one block.

NVFP4 specifics (MR-GPTQ, Egiazarian et al. 2025, arXiv 2509.23202): the per-tensor scalar
(global scale / ``scale_2``) is fixed before GPTQ from the amax of the original weight (of
the whole fused group); then, when GPTQ reaches a 16-column group, its e4m3 block scale per
row is chosen from the current (error-updated) weights of those 16 columns: round-to-nearest
(``rtn``, as :func:`quantize.kernels.nvfp4.quantize_nvfp4`) or the least-error search over
the candidates of ``--scales mse`` (``mse``, the choice of
:func:`quantize.kernels.scale_search.quantize_nvfp4_search`, scored the same way; ``mse-act``
weighs each column's squared error by ``H[k, k]``). The columns are then rounded to e2m1 against that
scale, in the arithmetic order of the output format (``global``: ``x / (s / g)``,
compressed-tensors; ``scale_2``: ``x / (s * s2)``, ModelOpt), so the codes, the block scales
and the scalar are exactly what the writer stores.

With ``H`` a multiple of the identity no error moves and the result equals the block-scale
method alone byte for byte (:func:`quantize_nvfp4_rows`); a huge damping gives the same bytes.
"""

import torch

from quantize.kernels.dtypes import E2M1_LUT, E2M1_MAX, NVFP4_GROUP_SIZE
from quantize.kernels.nvfp4 import pack_e2m1, round_to_e2m1_codes
from quantize.kernels.scale_search import METHOD_CANDIDATES, choose_block_scales

__all__ = ["GPTQ_SCALES", "ORDERS", "gptq_nvfp4", "quantize_nvfp4_rows"]

ORDERS = ("global", "scale_2")
"""NVFP4 arithmetic orders: compressed-tensors (quantize-direction global scale g, unit
``s / g``) and ModelOpt (dequant-direction ``scale_2``, unit ``s * scale_2``)."""

GPTQ_SCALES = ("rtn", "mse", "mse-act")
"""Block-scale choice inside GPTQ: round-to-nearest, the least-error search, the search
weighted by the Hessian diagonal; the candidates of each are those of the ``--scales`` method
of the same name (:data:`quantize.kernels.scale_search.METHOD_CANDIDATES`)."""


def _unit(scale: torch.Tensor, scalar: torch.Tensor, order: str) -> torch.Tensor:
    """Dequantized value of e2m1 1.0 for float32 block scales ``scale`` and per-row scalars."""
    return scale / scalar if order == "global" else scale * scalar


def _round(x: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of ``x`` against ``unit`` (broadcast), as the writers' kernels round."""
    return round_to_e2m1_codes(torch.clamp(x / unit, -E2M1_MAX, E2M1_MAX))


def _block_scales(blocks: torch.Tensor, scalar: torch.Tensor, order: str, method: str,
                  weight: torch.Tensor | None) -> torch.Tensor:
    """float32 e4m3 block scales of the 16-element ``blocks`` by ``method`` (:data:`GPTQ_SCALES`):
    :func:`quantize.kernels.scale_search.choose_block_scales` with that method's candidates,
    ``weight`` (the Hessian diagonal per column) used by ``mse-act`` only. ``rtn`` gives the
    block scales of ``quantize_nvfp4`` / ``quantize_nvfp4_scale2``."""
    return choose_block_scales(blocks, scalar, order, METHOD_CANDIDATES[method],
                               weight if method == "mse-act" else None)


def _check(w: torch.Tensor, scalar: torch.Tensor, order: str, scales: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"unknown NVFP4 order {order!r} (valid: {', '.join(ORDERS)})")
    if scales not in GPTQ_SCALES:
        raise ValueError(f"unknown block-scale method {scales!r} (valid: {', '.join(GPTQ_SCALES)})")
    if w.ndim != 3 or w.dtype != torch.float32:
        raise ValueError(f"GPTQ needs a float32 [B, R, K] weight, got {w.dtype} {tuple(w.shape)}")
    if w.shape[-1] % NVFP4_GROUP_SIZE:
        raise ValueError(f"K={w.shape[-1]} is not a multiple of the NVFP4 group size {NVFP4_GROUP_SIZE}")
    if scalar.shape != w.shape[:2]:
        raise ValueError(f"scalar has shape {tuple(scalar.shape)}, expected per row {tuple(w.shape[:2])}")


def _finish(codes: torch.Tensor, scale: torch.Tensor, scalar: torch.Tensor, order: str):
    b, r, k = codes.shape
    unit = _unit(scale, scalar.unsqueeze(-1), order)
    deq = (E2M1_LUT.to(codes.device)[codes.long()].view(b, r, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
           * unit.unsqueeze(-1)).view(b, r, k)
    return pack_e2m1(codes), scale.to(torch.float8_e4m3fn), deq


def quantize_nvfp4_rows(w: torch.Tensor, scalar: torch.Tensor, *, order: str = "global",
                        scales: str = "rtn", weight: torch.Tensor | None = None):
    """NVFP4 without a Hessian (the GPTQ fallback): every block scale from ``w`` itself.

    Args:
        w: float32 [B, R, K]. scalar: float32 [B, R] (each row's tensor or fused-group scalar,
            in ``order``'s direction). weight: float32 [B, K] for ``mse-act``, or None.

    Returns:
        ``(packed uint8 [B, R, K/2], block_scale float8_e4m3fn [B, R, K/16], dequantized
        float32 [B, R, K])``; with ``scales="rtn"`` the bytes equal ``quantize_nvfp4`` /
        ``quantize_nvfp4_scale2`` of each [R, K] slice.
    """
    _check(w, scalar, order, scales)
    b, r, k = w.shape
    blocks = w.view(b, r, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    wt = weight.view(b, 1, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE) if weight is not None else None
    s = _block_scales(blocks, scalar.unsqueeze(-1), order, scales, wt)
    codes = _round(blocks, _unit(s, scalar.unsqueeze(-1), order).unsqueeze(-1)).view(b, r, k)
    return _finish(codes, s, scalar, order)


def _inverse_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, list[float]]:
    """Upper Cholesky factor of ``(H + damp * mean(diag) I)^-1`` per batch element; a Hessian
    that is not positive definite at ``damp`` is retried at 10x, up to 4 times."""
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    mean = h.diagonal(dim1=-2, dim2=-1).mean(-1)
    used = torch.full((h.shape[0],), float(damp), dtype=torch.float64, device=h.device)
    out = torch.empty_like(h)
    todo = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    for _ in range(5):
        hd = h[todo] + (used[todo].to(h.dtype) * mean[todo])[:, None, None] * eye
        low, info = torch.linalg.cholesky_ex(hd)
        up, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(low), upper=True)
        ok = (info == 0) & (info2 == 0)
        idx = todo.nonzero().flatten()
        out[idx[ok]] = up[ok]
        todo[idx[ok]] = False
        if not bool(todo.any()):
            return out, used.tolist()
        used[todo] *= 10
    raise ValueError(f"GPTQ: Hessian of batch element(s) {todo.nonzero().flatten().tolist()[:5]} is not "
                     f"positive definite even with damping {used.max().item():g} x mean diagonal")


def _sub_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out -= a @ b`` in place (batched; the 2-D GEMM when the batch is 1, much faster on CPU)."""
    if out.shape[0] == 1:
        out[0].addmm_(a[0], b[0], alpha=-1)
    else:
        out.baddbmm_(a, b, alpha=-1)


def gptq_nvfp4(w: torch.Tensor, h: torch.Tensor, scalar: torch.Tensor, *, order: str = "global",
               damp: float = 0.01, act_order: bool = False, block: int = 128,
               scales: str = "rtn") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    """GPTQ-quantize a batch of weights to NVFP4 (see the module docstring).

    Args:
        w: float32 [B, R, K], K a multiple of 16, finite: B independent problems (experts),
            each R rows that share one Hessian (e.g. gate and up of one expert concatenated;
            rows are independent given H).
        h: float32 [B, K, K], symmetric positive semi-definite (``X^T X`` up to a positive
            factor: GPTQ is invariant to the scale of H, damping is relative).
        scalar: float32 [B, R], the per-row NVFP4 scalar of the row's tensor / fused group
            (order ``global``: ``2688 / amax``; ``scale_2``: ``amax / 2688``), fixed before
            GPTQ from the original weights.
        order: ``global`` (compressed-tensors) or ``scale_2`` (ModelOpt).
        damp: fraction of the mean Hessian diagonal added to the diagonal (> 0).
        act_order: process 16-column groups (and columns in them) by decreasing H diagonal.
        block: columns per lazy-update block, a multiple of 16.
        scales: block-scale method, one of :data:`GPTQ_SCALES`.

    Returns:
        ``(packed uint8 [B, R, K/2] (even column in the low nibble), block_scale
        float8_e4m3fn [B, R, K/16], dequantized float32 [B, R, K] (``e2m1 * unit``, the
        values an engine computes), damping used per batch element)``.

    Raises:
        ValueError: bad shapes, dtype, order or method; damp <= 0; block not a multiple of
            16; a Hessian not positive definite even at 10^4 x ``damp``.
    """
    _check(w, scalar, order, scales)
    if not damp > 0:
        raise ValueError(f"GPTQ damping must be > 0, got {damp}")
    if block <= 0 or block % NVFP4_GROUP_SIZE:
        raise ValueError(f"GPTQ block must be a positive multiple of {NVFP4_GROUP_SIZE}, got {block}")
    b, r, k = w.shape
    if h.shape != (b, k, k) or h.dtype != torch.float32:
        raise ValueError(f"Hessian must be float32 {(b, k, k)}, got {h.dtype} {tuple(h.shape)}")
    gs, ng = NVFP4_GROUP_SIZE, k // NVFP4_GROUP_SIZE
    h = h.clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    diag[diag == 0] = 1.0  # dead input channel: its column moves no error (row/column are zero)
    W = w.clone()
    perm = gperm = None
    if act_order:
        d = diag.reshape(b, ng, gs)
        gperm = torch.argsort(d.sum(-1), dim=-1, descending=True, stable=True)  # [B, G]
        within = torch.argsort(d, dim=-1, descending=True, stable=True)  # [B, G, 16]
        within = torch.gather(within, 1, gperm.unsqueeze(-1).expand(b, ng, gs))
        perm = (gperm.unsqueeze(-1) * gs + within).reshape(b, k)
        W = torch.gather(W, 2, perm.unsqueeze(1).expand(b, r, k))
        h = torch.gather(h, 1, perm.unsqueeze(-1).expand(b, k, k))
        h = torch.gather(h, 2, perm.unsqueeze(1).expand(b, k, k))
        diag = h.diagonal(dim1=-2, dim2=-1)
    col_weight = diag.clone().unsqueeze(1)  # [B, 1, K] for mse-act (undamped, permuted)
    hinv, used = _inverse_factor(h, damp)
    del h
    codes = torch.empty((b, r, k), dtype=torch.uint8, device=W.device)
    scale = torch.empty((b, r, ng), dtype=torch.float32, device=W.device)
    lut = E2M1_LUT.to(W.device)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, :, i1:i2].clone()
        err1 = torch.zeros_like(W1)
        h1 = hinv[:, i1:i2, i1:i2]
        for g1 in range(0, i2 - i1, gs):  # one NVFP4 group: its block scale from the current weights
            g2 = g1 + gs
            wg = W1[:, :, g1:g2]
            s = _block_scales(wg, scalar, order, scales, col_weight[:, :, i1 + g1:i1 + g2])
            scale[:, :, (i1 + g1) // gs] = s
            unit = _unit(s, scalar, order)
            for i in range(gs):
                col = wg[:, :, i]
                c = _round(col, unit)
                codes[:, :, i1 + g1 + i] = c
                e = (col - lut[c.long()] * unit) / h1[:, g1 + i, g1 + i].unsqueeze(-1)
                if i + 1 < gs:  # eager inside the group, lazy beyond it (the same sums, in blocks)
                    wg[:, :, i + 1:].addcmul_(e.unsqueeze(-1), h1[:, g1 + i, g1 + i + 1:g2].unsqueeze(1), value=-1)
                err1[:, :, g1 + i] = e
            if g2 < i2 - i1:
                _sub_product(W1[:, :, g2:], err1[:, :, g1:g2], h1[:, g1:g2, g2:])
        if i2 < k:
            _sub_product(W[:, :, i2:], err1, hinv[:, i1:i2, i2:])
    if act_order:  # back to the original column order
        codes = torch.empty_like(codes).scatter_(2, perm.unsqueeze(1).expand(b, r, k), codes)
        scale = torch.empty_like(scale).scatter_(2, gperm.unsqueeze(1).expand(b, r, ng), scale)
    packed, block_scale, deq = _finish(codes, scale, scalar, order)
    return packed, block_scale, deq, used
