"""Fast NVFP4 quantization: FP8 decode -> block scale -> e2m1 codes -> packing in one pass.

Three backends compute the same bytes (tests/quantize/kernels/test_fused.py):

- ``reference``: the plain-PyTorch path, :func:`dequantize_fp8_block` then
  :func:`quantize_nvfp4` on the float32 weight. It is the specification the others are tested
  against, and the fallback where no compiler is available.
- ``inductor`` (CPU): the same arithmetic as four ``torch.compile`` graphs that inductor turns
  into vectorized C++/OpenMP loops: block amax (when the weight is read), then block scales
  (on 1/16 of the elements), codes, packing. The weight never exists in float32: each
  16-element block is decoded from its e4m3 bytes, scaled, reduced and coded in registers.
- ``triton`` (CUDA): one Triton kernel, :mod:`quantize.kernels.triton_nvfp4`.

How the fast paths stay bit-exact with the reference (every step is an IEEE-754 float32
operation in the same order, or an exact rewrite of one):

- e4m3 bytes decode exactly by bit manipulation (:func:`decode_e4m3`).
- Block amax: rounding is monotonic, so ``max_i |fl(x_i * s)| = fl(max_i |x_i| * |s|)``,
  and ``|x_i|`` grows with the e4m3 byte's magnitude bits, so the fast path reduces the bytes
  and decodes and multiplies once per block.
- Block scales come from the reference's own :func:`nvfp4_block_scale` (compressed-tensors
  order) or :func:`nvfp4_block_scale_scale2` (nvidia-modelopt order), with 6 passed as a
  tensor so no compiler rewrites ``/ 6`` as ``* (1/6)``.
- Codes: :func:`e2m1_codes` rounds ``|q| * 2^k`` half-to-even inside each binade, which is the
  reference's threshold table (ties to the even code) written with three comparisons instead of
  seven; the clamp to +-6 is not needed because both saturate at code 7.
- Packing: four codes are one little-endian int32 ``v``; ``v | v >> 4`` puts ``lo | hi << 4``
  of each pair in its low byte, and the two pair bytes are gathered into an int16.

Shapes: weight float8_e4m3fn [N, K] with a multiplier scale grid [ceil(N/bh), ceil(K/bw)]
(DeepSeek-V3 ``weight_scale_inv``; per-tensor, per-channel and per-group FP8 scales are the
grids of blocks (N, K), (1, K) and (1, g)), K a multiple of 16. Nothing here knows tensor or
format names.
"""

import functools
import os
import shutil
import sys

import torch

from quantize.kernels import BACKENDS
from quantize.kernels.dtypes import NVFP4_GROUP_SIZE
from quantize.kernels.fp8 import dequantize_fp8_block
from quantize.kernels.nvfp4 import (
    ORDERS,
    nvfp4_block_scale,
    nvfp4_block_scale_scale2,
    quantize_nvfp4,
    quantize_nvfp4_scale2,
)
from quantize.kernels.prepared import Prepared
from quantize.kernels.scale_search import (
    RTN,
    check_candidates,
    normalized_channel_weight,
    quantize_nvfp4_search,
)

__all__ = ["BACKENDS", "MIN_COMPILED_ELEMENTS", "ORDERS", "Prepared", "choose_backend",
           "compiled_graphs", "decode_e4m3", "e2m1_codes", "prepare_float", "prepare_fp8", "warm_up"]

MIN_COMPILED_ELEMENTS = 1 << 20
"""With ``auto``, smaller weights use the reference: compiling costs seconds once per process,
more than a small weight takes to quantize."""

_G = NVFP4_GROUP_SIZE


# ---- arithmetic shared by the compiled graphs (plain tensor ops, exact) ------------------------

def decode_e4m3(b: torch.Tensor, nan_codes: bool = False) -> torch.Tensor:
    """float8_e4m3fn byte values (any integer dtype, 0..255) -> float32, exactly.

    Normal codes become float32 bits ``(mag << 20) + (120 << 23)`` (exponent bias 7 -> 127);
    subnormals (exponent 0) are ``m * 2^-9``. With ``nan_codes``, 0x7F / 0xFF give NaN, else
    they decode as 480 (callers that have already checked for NaN skip the extra select).
    """
    b = b.to(torch.int32)
    mag = b & 0x7F
    v = torch.where(mag < 8, mag.to(torch.float32) * 2.0**-9,
                    ((mag << 20) + (120 << 23)).view(torch.float32))
    if nan_codes:
        v = torch.where(mag == 0x7F, float("nan"), v)
    return torch.where(b >= 0x80, -v, v)


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Round float32 ``q`` (already divided by its scale) to e2m1 codes, uint8 0..15.

    Equal to :func:`quantize.kernels.nvfp4.round_to_e2m1_codes` of ``clamp(q, -6, 6)``: within
    [0, 2) the e2m1 grid step is 1/2, within [2, 4) 1, from 4 on 2, so the code is
    ``round_half_even(|q| * 2^k) + base`` per range, saturated at 7; the sign bit is set for
    every strictly negative q (so -tiny gives code 8, -0.0 gives 0).
    """
    a = q.abs()
    lt2, lt4 = a < 2.0, a < 4.0
    mult = torch.where(lt2, 2.0, torch.where(lt4, 1.0, 0.5))
    base = torch.where(lt2, 0.0, torch.where(lt4, 2.0, 4.0))
    code = torch.clamp(torch.round(a * mult) + base, max=7.0) + torch.where(q < 0, 8.0, 0.0)
    return code.to(torch.uint8)


def _fp8_block_amax(xu: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # xu uint8 [Nb, bh, Kb, bw/16, 16]; s float32 [Nb, Kb] -> float32 [Nb, bh, Kb, bw/16].
    # |decoded e4m3| grows with the byte's low 7 bits and 0x7F is NaN, so the block's largest
    # magnitude code, decoded once, is its amax (NaN when it holds one); the max is taken on
    # int16 lanes (measured fastest of int16 / int32 / float32 / uint8 with inductor).
    mag = (xu.to(torch.int16) & 0x7F).amax(-1)
    return decode_e4m3(mag.to(torch.int32), nan_codes=True) * s[:, None, :, None].abs()


def _block_scales(block_amax, scalar, six, order: str):
    """(e4m3 block scales, the float32 divisor of each block's weights) in either order.

    A graph of its own, on 1/16 of the elements: fused into the codes loop, the scalar e4m3
    rounding of each block's scale costs more than the 16 codes it serves."""
    if order == "scale_2":
        sf = nvfp4_block_scale_scale2(block_amax, scalar, six)
        eff = sf * scalar
    else:
        sf = nvfp4_block_scale(block_amax, scalar, six)
        eff = sf / scalar
    return sf.to(torch.float8_e4m3fn), eff


def encode_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Positive float32 values exactly representable in e4m3 -> their bytes as int32 (the
    inverse of :func:`decode_e4m3`): ``v * 2^9`` below 2^-6 (subnormals), else the float32
    exponent and top 3 mantissa bits, ``(bits >> 20) - (120 << 3)``."""
    return torch.where(v < 2.0**-6, (v * 512.0).to(torch.int32), (v.view(torch.int32) >> 20) - (120 << 3))


def e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """The e2m1 value (float32, sign of q) of the code :func:`e2m1_codes` gives ``q``:
    ``min(round_half_even(|q| * 2^k) / 2^k, 6)`` with the same binade factor ``2^k``, so equal
    to ``E2M1_LUT[e2m1_codes(q)]`` (a negative q that rounds to zero gives -0.0)."""
    a = q.abs()
    lt2, lt4 = a < 2.0, a < 4.0
    mult = torch.where(lt2, 2.0, torch.where(lt4, 1.0, 0.5))
    inv = torch.where(lt2, 0.5, torch.where(lt4, 1.0, 2.0))
    v = torch.clamp(torch.round(a * mult) * inv, max=6.0)
    return torch.where(q < 0, -v, v)


def _search_bases(block_amax, scalar, six, four, order: str):
    """e4m3 bytes (int32) of the scales mapping each block amax to 6 (RTN) and to 4."""
    fn = nvfp4_block_scale_scale2 if order == "scale_2" else nvfp4_block_scale
    return encode_e4m3(fn(block_amax, scalar, six)), encode_e4m3(fn(block_amax, scalar, four))


def _search_step(wt_, cw, block_amax, c6, c4, is_four, off, scalar, best, best_code, order: str):
    """Score one candidate ``(4 if is_four else 6, off)`` of every block (kernels/scale_search.py,
    same arithmetic) and keep it where it errs strictly less than ``best``.

    ``wt_`` float32 [16, ...]: the weights element-major, so that the pairwise tree over the 16
    elements adds whole vectors of blocks; ``cw`` the normalized channel weight broadcastable
    to it, or None; ``block_amax``, ``c6``, ``c4``, ``best``, ``best_code`` [...];
    ``is_four`` and ``off`` 0-dim int32 (tensors, so that one compiled graph serves every
    candidate)."""
    code = torch.where(block_amax > 0, torch.clamp(torch.where(is_four != 0, c4, c6) + off, 0x01, 0x7E), c6)
    sf = decode_e4m3(code)
    q = wt_ / (sf * scalar if order == "scale_2" else sf / scalar)
    d = e2m1_round(q) - q
    e = d * d
    if cw is not None:
        e = e * cw
    while e.shape[0] > 1:
        e = e[0::2] + e[1::2]
    score = e[0] * (sf * sf)
    better = score < best
    return torch.where(better, score, best), torch.where(better, code, best_code)


def _search_final(best_code, scalar, order: str):
    sf = decode_e4m3(best_code)
    eff = sf * scalar if order == "scale_2" else sf / scalar
    return sf.to(torch.float8_e4m3fn), eff


def _fp8_weights_t(xu, s):
    # xu uint8 [Nb, bh, Kb, bw/16, 16] -> float32 [16, Nb, bh, Kb, bw/16]
    return (decode_e4m3(xu) * s[:, None, :, None, None]).movedim(-1, 0).contiguous()


def _float_weights_t(x):
    # x float [M, 16] -> float32 [16, M]
    return x.to(torch.float32).movedim(-1, 0).contiguous()


def _search(wt_, cw, block_amax, scalar, order, candidates):
    """The search over ``candidates`` as one compiled graph per step (see _search_step)."""
    c6, c4 = _run("search_bases", block_amax, scalar, _SIX, _FOUR, order)
    best = torch.full_like(block_amax, float("inf"))
    best_code = c6
    for t, off in candidates:
        best, best_code = _run("search_step", wt_, cw, block_amax, c6, c4,
                               torch.tensor(int(t == 4), dtype=torch.int32),
                               torch.tensor(off, dtype=torch.int32), scalar, best, best_code, order)
    return _run("search_final", best_code, scalar, order)


def _fp8_codes(xu, s, eff):
    # xu uint8 [Nb, bh, Kb, bw/16, 16]; s float32 [Nb, Kb]; eff float32 [Nb, bh, Kb, bw/16]
    w = decode_e4m3(xu) * s[:, None, :, None, None]
    return e2m1_codes(w / eff[..., None])


def _float_block_amax(x: torch.Tensor) -> torch.Tensor:
    # x float [M, 16] -> float32 [M]
    return x.to(torch.float32).abs().amax(-1)


def _float_codes(x, eff):
    return e2m1_codes(x.to(torch.float32) / eff[..., None])


def _pack_pairs(c32: torch.Tensor) -> torch.Tensor:
    # int32 view of codes [..., K/4] (codes c0..c3 in bytes 0..3, little-endian) -> int16
    # [..., K/4] holding the bytes c0 | c1 << 4 and c2 | c3 << 4: v | v >> 4 puts each odd
    # code beside the even one below it (int32 lanes vectorize; int16 ones do not).
    v = c32 | (c32 >> 4)
    return ((v & 0xFF) | ((v >> 8) & 0xFF00)).to(torch.int16)


@functools.cache
def _compiled(name: str):
    """One graph, compiled on first call. ``cpp.dynamic_threads``: the C++ loops size their
    OpenMP team when they run (``omp_get_max_threads()`` of the calling thread) instead of
    baking the compiling process's thread count in, so one compiled kernel (inductor's disk
    cache) serves processes of any thread count: worker processes of ``--workers N`` load what
    the first compiled (quantize/convert/parallel.py), and a kernel cached by a 16-thread
    process never runs 16-wide in a 2-core worker."""
    fn = {"fp8_block_amax": _fp8_block_amax, "block_scales": _block_scales,
          "fp8_codes": _fp8_codes, "float_block_amax": _float_block_amax,
          "float_codes": _float_codes, "pack_pairs": _pack_pairs, "search_bases": _search_bases,
          "search_step": _search_step, "search_final": _search_final,
          "fp8_weights_t": _fp8_weights_t, "float_weights_t": _float_weights_t}[name]
    return torch.compile(fn, dynamic=False, options={"cpp.dynamic_threads": True})


def warm_up(order: str = "global") -> None:
    """Compile (or load from inductor's disk cache) the graphs a block-FP8 weight runs
    through in ``order`` (:data:`ORDERS`), on a 256x512 weight of 128x128 blocks: every
    dimension dynamic (none of size 1), so the graphs serve every weight shape of that block
    layout. Float sources compile their two graphs on first use."""
    w = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    _InductorFp8(w, torch.ones(2, 4), (128, 128), order, _Search(RTN, None, 512)).quantize(torch.ones(()))


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has traced in this process so far (dynamo's count of unique
    graphs): a graph compiled, loaded from inductor's disk cache, or compiled again because a
    guard failed counts once more each time; 0 before the first. After :func:`warm_up` the
    weights of its block layout add none."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def _run(name: str, *args):
    """Call a compiled graph with every dimension but the last of its tensors dynamic, so one
    compilation serves every weight shape (the last, 16-wide dimension is what vectorizes).
    Non-tensor arguments (the order) are constants of the graph."""
    for t in args:
        if isinstance(t, torch.Tensor) and t.ndim >= 1 and t.numel() > 1:
            for d in range(t.ndim - (1 if t.shape[-1] == _G else 0)):
                torch._dynamo.maybe_mark_dynamic(t, d)
    return _compiled(name)(*args)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return _run("pack_pairs", codes.contiguous().view(torch.int32)).view(torch.uint8).view(n, k // 2)


# ---- backend choice --------------------------------------------------------------------------

def _has_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(requested: str, device: torch.device, numel: int | None = None) -> str:
    """The backend that quantizes a weight of ``numel`` elements on ``device``.

    ``auto`` picks ``triton`` on CUDA, ``inductor`` on CPU when a C++ compiler is on PATH and
    the weight has at least :data:`MIN_COMPILED_ELEMENTS` elements, else ``reference``.

    Raises:
        ValueError: an unknown name, or a backend that cannot run on ``device``.
    """
    if requested not in BACKENDS:
        raise ValueError(f"kernel {requested!r} is not one of {', '.join(BACKENDS)}")
    cuda = device.type == "cuda"
    if requested == "auto":
        if cuda:
            return "triton" if _has_triton() else "reference"
        if sys.byteorder == "little" and _has_cxx() and (numel is None or numel >= MIN_COMPILED_ELEMENTS):
            return "inductor"
        return "reference"
    if requested == "triton" and not (cuda and _has_triton()):
        raise ValueError("kernel 'triton' needs a CUDA device and the triton package")
    if requested == "inductor" and cuda:
        raise ValueError("kernel 'inductor' is the CPU path; use 'triton' on CUDA")
    if requested == "inductor" and sys.byteorder != "little":
        raise ValueError("kernel 'inductor' packs codes through little-endian int16 views")
    return requested


# ---- prepared weights ------------------------------------------------------------------------

class _Search:
    """What a search-enabled :class:`Prepared` keeps: the checked candidates and the normalized
    channel weight (float32 [K] or None); ``on`` is False for round-to-nearest."""

    def __init__(self, candidates, channel_weight, k: int):
        self.candidates = check_candidates(candidates)
        self.on = self.candidates != RTN
        self.cw = normalized_channel_weight(channel_weight, k) if self.on else None


_SIX, _FOUR = torch.tensor(6.0), torch.tensor(4.0)


class _Reference(Prepared):
    def __init__(self, w: torch.Tensor, device: torch.device, order: str, search: _Search):
        self.w = w.to(device=device, dtype=torch.float32)
        self.amax = self.w.abs().amax()
        self.order, self.search = order, search

    def quantize(self, scalar):
        if self.search.on:
            p, s = quantize_nvfp4_search(self.w, scalar, order=self.order,
                                         channel_weight=self.search.cw,
                                         candidates=self.search.candidates)
        else:
            fn = quantize_nvfp4_scale2 if self.order == "scale_2" else quantize_nvfp4
            p, s = fn(self.w, scalar)
        return p.cpu(), s.cpu()


class _InductorFp8(Prepared):
    def __init__(self, weight, scale, block, order: str, search: _Search):
        self.order, self.search = order, search
        n, k = weight.shape
        bh, bw = block
        nb, kb = scale.shape
        xu = weight.view(torch.uint8)
        if (nb * bh, kb * bw) != (n, k):  # partial edge blocks: pad with zero bytes (value 0)
            xu = torch.nn.functional.pad(xu, (0, kb * bw - k, 0, nb * bh - n))
        self.n, self.k = n, k
        self.xu = xu.view(nb, bh, kb, bw // _G, _G)
        self.s = scale.to(torch.float32).contiguous()
        self.block_amax = _run("fp8_block_amax", self.xu, self.s)
        self.amax = self.block_amax.amax()
        self.cw = None
        if search.cw is not None:  # padded channels weigh 0 (their weights are 0 too)
            cw = torch.nn.functional.pad(search.cw, (0, kb * bw - k)).view(kb, bw // _G, _G)
            self.cw = cw.movedim(-1, 0)[:, None, None].contiguous()  # [16, 1, 1, Kb, bw/16]

    def quantize(self, scalar):
        if self.search.on:
            sf, eff = _search(_run("fp8_weights_t", self.xu, self.s), self.cw, self.block_amax,
                              self._scalar(scalar), self.order, self.search.candidates)
        else:
            sf, eff = _run("block_scales", self.block_amax, self._scalar(scalar), _SIX, self.order)
        codes = _run("fp8_codes", self.xu, self.s, eff)
        nb, bh, kb, bg, _ = self.xu.shape
        codes = codes.view(nb * bh, kb * bg * _G)[: self.n, : self.k]
        sf = sf.view(nb * bh, kb * bg)[: self.n, : self.k // _G]
        return _pack(codes), sf.contiguous()


class _InductorFloat(Prepared):
    def __init__(self, w, order: str, search: _Search):
        self.order, self.search = order, search
        self.n, self.k = w.shape
        self.x = w.contiguous().view(-1, _G)
        self.block_amax = _run("float_block_amax", self.x)
        self.amax = self.block_amax.amax()

    def quantize(self, scalar):
        if self.search.on:
            cw = None
            if self.search.cw is not None:  # [16, 1, K/16], broadcast over the rows
                cw = self.search.cw.view(self.k // _G, _G).movedim(-1, 0)[:, None].contiguous()
            nb = self.k // _G
            sf, eff = _search(_run("float_weights_t", self.x).view(_G, self.n, nb), cw,
                              self.block_amax.view(self.n, nb), self._scalar(scalar), self.order,
                              self.search.candidates)
            sf, eff = sf.reshape(-1), eff.reshape(-1)
        else:
            sf, eff = _run("block_scales", self.block_amax, self._scalar(scalar), _SIX, self.order)
        codes = _run("float_codes", self.x, eff)
        return _pack(codes.view(self.n, self.k)), sf.view(self.n, self.k // _G)


def _check(shape, k_groups_ok: bool = True) -> None:
    if len(shape) != 2 or shape[1] % _G or not k_groups_ok:
        raise ValueError(f"NVFP4 needs a 2-D weight with K a multiple of {_G}, got {tuple(shape)}")


def prepare_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                backend: str = "reference", device: torch.device | str = "cpu",
                order: str = "global", candidates: tuple[tuple[int, int], ...] = RTN,
                channel_weight: torch.Tensor | None = None) -> Prepared:
    """Prepare a block-scaled FP8 weight for NVFP4 quantization.

    Args:
        weight: float8_e4m3fn [N, K], K a multiple of 16 (CPU).
        scale: float32/bfloat16 [ceil(N/bh), ceil(K/bw)], multiplier direction.
        block: (bh, bw). The fast paths need bw to be a multiple of 16 (so no NVFP4 block
            straddles two FP8 scale blocks) and use the reference otherwise.
        backend: a name from :func:`choose_backend` (not ``auto``).
        device: where the reference and triton backends compute.
        order: an arithmetic order from :data:`ORDERS`; Triton implements both.
        candidates: the block-scale candidates (``quantize.kernels.scale_search``); the
            default :data:`RTN` is round-to-nearest.
        channel_weight: float32 [K] >= 0 weighting the search's squared error per input
            channel (calibration mean of x^2), or None.

    Returns:
        :class:`Prepared`; its bytes equal the reference's
        (:func:`quantize.kernels.scale_search.quantize_nvfp4_search`) for every backend.

    Raises:
        ValueError: K not a multiple of 16, a scale grid that does not match the weight, an
            unknown order, bad candidates or channel weight.
    """
    _check(weight.shape)
    bh, bw = block
    n, k = weight.shape
    want = (-(-n // bh), -(-k // bw))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {n}x{k} with "
                         f"block {bh}x{bw} (expected {want[0]}x{want[1]})")
    if order not in ORDERS:
        raise ValueError(f"order {order!r} is not one of {', '.join(ORDERS)}")
    search = _Search(candidates, channel_weight, k)
    if backend == "inductor" and bw % _G == 0:
        return _InductorFp8(weight, scale, block, order, search)
    if backend == "triton" and bw % _G == 0:
        from quantize.kernels.triton_nvfp4 import TritonFp8

        return TritonFp8(weight, scale, block, torch.device(device), order, search.candidates,
                         search.cw)
    dev = torch.device(device)
    return _Reference(dequantize_fp8_block(weight.to(dev), scale.to(dev), block), dev, order, search)


def prepare_float(w: torch.Tensor, backend: str = "reference",
                  device: torch.device | str = "cpu", order: str = "global",
                  candidates: tuple[tuple[int, int], ...] = RTN,
                  channel_weight: torch.Tensor | None = None) -> Prepared:
    """Prepare a float weight (bf16 / fp16 / fp32 [N, K], K a multiple of 16) for NVFP4.

    Same contract as :func:`prepare_fp8`; ``triton`` uses the reference on ``device`` (a dense
    source moves 2-4 bytes per weight, so the read, not the arithmetic, bounds it).
    """
    _check(w.shape)
    if order not in ORDERS:
        raise ValueError(f"order {order!r} is not one of {', '.join(ORDERS)}")
    search = _Search(candidates, channel_weight, w.shape[1])
    if backend == "inductor":
        return _InductorFloat(w, order, search)
    return _Reference(w, torch.device(device), order, search)
