"""Per-block scale search (``--scales mse``) and activation-side scales."""

import pytest
import torch

from quantize.kernels.act_scales import (
    fake_quantize_nvfp4_activation,
    fp8_kv_scale_from_amax,
    input_global_scale_from_amax,
)
from quantize.kernels.nvfp4 import (
    dequantize_nvfp4,
    global_scale_from_amax,
    quantize_nvfp4,
)
from quantize.kernels.scale_search import RTN, block_errors, quantize_nvfp4_search


def _w(n=64, k=256, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_offset_zero_is_rtn_byte_for_byte():
    w = _w()
    w[3, 17] = 0.3  # an outlier block
    w[5, 32:48] = 0.0  # an all-zero block
    g = global_scale_from_amax(w.abs().max())
    p0, s0 = quantize_nvfp4(w, g)
    p1, s1 = quantize_nvfp4_search(w, g, candidates=RTN)
    assert torch.equal(p0, p1) and torch.equal(s0.view(torch.uint8), s1.view(torch.uint8))


def test_search_never_worse_per_block_and_better_overall():
    w = _w(128, 512)
    g = global_scale_from_amax(w.abs().max())
    rtn = quantize_nvfp4(w, g)
    mse = quantize_nvfp4_search(w, g)
    e_rtn, e_mse = block_errors(w, rtn, g), block_errors(w, mse, g)
    assert (e_mse <= e_rtn).all()
    # Gaussian weights: about 27 % less squared error than RTN with the default candidates
    assert e_mse.sum() < 0.75 * e_rtn.sum()
    codes = mse[1].view(torch.uint8)
    assert ((codes >= 0x01) & (codes <= 0x7E)).all()  # no zero, negative or NaN scale (FC-11)


def test_known_block_prefers_a_smaller_scale():
    # fifteen values 1.0 and one 1.4: RTN maps 1.4 to 6 (scale 1.4/6), so each 1.0 lands on
    # 4.29 and rounds to 4; a smaller scale (1.0 -> exactly 4 or 6) costs only the 1.4. The
    # search must find the least error over the e4m3 scales near RTN, recomputed here by brute
    # force over every e4m3 value in (0.15, 0.5).
    w = torch.tensor([[1.0] * 15 + [1.4]])
    g = torch.tensor([1.0])
    p, s = quantize_nvfp4_search(w, g)
    err = float(block_errors(w, (p, s), g))
    rtn = float(block_errors(w, quantize_nvfp4(w, g), g))
    e4m3 = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    best = min(float(((vals[(w[0, :, None] / c).abs().clamp(max=6).sub(vals).abs().argmin(-1)] * c
                       - w[0]) ** 2).sum()) for c in e4m3 if 0.15 < c < 0.5)
    assert err < rtn and err == pytest.approx(best, rel=1e-6)


def test_channel_weights_steer_the_error():
    w = _w(64, 256, seed=3)
    g = global_scale_from_amax(w.abs().max())
    cw = torch.ones(256)
    cw[::16] = 100.0  # the first channel of every block matters most
    plain = quantize_nvfp4_search(w, g)
    weighted = quantize_nvfp4_search(w, g, channel_weight=cw)
    assert block_errors(w, weighted, g, cw).sum() < block_errors(w, plain, g, cw).sum()
    assert block_errors(w, weighted, g).sum() >= block_errors(w, plain, g).sum()
    with pytest.raises(ValueError, match="channel_weight has shape"):
        quantize_nvfp4_search(w, g, channel_weight=torch.ones(16))
    with pytest.raises(ValueError, match=r"the first scale candidate must be \(6, 0\), round-to-nearest"):
        quantize_nvfp4_search(w, g, candidates=((6, -1), (6, 1)))
    with pytest.raises(ValueError, match=r"scale candidate \(5, 0\): target must be one of \(6, 4\)"):
        quantize_nvfp4_search(w, g, candidates=((6, 0), (5, 0)))


def test_activation_scales():
    assert torch.equal(fp8_kv_scale_from_amax(448.0), torch.tensor([1.0]))
    assert torch.equal(fp8_kv_scale_from_amax(0.0), torch.tensor([1.0]))  # engines' default
    assert torch.equal(fp8_kv_scale_from_amax(float("nan")), torch.tensor([1.0]))
    assert fp8_kv_scale_from_amax(2.0).item() == pytest.approx(2 / 448)
    assert torch.equal(input_global_scale_from_amax(12.0), global_scale_from_amax(12.0))
    assert input_global_scale_from_amax(12.0).item() == pytest.approx(224.0)


def test_activation_fake_quant_is_nvfp4_of_the_tokens():
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    g = input_global_scale_from_amax(x.abs().max())
    y = fake_quantize_nvfp4_activation(x, g)
    flat = x.reshape(10, 32)
    assert torch.equal(y.reshape(10, 32), dequantize_nvfp4(*quantize_nvfp4(flat, g), g))
    assert torch.equal(fake_quantize_nvfp4_activation(y, g), y)  # idempotent on the grid
    assert 0 < (y - x).abs().max() <= x.abs().max() / 6 * (1 + 1 / 16)


def test_scales_auto_is_the_search_on_cuda_and_rtn_on_cpu():
    from quantize.cli import build_parser
    from quantize.kernels import SCALES_AUTO, resolve_scales

    ns = build_parser().parse_args(["nvfp4", "--src", "S"])
    assert ns.scales == SCALES_AUTO == "auto"
    assert (resolve_scales("auto", "cuda"), resolve_scales("auto", "cpu")) == ("mse", "rtn")
    assert resolve_scales("4over6", "cuda") == "4over6" and resolve_scales("mse", "cpu") == "mse"
    with pytest.raises(ValueError, match=r"unknown --scales 'mse2' \(valid: auto, rtn, 4over6, mse, mse-act\)"):
        resolve_scales("mse2", "cpu")


def test_choose_block_scales_is_the_searchs_choice_with_per_row_scalars():
    """The function GPTQ calls: per-row scalars broadcast over the blocks of each row; every
    row alone gives the scales quantize_nvfp4_search writes for it."""
    from quantize.kernels.scale_search import DEFAULT_CANDIDATES, choose_block_scales

    w = _w(8, 64)
    w[2] *= 40  # rows of very different range: different global scales per row
    g = torch.stack([global_scale_from_amax(r.abs().max()) for r in w])  # [8, 1]
    sf = choose_block_scales(w.view(8, 4, 16), g, "global", DEFAULT_CANDIDATES)
    for i in range(8):
        _, bs = quantize_nvfp4_search(w[i:i + 1], g[i])
        assert torch.equal(sf[i].to(torch.float8_e4m3fn).view(torch.uint8), bs[0].view(torch.uint8))
    assert torch.equal(choose_block_scales(w.view(8, 4, 16), g, "global", RTN),
                       torch.stack([quantize_nvfp4(w[i:i + 1], g[i])[1][0].float() for i in range(8)]))
