"""CUDA path (Triton): the reference's bytes. Skipped where there is no CUDA device (CI)."""

import pytest
import torch
from test_fused import LAYOUTS, assert_same, random_fp8, reference_bytes, special_rows

from quantize.kernels.fused import _has_triton, prepare_fp8

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and _has_triton()),
                                reason="needs a CUDA device and triton")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("n,k,block", LAYOUTS + [(2048, 6144, (128, 128)), (6144, 2048, (128, 128))])
@pytest.mark.parametrize("seed", range(3))
def test_triton_fp8_matches_reference_bytes(n, k, block, seed):
    g = torch.Generator().manual_seed(seed * 7919 + n * k)
    wq = special_rows(random_fp8(n, k, g))
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=g) * 10.0 ** float(torch.randint(-6, 2, (1,), generator=g))
    amax, gs, p, s = reference_bytes(wq, scale, block)
    prep = prepare_fp8(wq, scale, block, backend="triton", device=CUDA)
    assert torch.equal(prep.amax.cpu(), amax)
    assert_same(prep.quantize(gs), (p, s))


def test_triton_fc11_and_shared_global_scale():
    wq = torch.zeros(16, 32, dtype=torch.uint8)
    wq[0, 0] = 0x7E
    wq[3, 16:] = 0x01
    wq = wq.view(torch.float8_e4m3fn)
    for amax in (None, torch.tensor(5e5)):
        _, gs, p, s = reference_bytes(wq, torch.ones(1, 1), (128, 128), amax=amax)
        got = prepare_fp8(wq, torch.ones(1, 1), (128, 128), "triton", CUDA).quantize(gs)
        assert_same(got, (p, s))


@pytest.mark.parametrize("n,k,block", LAYOUTS + [(2048, 6144, (128, 128))])
@pytest.mark.parametrize("order", ["global", "scale_2"])
def test_triton_search_matches_reference_bytes(n, k, block, order):
    """RTN and the block-scale search, weighted and not, in both orders: the reference's bytes."""
    from quantize.kernels.fp8 import dequantize_fp8_block
    from quantize.kernels.nvfp4 import global_scale_from_amax, scale_2_from_amax
    from quantize.kernels.scale_search import (
        DEFAULT_CANDIDATES,
        RTN,
        quantize_nvfp4_search,
    )

    g = torch.Generator().manual_seed(n * k + 3)
    wq = special_rows(random_fp8(n, k, g))
    scale = torch.rand((-(-n // block[0]), -(-k // block[1])), generator=g) * 1e-3 + 1e-6
    w = dequantize_fp8_block(wq, scale, block)
    sc = scale_2_from_amax(w.abs().amax()) if order == "scale_2" else global_scale_from_amax(w.abs().amax())
    cw = torch.rand(k, generator=g) ** 4
    for cands, c in ((RTN, None), (DEFAULT_CANDIDATES, None), (DEFAULT_CANDIDATES, cw)):
        want = quantize_nvfp4_search(w, sc, order=order, channel_weight=c, candidates=cands)
        prep = prepare_fp8(wq, scale, block, "triton", CUDA, order=order, candidates=cands,
                           channel_weight=c)
        assert_same(prep.quantize(sc), want)
