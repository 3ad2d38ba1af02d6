"""FP8 dequantization: block FP8 (weight_scale_inv multiplier, partial edge blocks), e4m3 bytes."""

import pytest
import torch

from quantize.kernels.fp8 import (
    dequantize_fp8_block,
    dequantize_fp8_broadcast,
    quantize_fp8_block,
)


def test_fc01_partial_blocks_576x2048():
    w = torch.ones(576, 2048).to(torch.float8_e4m3fn)
    s = (torch.arange(5, dtype=torch.float32) + 1).view(5, 1).repeat(1, 16)
    d = dequantize_fp8_block(w, s, (128, 128))
    assert d.shape == (576, 2048)
    assert d[500, 0].item() == 4.0 and d[575, 2047].item() == 5.0 and d[127, 5].item() == 1.0


def test_fc01_partial_blocks_200x300():
    w = torch.ones(200, 300).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])
    d = dequantize_fp8_block(w, s, (128, 128))
    assert d[120, 0].item() == 1.0 and d[128, 0].item() == 10.0 and d[199, 299].item() == 30.0


def test_fc01_grid_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"expected 2x3"):
        dequantize_fp8_block(torch.ones(200, 300).to(torch.float8_e4m3fn), torch.ones(2, 2))


def test_fc03_scale_inv_is_a_multiplier():
    w = torch.ones(256, 256).to(torch.float8_e4m3fn)
    s = torch.tensor([[0.5, 1.0], [2.0, 4.0]])
    d = dequantize_fp8_block(w, s)
    assert d[0, 0] == 0.5 and d[0, 255] == 1.0 and d[255, 0] == 2.0 and d[255, 255] == 4.0


def test_bf16_scales_read_as_multipliers():
    w = torch.full((4, 4), 2.0).to(torch.float8_e4m3fn)
    d = dequantize_fp8_block(w, torch.tensor([[0.25]], dtype=torch.bfloat16), (128, 128))
    assert torch.all(d == 0.5)


def test_fc10_e4m3_bytes_decode():
    b = torch.tensor([0x38, 0x40, 0x3C, 0x48, 0x7E, 0x01], dtype=torch.uint8)
    vals = b.view(torch.float8_e4m3fn)
    assert vals.float().tolist() == [1.0, 2.0, 1.5, 4.0, 448.0, 2.0**-9]
    assert vals.to(torch.bfloat16).float().tolist() == [1.0, 2.0, 1.5, 4.0, 448.0, 2.0**-9]
    assert vals.to(torch.float16).float().tolist() == [1.0, 2.0, 1.5, 4.0, 448.0, 2.0**-9]
    finite = torch.arange(1, 0x7F, dtype=torch.uint8)  # 126 finite positive codes
    assert torch.equal(finite.view(torch.float8_e4m3fn).float().to(torch.float8_e4m3fn).view(torch.uint8), finite)


def test_ct_strategies_broadcast():
    w = torch.full((4, 32), 1.0).to(torch.float8_e4m3fn)
    assert torch.all(dequantize_fp8_broadcast(w, torch.tensor([3.0])) == 3.0)
    ch = dequantize_fp8_broadcast(w, torch.arange(4.0).view(4, 1))
    assert ch[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    grp = dequantize_fp8_broadcast(w, torch.tensor([[1.0, 2.0]]).repeat(4, 1), group=16)
    assert grp[0, 15] == 1.0 and grp[0, 16] == 2.0


def test_block_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    q, s = quantize_fp8_block(w)
    assert s.shape == (3, 2)
    d = dequantize_fp8_block(q, s)
    assert ((d - w).abs() <= w.abs() / 16 + 1e-6).all()
