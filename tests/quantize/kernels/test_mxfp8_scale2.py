"""MXFP8 kernel and the ModelOpt-order NVFP4 kernel: golden values without any reference library."""

import pytest
import torch

from quantize.kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from quantize.kernels.nvfp4 import (
    dequantize_nvfp4,
    quantize_nvfp4_scale2,
    scale_2_from_amax,
)


def test_mxfp8_golden_exponents():
    w = torch.zeros(1, 128)
    w[0, 0] = 448.0  # block 0: 448 / 448 = 2^0 -> byte 127
    w[0, 32] = 449.0  # block 1: needs 2^1 so nothing overflows -> 128
    w[0, 64] = 1.0  # block 2: ceil(log2(1/448)) = -8 -> 119
    q, s = quantize_mxfp8(w)  # block 3 all zero -> 2^-127 -> byte 0
    assert s.tolist() == [[127, 128, 119, 0]]
    assert q.view(torch.uint8)[0, 0] == 0x7E  # 448
    assert float(q[0, 32].float()) * 2 == 448.0  # 449/2 = 224.5 -> e4m3 224
    assert torch.equal(dequantize_mxfp8(q, s)[0, 64:], w[0, 64:])


def test_mxfp8_k_not_multiple_of_32_refused():
    with pytest.raises(ValueError, match="K=48 is not a multiple of the MXFP8 group size 32"):
        quantize_mxfp8(torch.ones(2, 48))


def test_fc05_modelopt_order_values():
    """FC-05 in ModelOpt's direction: max |w| = 1344 -> weight_scale_2 = 0.5, that block's
    scale 448 (0x7E); the max element dequantizes to 6 * 448 * 0.5 = 1344."""
    w = torch.zeros(16, 32)
    w[0, :16] = torch.linspace(-1344, 1344, 16)
    s2 = scale_2_from_amax(w.abs().amax())
    packed, scale = quantize_nvfp4_scale2(w, s2)
    assert float(s2) == 0.5 and s2.shape == ()
    assert scale.view(torch.uint8)[0, 0] == 0x7E
    assert scale.view(torch.uint8)[1, 0] == 0x38  # all-zero block: 1.0 (ModelOpt), not 0.125
    deq = dequantize_nvfp4(packed, scale, (1 / s2).reshape(1))
    assert deq[0, 15] == 1344.0 and deq[0, 0] == -1344.0
    # feeding the dequant-direction scalar into the quantize-direction formula is 4x off
    assert dequantize_nvfp4(packed, scale, s2.reshape(1))[0, 15] == 1344.0 * 4
