"""Fast NVFP4 paths: the same bytes as the plain-PyTorch reference, edge blocks included."""

import pytest
import torch

from quantize.kernels.fp8 import dequantize_fp8_block
from quantize.kernels.fused import (
    MIN_COMPILED_ELEMENTS,
    _has_cxx,
    choose_backend,
    decode_e4m3,
    e2m1_codes,
    prepare_float,
    prepare_fp8,
)
from quantize.kernels.nvfp4 import (
    global_scale_from_amax,
    quantize_nvfp4,
    quantize_nvfp4_scale2,
    round_to_e2m1_codes,
    scale_2_from_amax,
)

CPU = torch.device("cpu")
needs_cxx = pytest.mark.skipif(not _has_cxx(), reason="inductor needs a C++ compiler")
THRESHOLDS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)


def code_probe_values() -> torch.Tensor:
    """Every e2m1 threshold and range edge with its 64 float32 neighbours on each side, the
    extremes, and a dense sweep of [0, 8): both code functions are monotone step functions of
    |q|, so agreeing on both sides of every step of the reference means agreeing everywhere."""
    edges = torch.tensor(THRESHOLDS).view(torch.int32)
    near = (edges[:, None] + torch.arange(-64, 65, dtype=torch.int32)).flatten().view(torch.float32)
    sweep = torch.arange(0, 0x41000000, 4099, dtype=torch.int32).view(torch.float32)
    extremes = torch.tensor([0.0, 1e-45, 1e-38, 1e-10, 5.999, 6.0, 6.5, 7.0, 1e10, 3e38,
                             float("inf")])
    v = torch.cat([near, sweep, extremes])
    return torch.cat([v, -v])


def reference_codes(q: torch.Tensor) -> torch.Tensor:
    return round_to_e2m1_codes(torch.clamp(q, -6.0, 6.0))


def test_e2m1_codes_equal_threshold_table():
    q = code_probe_values()
    assert torch.equal(e2m1_codes(q), reference_codes(q))
    # -0.0 is code 0, a negative value that rounds to zero is code 8 (-0), as compressed-tensors
    assert e2m1_codes(torch.tensor([-0.0, -0.2, -0.25, -0.26])).tolist() == [0, 8, 8, 9]


@needs_cxx
def test_e2m1_codes_compiled_equal_threshold_table():
    q = code_probe_values()
    assert torch.equal(torch.compile(e2m1_codes)(q), reference_codes(q))


def test_decode_e4m3_all_bytes():
    b = torch.arange(256, dtype=torch.uint8)
    want = b.view(torch.float8_e4m3fn).to(torch.float32)
    got = decode_e4m3(b, nan_codes=True)
    finite = ~torch.isnan(want)
    assert (~finite).sum() == 2 and torch.isnan(got[~finite]).all()  # 0x7F, 0xFF
    # bit for bit, so -0.0 (0x80) and the subnormals 0x01..0x07 are checked too
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))
    assert torch.equal(decode_e4m3(b)[finite].view(torch.int32), want[finite].view(torch.int32))


def random_fp8(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    b = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    return b.view(torch.float8_e4m3fn)


def special_rows(wq: torch.Tensor) -> torch.Tensor:
    """Edge blocks in the first rows: all +0, all -0 (0x80), e4m3 subnormals and a signed
    ramp (negative values that round to code 8), one tiny block next to a huge one."""
    b = wq.view(torch.uint8).clone()
    b[0, :16] = 0x00
    b[1, :16] = 0x80
    b[2, :16] = torch.arange(16, dtype=torch.uint8) | 0x80
    b[3, :16] = torch.arange(16, dtype=torch.uint8)
    b[4, :] = 0x01  # smallest subnormal everywhere in the row ...
    b[4, 0] = 0x7E  # ... except 448: its other blocks underflow (FC-11b clamp to 2^-9)
    return b.view(torch.float8_e4m3fn)


def reference_bytes(wq, scale, block, amax=None):
    w = dequantize_fp8_block(wq, scale, block)
    g = global_scale_from_amax(w.abs().amax() if amax is None else amax)
    p, s = quantize_nvfp4(w, g)
    return w.abs().amax(), g, p, s


def assert_same(got, want):
    assert got[0].dtype == torch.uint8 and got[1].dtype == torch.float8_e4m3fn
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))


LAYOUTS = [  # (N, K, block): block FP8 with and without partial edge blocks, CT strategies
    (256, 512, (128, 128)),
    (200, 304, (128, 128)),
    (576, 160, (128, 128)),
    (48, 96, (1, 96)),    # per channel
    (48, 96, (48, 96)),   # per tensor
    (40, 128, (1, 32)),   # per group of 32
]


@needs_cxx
@pytest.mark.parametrize("n,k,block", LAYOUTS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_inductor_fp8_matches_reference_bytes(n, k, block, scale_dtype):
    g = torch.Generator().manual_seed(n * k)
    wq = special_rows(random_fp8(n, k, g))
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = (torch.rand(grid, generator=g) * 1e-3 + 1e-6).to(scale_dtype)
    amax, gs, p, s = reference_bytes(wq, scale, block)
    prep = prepare_fp8(wq, scale, block, backend="inductor")
    assert torch.equal(prep.amax, amax)
    assert_same(prep.quantize(gs), (p, s))
    assert s.view(torch.uint8)[0, 0] == 0x20 and s.view(torch.uint8)[1, 0] == 0x20  # 0.125
    assert (p[:2, :8] == 0).all()  # +0 and -0 blocks: code 0
    assert (p[2, :8] & 0x88).any()  # some negative ramp values kept their sign (code >= 8)


@needs_cxx
@pytest.mark.parametrize("n,k,block", [LAYOUTS[1], LAYOUTS[3]])
def test_inductor_fp8_modelopt_order_matches_reference_bytes(n, k, block):
    """nvidia-modelopt's order (dequant-direction scale_2, zero blocks 1.0) through the same
    compiled graphs: the bytes of quantize_nvfp4_scale2."""
    g = torch.Generator().manual_seed(n + k)
    wq = special_rows(random_fp8(n, k, g))
    scale = torch.rand((-(-n // block[0]), -(-k // block[1])), generator=g) * 1e-3 + 1e-6
    w = dequantize_fp8_block(wq, scale, block)
    s2 = scale_2_from_amax(w.abs().amax())
    p, s = quantize_nvfp4_scale2(w, s2)
    prep = prepare_fp8(wq, scale, block, backend="inductor", order="scale_2")
    assert_same(prep.quantize(s2), (p, s))
    assert s.view(torch.uint8)[0, 0] == 0x38  # an all-zero block: 1.0 in this order
    fl = prepare_float(w.bfloat16(), backend="inductor", order="scale_2")
    s2f = scale_2_from_amax(fl.amax)
    assert_same(fl.quantize(s2f), quantize_nvfp4_scale2(w.bfloat16().float(), s2f))


@needs_cxx
def test_inductor_fc11_underflow_block_gets_smallest_subnormal():
    wq = torch.zeros(16, 32, dtype=torch.uint8)
    wq[0, 0] = 0x7E  # 448
    wq[3, 16:] = 0x01  # 2^-9: block scale 6e-6 * ... underflows e4m3 -> clamped to 2^-9
    wq = wq.view(torch.float8_e4m3fn)
    scale = torch.ones(1, 1)
    amax, gs, p, s = reference_bytes(wq, scale, (128, 128))
    got = prepare_fp8(wq, scale, (128, 128), backend="inductor").quantize(gs)
    assert_same(got, (p, s))
    assert s.view(torch.uint8)[3, 1] == 0x01


@needs_cxx
def test_inductor_shared_global_scale_of_a_fused_group():
    g = torch.Generator().manual_seed(3)
    wq, scale = random_fp8(128, 256, g), torch.rand(1, 2, generator=g)
    group_amax = torch.tensor(1e4)  # a bigger member of the group sets the global scale
    _, gs, p, s = reference_bytes(wq, scale, (128, 128), amax=group_amax)
    assert_same(prepare_fp8(wq, scale, (128, 128), backend="inductor").quantize(gs), (p, s))


@needs_cxx
def test_inductor_block_amax_of_every_byte():
    """The block amax is the largest magnitude byte decoded: row r holds byte r once (at a
    different column each row, the rest of the 16-block zero), so each of the 256 e4m3 values
    is a block's amax, NaN codes included, equal to the reference's max |w|."""
    wq = torch.zeros(256, 128, dtype=torch.uint8)
    rows = torch.arange(256)
    wq[rows, (rows * 7) % 128] = rows.to(torch.uint8)
    w8 = wq.view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.75], [-0.5]])  # one FP8 block per 128 rows, a negative one too
    prep = prepare_fp8(w8, scale, (128, 128), "inductor")
    want = dequantize_fp8_block(w8, scale, (128, 128)).abs().view(256, 8, 16).amax(-1)
    assert torch.equal(prep.block_amax.reshape(256, 8).isnan(), want.isnan())
    assert torch.equal(prep.block_amax.reshape(256, 8).nan_to_num(), want.nan_to_num())


@needs_cxx
def test_inductor_nan_and_inf_show_in_amax():
    wq = torch.zeros(32, 32, dtype=torch.uint8)
    wq[5, 5] = 0xFF
    prep = prepare_fp8(wq.view(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128), "inductor")
    assert torch.isnan(prep.amax)
    wq[5, 5] = 0x10
    inf = prepare_fp8(wq.view(torch.float8_e4m3fn), torch.tensor([[float("inf")]]), (128, 128),
                      "inductor")
    assert not torch.isfinite(inf.amax)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_inductor_float_matches_reference_bytes(dtype):
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(96, 320, generator=g) * 0.02).to(dtype)
    w[0, :16] = 0
    w[1, :16] = -1e-6
    w[2, 0] = 3.0
    ref = w.to(torch.float32)
    gs = global_scale_from_amax(ref.abs().amax())
    prep = prepare_float(w, backend="inductor")
    assert torch.equal(prep.amax, ref.abs().amax())
    assert_same(prep.quantize(gs), quantize_nvfp4(ref, gs))


def test_reference_backend_is_the_reference():
    g = torch.Generator().manual_seed(5)
    wq, scale = random_fp8(64, 128, g), torch.rand(1, 1, generator=g)
    amax, gs, p, s = reference_bytes(wq, scale, (128, 128))
    prep = prepare_fp8(wq, scale, (128, 128), backend="reference")
    assert torch.equal(prep.amax, amax)
    assert_same(prep.quantize(gs), (p, s))


def test_group_not_multiple_of_16_uses_reference():
    g = torch.Generator().manual_seed(9)
    wq, scale = random_fp8(8, 48, g), torch.rand(8, 6, generator=g)
    amax, gs, p, s = reference_bytes(wq, scale, (1, 8))
    assert_same(prepare_fp8(wq, scale, (1, 8), backend="inductor").quantize(gs), (p, s))


def test_bad_shapes_refused():
    with pytest.raises(ValueError, match="K a multiple of 16"):
        prepare_fp8(torch.zeros(4, 40, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))
    with pytest.raises(ValueError, match="expected 2x3"):
        prepare_fp8(torch.zeros(200, 304, dtype=torch.float8_e4m3fn), torch.ones(2, 2), (128, 128))


def test_choose_backend():
    assert choose_backend("reference", CPU) == "reference"
    small = choose_backend("auto", CPU, MIN_COMPILED_ELEMENTS - 1)
    assert small == "reference"
    assert choose_backend("auto", CPU, MIN_COMPILED_ELEMENTS) == ("inductor" if _has_cxx() else "reference")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_backend("triton", CPU)
    with pytest.raises(ValueError, match="not one of auto, reference, inductor, triton"):
        choose_backend("numba", CPU)


def test_count_bytes_counts_nan_codes_and_floor_scales():
    from quantize.kernels.dtypes import count_bytes

    b = torch.tensor([0x7F, 0xFF, 0x01, 0x81, 0x7E, 0x01, 0x00, 0x7F], dtype=torch.uint8)
    s = b.view(torch.float8_e4m3fn).reshape(2, 4)
    assert count_bytes(s, 0x7F, 0x7F) == 3  # e4m3 NaN: 0x7F and 0xFF
    assert count_bytes(s, 0x01) == 2  # the floor 2^-9 (0x81 is -2^-9)
    assert count_bytes(s[:, 1:], 0x01) == 2  # a non-contiguous view
