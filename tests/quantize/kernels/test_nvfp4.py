"""NVFP4 kernel: byte-exact against compressed-tensors, golden bytes, edge blocks."""

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from conftest import ct_nvfp4_reference

from quantize.kernels.nvfp4 import (
    dequantize_nvfp4,
    global_scale_from_amax,
    pack_e2m1,
    quantize_nvfp4,
    unpack_e2m1,
)

ct_reference = ct_nvfp4_reference


def ours(w):
    g = global_scale_from_amax(w.abs().amax())
    p, s = quantize_nvfp4(w, g)
    return p, s, g


def assert_same_bytes(a, b):
    pa, sa, ga = a
    pb, sb, gb = b
    assert torch.equal(pa, pb)
    assert torch.equal(sa.view(torch.uint8), sb.view(torch.uint8))
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("seed", range(40))
def test_random_matches_compressed_tensors_bytes(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 64, (1,), generator=g))
    k = 16 * int(torch.randint(1, 24, (1,), generator=g))
    w = torch.randn(n, k, generator=g) * float(10 ** (torch.rand(1, generator=g) * 6 - 4))
    if seed % 3 == 0:
        w[0, :16] = 0  # an all-zero block
    if seed % 4 == 0:
        w = w.bfloat16().float()  # values on the bf16 grid, as from a bf16 source
    assert_same_bytes(ours(w), ct_reference(w))


def test_real_weights_match_compressed_tensors_bytes():
    """Heavy-tailed rows like real Linear weights (outlier columns)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g) * 0.02
    w[:, 3] *= 40
    assert_same_bytes(ours(w), ct_reference(w))


def test_all_zero_tensor_is_clean():
    w = torch.zeros(4, 32)
    p, s, g = ours(w)
    assert torch.equal(g, torch.tensor([1.0]))
    assert torch.all(p == 0)
    assert torch.all(s.view(torch.uint8) == 0x20)  # 0.125, compressed-tensors' zero-scale value
    assert torch.equal(dequantize_nvfp4(p, s, g), w)
    assert_same_bytes((p, s, g), ct_reference(w))


def test_fc05_scale_direction_values():
    """FC-05: max |w| = 1344 -> CT global 2.0, block scale 448 (0x7E); ModelOpt weight_scale_2
    would be 0.5 = 1 / global. Max element dequantizes to 6 * 448 / 2 = 1344."""
    w = torch.zeros(16, 32)
    w[0, 0] = 1344.0
    w[5, 20] = 1.0
    p, s, g = ours(w)
    assert g.item() == 2.0
    assert s.view(torch.uint8)[0, 0].item() == 0x7E and s[0, 0].float().item() == 448.0
    assert (1.0 / g).item() == 0.5
    deq = dequantize_nvfp4(p, s, g)
    assert deq[0, 0].item() == 1344.0
    # feeding the reciprocal (ModelOpt's multiplier) into CT's divide is off by x4 here
    wrong = dequantize_nvfp4(p, s, 1.0 / g)
    assert wrong[0, 0].item() == 1344.0 * 4


def test_fc11_no_nan_on_overflow_or_underflow():
    # (a) global amax 0.5, first block all zeros: scale finite, nibbles 0, dequant exactly 0
    w = torch.rand(16, 32) * 0.5
    w[0, 0] = 0.5
    w[1, :16] = 0
    p, s, g = ours(w)
    b = s.view(torch.uint8)
    assert not torch.any((b & 0x7F) == 0x7F)
    assert torch.all(unpack_e2m1(p)[1, :16] == 0)
    assert torch.all(dequantize_nvfp4(p, s, g)[1, :16] == 0)
    # (b) global amax 2688 (scale_2 = 1), one block of amax 1e-4: clamped to 2^-9 (0x01)
    w = torch.zeros(16, 32)
    w[0, 0] = 2688.0
    w[3, 16:] = torch.linspace(-1e-4, 1e-4, 16)
    p, s, g = ours(w)
    assert g.item() == 1.0
    assert s.view(torch.uint8)[3, 1].item() == 0x01
    deq = dequantize_nvfp4(p, s, g)
    assert torch.isfinite(deq).all()
    assert (deq[3, 16:] - w[3, 16:]).abs().max().item() <= 1e-4


def test_fc12_nibble_order():
    w = torch.tensor([[0.5, -6.0] + [0.0] * 14])
    g = torch.tensor([1.0])
    codes = torch.tensor([[1, 15]], dtype=torch.uint8)
    assert pack_e2m1(codes).item() == 0xF1
    assert unpack_e2m1(torch.tensor([[0xF1]], dtype=torch.uint8)).tolist() == [[1, 15]]
    # all 16 codes twice round-trip through pack/unpack and the CT unpacker
    row = torch.arange(16, dtype=torch.uint8).repeat(2).view(1, 32)
    packed = pack_e2m1(row)
    assert torch.equal(unpack_e2m1(packed), row)
    ct_vals = unpack_fp4_from_uint8(packed, 1, 32, dtype=torch.float32)
    ours_vals = dequantize_nvfp4(packed, torch.ones(1, 2, dtype=torch.float8_e4m3fn), g)
    assert torch.equal(ct_vals, ours_vals)
    p, s, _ = ours(w)
    assert p[0, 0].item() == 0xF1


def test_k_not_multiple_of_16_refused():
    with pytest.raises(ValueError, match="K=40 is not a multiple of the NVFP4 group size 16"):
        quantize_nvfp4(torch.ones(2, 40), torch.tensor([1.0]))
