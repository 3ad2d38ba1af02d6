"""scripts/engine_check.py: the parts that run without vLLM (reference folder, comparison
math, log parsing), with real values."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quantize"))
from test_recipes import moe_layer  # noqa: E402

from eval.models import dequantized_build_state  # noqa: E402
from quantize.convert.pipeline import convert  # noqa: E402
from quantize.kernels.nvfp4 import dequantize_nvfp4  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "engine_check", Path(__file__).resolve().parents[2] / "scripts" / "engine_check.py")
ec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ec)

E = "model.layers.1.mlp.experts.3.up_proj"


def test_module_imports_without_vllm():
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_reference_folder_is_our_dequantization_in_bf16(tmp_path, fmt):
    src, _ = moe_layer(tmp_path, n_layers=2)
    build = tmp_path / fmt
    convert(src, build, fmt=fmt, progress=False)
    ref = ec.write_reference_folder(build, tmp_path / "ref")
    cfg = json.loads((ref / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["topk_method"] == "noaux_tc"
    t = load_file(str(ref / "model.safetensors"))
    assert not any(n.endswith(("_packed", "_scale", "_scale_2", "_global_scale", "_scale_inv")) for n in t)
    b = {}
    for shard in build.glob("*.safetensors"):
        b.update(load_file(str(shard)))
    if fmt == "modelopt":
        want = dequantize_nvfp4(b[f"{E}.weight"], b[f"{E}.weight_scale"], 1.0 / b[f"{E}.weight_scale_2"].reshape(1))
    else:
        want = dequantize_nvfp4(b[f"{E}.weight_packed"], b[f"{E}.weight_scale"], b[f"{E}.weight_global_scale"])
    assert t[f"{E}.weight"].dtype == torch.bfloat16 and t[f"{E}.weight"].shape == (32, 64)
    assert torch.equal(t[f"{E}.weight"], want.to(torch.bfloat16))
    assert torch.equal(t[f"{E}.weight"], dequantized_build_state(build, torch.bfloat16)[f"{E}.weight"])
    assert 0.1 < float(t[f"{E}.weight"].float().abs().max()) < 0.5  # randn * 0.05, 2048 values
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert t[bias].dtype == torch.float32 and torch.equal(t[bias], b[bias])
    assert t["model.layers.2.eh_proj.weight"].shape == (64, 128)  # the MTP layer is kept


def test_compare_logprobs_known_values():
    a = [np.log([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]]), np.array([[0.0, -np.inf, -np.inf]])]
    b = [np.log([[0.25, 0.5, 0.25], [0.1, 0.3, 0.6]]), np.array([[0.0, -np.inf, -np.inf]])]
    got = ec.compare_logprobs(a, b)
    assert got["positions"] == 3 and got["top1"] == pytest.approx(1 / 3)
    assert got["mean_abs"] == pytest.approx(4 * math.log(2) / 9)
    assert got["max_abs"] == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match=r"logprob shapes \(2, 3\) vs \(1, 3\)"):
        ec.compare_logprobs(a[:1], b[1:])
    with pytest.raises(ValueError, match="2 prompts vs 1"):
        ec.compare_logprobs(a, b[:1])


def test_greedy_agreement_and_prompts():
    assert ec.greedy_agreement([[1, 2, 3], [4, 5]], [[1, 2, 4], [4, 5, 6]]) == pytest.approx(4 / 6)
    p = ec.make_prompts(3, 5, 256)
    assert p == ec.make_prompts(3, 5, 256) and len(p) == 3 and all(len(x) == 5 for x in p)
    assert all(1 <= t < 256 for x in p for t in x) and p != ec.make_prompts(3, 5, 256, seed=1)


def test_parse_kernel_lines_of_vllm_026():
    lines = [
        "Using MarlinNvFp4LinearKernel for NVFP4 GEMM",
        "Using 'MARLIN' NvFp4 MoE backend out of potential backends: ['FLASHINFER_TRTLLM', 'MARLIN']",
        "Using FLASH_ATTN_MLA attention backend out of potential backends: ['FLASH_ATTN_MLA', 'FLASHMLA'].",
        "Using FLASH_ATTN MLA prefill backend.",
        "Selected CutlassFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8",
        "Detected ModelOpt NVFP4 checkpoint (quant_algo=W4A16_NVFP4). Please note that",
        "Using fp8_ds_mla KV cache format for FLASHMLA_SPARSE backend.",
        "Marlin requires thread-tile padding for some weight shapes in this model",
        "Using MarlinNvFp4LinearKernel for NVFP4 GEMM",  # repeated: listed once
        "Loading weights took 0.31 seconds",
    ]
    assert ec.parse_kernel_lines(lines) == {
        "linear": ["MarlinNvFp4LinearKernel"], "moe": ["MARLIN"], "attention": ["FLASH_ATTN_MLA"],
        "mla_prefill": ["FLASH_ATTN"], "linear_fp8": ["CutlassFP8ScaledMMLinearKernel (CompressedTensorsW8A8Fp8)"],
        "method": ["NVFP4 (W4A16_NVFP4)"], "kv_cache": ["fp8_ds_mla"],
        "warning": ["Marlin requires thread-tile padding"]}


def test_module_kinds_by_class():
    def mod(cls, qm):
        return type(cls, (), {"quant_method": type(qm, (), {})()})()

    named = [("lm_head", mod("ParallelLMHead", "UnquantizedEmbeddingMethod")),
             ("model.layers.1.mlp.experts", mod("FusedMoE", "CompressedTensorsW4A4Nvfp4MoEMethod")),
             ("model.layers.0.self_attn.mla_attn", mod("MLAAttention", "BaseKVCacheMethod")),
             ("model.layers.0.mlp.gate_up_proj", mod("MergedColumnParallelLinear", "CompressedTensorsLinearMethod")),
             ("model.layers.0.mlp.down_proj", mod("RowParallelLinear", "CompressedTensorsLinearMethod")),
             ("model.norm", type("RMSNorm", (), {})())]
    assert ec.module_kinds(named) == {
        "lm_head": ["UnquantizedEmbeddingMethod"], "moe": ["CompressedTensorsW4A4Nvfp4MoEMethod"],
        "attention": ["BaseKVCacheMethod"], "linear": ["CompressedTensorsLinearMethod"]}


def test_missing_build_is_a_row_not_a_traceback(tmp_path, capsys):
    assert ec.main([str(tmp_path / "nosuch")]) == 1
    assert capsys.readouterr().out == f"{tmp_path / 'nosuch'}: vllm loaded=no (no config.json)\n"
    assert "vllm" not in sys.modules
