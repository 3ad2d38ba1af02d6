"""ModelOpt NVFP4 / MXFP8 layout: byte for byte against nvidia-modelopt 0.47, configs against
ModelOpt's own config converter, and the CT <-> ModelOpt rename + reciprocal mapping."""

import json
import warnings

import pytest
import torch
from conftest import BLOCK_FP8_QC, fp8_pair, write_checkpoint

from formats import compressed_tensors, modelopt
from quantize.convert.pipeline import convert
from quantize.kernels.fp8 import dequantize_fp8_block, quantize_fp8_block
from quantize.kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from quantize.kernels.nvfp4 import (
    dequantize_nvfp4,
    global_scale_from_amax,
    quantize_nvfp4,
    quantize_nvfp4_scale2,
    scale_2_from_amax,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mo_nvfp4 = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor",
                                   reason="nvidia-modelopt not installed (pip install '.[test]')")
    from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor

NVFP4QTensor = mo_nvfp4.NVFP4QTensor


def weights(seed: int) -> torch.Tensor:
    """Random fp32 weights over 6 decades; every other one dequantized from block FP8 (the
    coarse grid our FP8 sources produce, where exact e2m1 ties are common); some zero blocks."""
    g = torch.Generator().manual_seed(seed)
    n, k = int(torch.randint(1, 80, (1,), generator=g)), 32 * int(torch.randint(1, 12, (1,), generator=g))
    w = torch.randn(n, k, generator=g) * float(10 ** (torch.rand(1, generator=g) * 6 - 4))
    if seed % 2:
        w = dequantize_fp8_block(*quantize_fp8_block(w))
    if seed % 3 == 0:
        w[0, :32] = 0
    return w


@pytest.mark.parametrize("seed", range(40))
def test_nvfp4_bytes_equal_modelopt(seed):
    w = weights(seed)
    s2 = scale_2_from_amax(w.abs().amax())
    packed, scale = quantize_nvfp4_scale2(w, s2)
    q, ref_scale, ref_s2 = NVFP4QTensor.quantize(w.clone(), 16)
    assert torch.equal(s2, ref_s2) and s2.shape == ()
    assert torch.equal(packed, q._quantized_data)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))


def test_fused_group_scale_2_equals_modelopt_with_shared_scale():
    """FC-06 numbers through ModelOpt's quantizer: gate (amax 1) quantized against the pair's
    scale_2 = 100/2688 gives the same bytes as NVFP4QTensor.quantize(..., weights_scaling_factor_2)."""
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(64, 64, generator=g)
    gate = gate / gate.abs().max()
    s2 = scale_2_from_amax(torch.tensor(100.0))
    packed, scale = quantize_nvfp4_scale2(gate, s2)
    q, ref_scale, _ = NVFP4QTensor.quantize(gate.clone(), 16, None, s2)
    assert torch.equal(packed, q._quantized_data)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))


def test_all_zero_tensor_no_nan_where_modelopt_has_nan():
    w = torch.zeros(8, 32)
    _, ref_scale, _ = NVFP4QTensor.quantize(w.clone(), 16)
    assert torch.isnan(ref_scale.to(torch.float32)).all()  # modelopt: 0/0
    s2 = scale_2_from_amax(w.abs().amax())
    packed, scale = quantize_nvfp4_scale2(w, s2)
    assert float(s2) == 1.0 and torch.all(packed == 0)
    assert torch.all(scale.view(torch.uint8) == 0x38)  # 1.0: modelopt's zero-block value
    assert torch.equal(dequantize_nvfp4(packed, scale, (1 / s2).reshape(1)), w)


def test_ct_order_vs_modelopt_order_differ_only_at_fp8_grid_ties():
    """Why two kernels: on random fp32 the orders agree; on dequantized FP8 they round some
    exact ties differently (documented in quantize/kernels/nvfp4.py)."""
    diff_random = diff_grid = 0
    for seed in range(20):
        w = weights(seed)
        amax = w.abs().amax()
        a, _ = quantize_nvfp4(w, global_scale_from_amax(amax))
        b, _ = quantize_nvfp4_scale2(w, scale_2_from_amax(amax))
        if seed % 2:
            diff_grid += int((a != b).sum())
        else:
            diff_random += int((a != b).sum())
    assert diff_random == 0 and diff_grid > 0


@pytest.mark.parametrize("seed", range(12))
def test_mxfp8_bytes_equal_modelopt_and_ct_decodes_them(seed):
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale

    w = weights(seed)
    q, scale = quantize_mxfp8(w)
    ref_q, ref_scale = MXFP8QTensor.quantize(w.clone())
    assert torch.equal(q.view(torch.uint8), ref_q._quantized_data.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    ct = q.to(torch.float32) * decompress_mx_scale(scale).to(torch.float32).repeat_interleave(32, 1)
    assert torch.equal(ct, dequantize_mxfp8(q, scale))
    assert (dequantize_mxfp8(q, scale) - w).abs().max() <= w.abs().max() / 8  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("targets", [
    {"model.layers.0.mlp.gate_proj": "nvfp4", "model.layers.0.mlp.up_proj": "nvfp4"},
    {"model.layers.0.mlp.gate_proj": "nvfp4", "model.layers.0.self_attn.o_proj": "fp8-block",
     "model.layers.0.self_attn.q_proj": "mxfp8"}])
@pytest.mark.parametrize("kv_cache", [None, "fp8"])
def test_config_json_equals_modelopt_converter(targets, kv_cache):
    """config.json quantization_config == ModelOpt's convert_hf_quant_config_format applied to
    our hf_quant_config.json; ignore == exclude_modules (FC-25); an FP8 KV cache is declared in
    both files, config.json's ``kv_cache_scheme`` being the one vLLM 0.26 reads."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    ignore = ["lm_head", "model.layers.0.mlp.gate"]
    producer = {"name": "spark-quant", "version": "0.1.0"}
    hf = modelopt.hf_quant_config(targets, ignore, producer, kv_cache=kv_cache)
    qc = modelopt.quantization_config(targets, ignore, "w4a16", producer, kv_cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ModelOpt warns that FP8_PB_WO has no CT group mapping
        assert qc == convert_hf_quant_config_format(hf)
    assert hf["quantization"]["kv_cache_quant_algo"] == ("FP8" if kv_cache else None)
    if kv_cache:
        assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
        assert json.dumps(qc).index('"kv_cache_scheme"') > json.dumps(qc).index('"quant_algo"')
    else:
        assert "kv_cache_scheme" not in qc
    assert hf["quantization"]["exclude_modules"] == sorted(ignore)
    if len(set(targets.values())) > 1:
        assert hf["quantization"]["quant_algo"] == "MIXED_PRECISION"
        assert hf["quantization"]["quantized_layers"]["model.layers.0.self_attn.o_proj"] == {"quant_algo": "FP8_PB_WO"}


def test_ct_modelopt_round_trip_is_rename_plus_reciprocal():
    w = weights(1)
    amax = w.abs().amax()
    s2 = scale_2_from_amax(amax)
    packed, scale = quantize_nvfp4_scale2(w, s2)
    mo = modelopt.emit_nvfp4("m", packed, scale, s2)
    ct = modelopt.to_compressed_tensors(mo)
    assert set(ct) == {"m.weight_packed", "m.weight_scale", "m.weight_global_scale"}
    assert ct["m.weight_packed"] is packed and ct["m.weight_scale"] is scale  # bytes untouched
    assert torch.equal(ct["m.weight_global_scale"], (1 / s2).reshape(1))
    back = modelopt.from_compressed_tensors(ct)
    assert set(back) == set(mo) and back["m.weight"] is packed
    assert back["m.weight_scale_2"].shape == () and back["m.weight_scale_2"].dtype == torch.float32
    # the scalars are fp32 reciprocals: within one ulp, and exact in the dequantized weight's scale
    assert abs(float(back["m.weight_scale_2"]) - float(s2)) <= 1.2e-7 * float(s2)
    # compressed-tensors' own NVFP4 decompressor reads the renamed tensors
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    local = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": ct["m.weight_global_scale"],
             "weight_shape": torch.tensor(list(w.shape))}
    dense = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized").decompress(
        local, preset_name_to_scheme("NVFP4A16", ["Linear"]))["weight"]
    mine = dequantize_nvfp4(packed, scale, ct["m.weight_global_scale"])
    assert torch.equal(dense, mine.to(dense.dtype))


def test_fc25_ignore_key_and_exclude_modules(tmp_path):
    """FC-25: ModelOpt config.json carries ``ignore`` (quant_method modelopt), hf_quant_config
    carries ``exclude_modules`` + group_size 16, identical sets; CT carries ``ignore`` with
    format nvfp4-pack-quantized. A build with exclude_modules only in config.json is refused."""
    from quantize.inspect.check import check_build

    t = {"model.embed_tokens.weight": torch.randn(64, 64).bfloat16(), "lm_head.weight": torch.randn(64, 64).bfloat16()}
    t.update(fp8_pair("model.layers.0.mlp.down_proj", torch.randn(64, 64) * 0.1))
    t.update(fp8_pair("model.layers.0.self_attn.kv_b_proj", torch.randn(64, 40) * 0.1))  # K=40 stays bf16
    src = write_checkpoint(tmp_path / "s", t, {"model_type": "llama", "quantization_config": BLOCK_FP8_QC})
    convert(src, tmp_path / "mo", fmt="modelopt", progress=False)
    qc = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    hf = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == hf["quant_algo"] == "W4A16_NVFP4"
    assert hf["group_size"] == 16 and "kv_cache_quant_algo" in hf
    assert set(qc["ignore"]) == set(hf["exclude_modules"]) == {
        "lm_head", "model.embed_tokens", "model.layers.0.self_attn.kv_b_proj"}
    convert(src, tmp_path / "ct", progress=False)
    ct = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert ct["format"] == "nvfp4-pack-quantized" and set(ct["ignore"]) == set(qc["ignore"])
    # the field bug: the BF16 modules under exclude_modules only
    cfg = json.loads((tmp_path / "mo" / "config.json").read_text())
    cfg["quantization_config"]["exclude_modules"] = cfg["quantization_config"].pop("ignore")
    (tmp_path / "mo" / "config.json").write_text(json.dumps(cfg))
    errors = [f.message for f in check_build(tmp_path / "mo") if f.level == "error"]
    assert any("has no 'ignore'" in e for e in errors)


def test_mixed_ct_config_targets_are_exact_for_their_group():
    groups = {"nvfp4": [f"model.layers.{i}.mlp.experts.{e}.down_proj" for i in (1, 2) for e in range(3)],
              "fp8-block": ["model.layers.1.self_attn.o_proj", "model.layers.2.self_attn.o_proj"]}
    compact = compressed_tensors.compact_targets(groups, ["model.layers.3.self_attn.o_proj"])
    assert compact["nvfp4"] == [r"re:^model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj$"]
    # layer 3's o_proj is ignored: the o_proj pattern would claim it, so exact names are kept
    assert compact["fp8-block"] == groups["fp8-block"]
