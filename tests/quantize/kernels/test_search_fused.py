"""Block-scale search in the fast paths: the bytes of the plain-PyTorch reference
(``quantize_nvfp4_search``) in both arithmetic orders, weighted and not, edge blocks included."""

import pytest
import torch
from test_fused import (
    LAYOUTS,
    assert_same,
    code_probe_values,
    needs_cxx,
    random_fp8,
    special_rows,
)

from quantize.kernels.dtypes import E2M1_LUT
from quantize.kernels.fp8 import dequantize_fp8_block
from quantize.kernels.fused import (
    decode_e4m3,
    e2m1_codes,
    e2m1_round,
    encode_e4m3,
    prepare_float,
    prepare_fp8,
)
from quantize.kernels.nvfp4 import global_scale_from_amax, scale_2_from_amax
from quantize.kernels.scale_search import (
    DEFAULT_CANDIDATES,
    FOUR_OVER_SIX,
    RTN,
    quantize_nvfp4_search,
)

WIDE = ((6, 0), (4, 0), (6, -1), (6, -3), (6, 2), (4, -2), (4, 3), (6, -16), (4, 16))
"""Far offsets too: they reach the e4m3 code limits 0x01 and 0x7E, which clamp."""


def scalar_of(amax, order):
    return scale_2_from_amax(amax) if order == "scale_2" else global_scale_from_amax(amax)


def channel_weight(k, g):
    cw = torch.rand(k, generator=g) ** 4 * 50.0
    cw[::7] = 0.0  # dead channels
    return cw


def test_e2m1_round_is_the_value_of_the_code():
    q = code_probe_values()
    assert torch.equal(e2m1_round(q).view(torch.int32), E2M1_LUT[e2m1_codes(q).long()].view(torch.int32))


def test_encode_e4m3_inverts_decode():
    b = torch.arange(1, 0x7F, dtype=torch.int32)
    assert torch.equal(encode_e4m3(decode_e4m3(b)), b)


@needs_cxx
@pytest.mark.parametrize("n,k,block,order,weighted", [
    (*LAYOUTS[0], "global", False), (*LAYOUTS[1], "scale_2", True), (*LAYOUTS[2], "global", True),
    (*LAYOUTS[3], "scale_2", False), (*LAYOUTS[4], "global", True), (*LAYOUTS[5], "scale_2", True)])
def test_inductor_fp8_search_matches_reference_bytes(n, k, block, order, weighted):
    g = torch.Generator().manual_seed(n * k + 1)
    wq = special_rows(random_fp8(n, k, g))
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=g) * 1e-3 + 1e-6
    w = dequantize_fp8_block(wq, scale, block)
    sc = scalar_of(w.abs().amax(), order)
    cw = channel_weight(k, g) if weighted else None
    for cands in (DEFAULT_CANDIDATES, WIDE):
        want = quantize_nvfp4_search(w, sc, order=order, channel_weight=cw, candidates=cands)
        prep = prepare_fp8(wq, scale, block, backend="inductor", order=order, candidates=cands,
                           channel_weight=cw)
        assert_same(prep.quantize(sc), want)
    rtn = prepare_fp8(wq, scale, block, backend="reference", order=order).quantize(sc)
    assert not torch.equal(want[1].view(torch.uint8), rtn[1].view(torch.uint8))  # it searched


@needs_cxx
@pytest.mark.parametrize("order", ["global", "scale_2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inductor_float_search_matches_reference_bytes(order, dtype):
    g = torch.Generator().manual_seed(17)
    w = (torch.randn(96, 320, generator=g) * 0.02).to(dtype)
    w[0, :16] = 0
    w[1, :16] = -1e-6
    w[2, 0] = 3.0
    ref = w.to(torch.float32)
    sc = scalar_of(ref.abs().amax(), order)
    for cw in (None, channel_weight(320, g)):
        want = quantize_nvfp4_search(ref, sc, order=order, channel_weight=cw, candidates=WIDE)
        got = prepare_float(w, backend="inductor", order=order, candidates=WIDE, channel_weight=cw)
        assert_same(got.quantize(sc), want)


@needs_cxx
@pytest.mark.parametrize("order", ["global", "scale_2"])
def test_inductor_search_shared_scalar_of_a_fused_group(order):
    g = torch.Generator().manual_seed(4)
    wq, scale = random_fp8(128, 256, g), torch.rand(1, 2, generator=g)
    sc = scalar_of(torch.tensor(1e4), order)  # a bigger member of the group sets the scalar
    w = dequantize_fp8_block(wq, scale, (128, 128))
    want = quantize_nvfp4_search(w, sc, order=order, candidates=FOUR_OVER_SIX)
    got = prepare_fp8(wq, scale, (128, 128), "inductor", order=order, candidates=FOUR_OVER_SIX)
    assert_same(got.quantize(sc), want)


@pytest.mark.parametrize("backend", ["reference", pytest.param("inductor", marks=needs_cxx)])
def test_rtn_candidates_are_the_rtn_path(backend):
    g = torch.Generator().manual_seed(8)
    wq = special_rows(random_fp8(200, 304, g))
    scale = torch.rand(2, 3, generator=g) * 1e-3
    for order in ("global", "scale_2"):
        w = dequantize_fp8_block(wq, scale, (128, 128))
        sc = scalar_of(w.abs().amax(), order)
        a = prepare_fp8(wq, scale, (128, 128), backend, order=order).quantize(sc)
        assert_same(quantize_nvfp4_search(w, sc, order=order, candidates=RTN), a)
