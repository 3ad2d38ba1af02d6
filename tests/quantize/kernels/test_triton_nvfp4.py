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
