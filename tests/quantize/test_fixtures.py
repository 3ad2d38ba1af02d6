"""The release-layout fixture builder: names, dtypes and shapes of the real FP8 releases."""

import json

import pytest
import torch

from formats.checkpoint import INDEX_NAME
from formats.shards import read_header
from formats.sources import open_source
from quantize.base.errors import SourceError
from quantize.data.fixtures import (
    release_config,
    write_release_descriptor,
    write_release_fixture,
)

P = "model.language_model.layers"


def headers(folder):
    out = {}
    for shard in set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()):
        out.update(read_header(folder / shard))
    return out


def test_glm5_next_tiny_layout(glm5_next_src):
    h = headers(glm5_next_src)
    cfg = json.loads((glm5_next_src / "config.json").read_text())
    assert cfg["model_type"] == "glm5_next" and cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["text_config"]["num_nextn_predict_layers"] == 1
    # the keys vLLM 0.32 glm5next reads that Glm5NextTextConfig does not declare (§A.3.4)
    assert {k: cfg["text_config"][k] for k in (
        "mhc", "mla_use_nope", "topk_method", "scoring_func", "indexer_rope_interleave",
        "moe_router_dtype", "index_share_for_mtp_iteration", "index_kpool_compress")} == {
        "mhc": True, "mla_use_nope": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "indexer_rope_interleave": True, "moe_router_dtype": "float32",
        "index_share_for_mtp_iteration": True, "index_kpool_compress": True}
    # KDA layer 0: on-disk names of transformers' reverse conversion mapping, all BF16
    # (vLLM has no FP8 load path for KDA projections, §A.3.4).
    kda = f"{P}.0.self_attn"
    for m in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "o_proj"):
        assert h[f"{kda}.{m}.weight"].dtype == "BF16", m
        assert f"{kda}.{m}.weight_scale_inv" not in h, m
    assert h[f"{kda}.b_proj.weight"].shape == (4, 256)  # [linear_num_heads, hidden]
    assert h[f"{kda}.q_conv1d.weight"].shape == (512, 1, 4) and h[f"{kda}.q_conv1d.weight"].dtype == "F32"
    assert h[f"{kda}.A_log"].dtype == "F32" and h[f"{kda}.dt_bias"].dtype == "F32"
    assert h[f"{P}.0.hc_attn_fn"].dtype == "BF16" and h[f"{P}.0.hc_attn_fn"].shape == (8, 512)
    assert h[f"{P}.0.hc_ffn_base"].dtype == "F32"
    # MLA layer 3 + DSA indexer: weights_proj, wq_b and kv_b_proj bf16 without scale; wk and
    # q_a / kv_a / q_b / o_proj FP8 (the ones vLLM dequantizes on load).
    idx = f"{P}.3.self_attn.indexer"
    for name in (f"{idx}.weights_proj.weight", f"{idx}.wq_b.weight", f"{P}.3.self_attn.kv_b_proj.weight"):
        assert h[name].dtype == "BF16" and name + "_scale_inv" not in h, name
    for m in ("indexer.wk", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj"):
        n, k = h[f"{P}.3.self_attn.{m}.weight"].shape
        assert h[f"{P}.3.self_attn.{m}.weight"].dtype == "F8_E4M3", m
        assert h[f"{P}.3.self_attn.{m}.weight_scale_inv"].shape == (-(-n // 128), -(-k // 128))
    assert h[f"{P}.3.self_attn.kv_a_proj_with_mqa.weight"].shape == (512, 256)  # NoPE: kv_lora only
    # MoE: per-expert 2-D experts, router bf16, bias f32.
    assert h[f"{P}.1.mlp.experts.7.down_proj.weight"].shape == (256, 128)
    assert h[f"{P}.1.mlp.gate.weight"].dtype == "BF16" and h[f"{P}.1.mlp.gate.weight"].shape == (8, 256)
    assert h[f"{P}.1.mlp.gate.e_score_correction_bias"].dtype == "F32"
    # MTP layer at index num_hidden_layers (4): extras + an MLA/MoE decoder layer without mHC
    # and without shared_head.head (vLLM mtp.py builds neither; the head is lm_head, §A.3.4).
    for s in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "embed_tokens.weight"):
        assert h[f"{P}.4.{s}"].dtype == "BF16"
    assert h[f"{P}.4.eh_proj.weight"].shape == (256, 512) and h[f"{P}.4.eh_proj.weight"].dtype == "BF16"
    assert not [k for k in h if k.startswith((f"{P}.4.hc_", f"{P}.4.shared_head.head."))]
    assert f"{P}.3.hc_attn_fn" in h and f"{P}.3.hc_ffn_scale" in h
    assert h[f"{P}.4.mlp.experts.0.gate_proj.weight"].dtype == "F8_E4M3"
    assert f"{P}.4.self_attn.q_a_proj.weight_scale_inv" in h
    assert not any(k.startswith(f"{P}.5.") for k in h)
    # Vision tower carried unquantized.
    vis = [k for k in h if k.startswith("model.visual.")]
    assert vis and all(h[k].dtype == "BF16" for k in vis)
    assert h["lm_head.weight"].dtype == "BF16" and "lm_head.weight_scale_inv" not in h
    # Every FP8 weight opens as one logical tensor (no orphan scales, none missing).
    src = open_source(glm5_next_src)
    assert len(src.tensors) == len(h) - sum(k.endswith("_scale_inv") for k in h)


def test_glm5_next_names_load_into_transformers(glm5_next_src, tmp_path):
    """The on-disk names map back onto every parameter of Glm5NextForConditionalGeneration
    through transformers' own conversion mapping (only the MTP layer is left over)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, Glm5NextForConditionalGeneration

    src = open_source(glm5_next_src)
    state = {n: src.read(n).to(torch.float32) for n in src.tensors}
    dense = tmp_path / "dense"
    dense.mkdir()
    save_file(state, str(dense / "model.safetensors"))
    cfg = dict(src.config)
    cfg.pop("quantization_config")
    AutoConfig.for_model(**cfg).save_pretrained(dense)
    model, info = Glm5NextForConditionalGeneration.from_pretrained(dense, output_loading_info=True)
    assert not info["missing_keys"]
    assert all(k.startswith(f"{P}.4.") for k in info["unexpected_keys"])
    w = model.model.language_model.layers[1].mlp.experts.gate_up_proj
    torch.testing.assert_close(w[7, :128], state[f"{P}.1.mlp.experts.7.gate_proj.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("model_type,prefix,mtp", [("glm_moe_dsa", "model.layers", 3),
                                                   ("deepseek_v3", "model.layers", 3)])
def test_other_release_layouts(tmp_path, model_type, prefix, mtp):
    folder = write_release_fixture(tmp_path / model_type, model_type)
    h = headers(folder)
    assert h[f"{prefix}.1.mlp.experts.0.gate_proj.weight"].dtype == "F8_E4M3"
    assert h[f"{prefix}.1.mlp.gate.weight"].dtype == "BF16"
    assert h[f"{prefix}.1.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert h[f"{prefix}.{mtp}.eh_proj.weight"].dtype == "BF16"
    assert f"{prefix}.{mtp}.mlp.experts.7.down_proj.weight_scale_inv" in h
    assert h[f"{prefix}.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 256)  # kv_lora + rope
    if model_type == "glm_moe_dsa":
        assert h[f"{prefix}.0.self_attn.indexer.weights_proj.weight"].dtype == "BF16"


def test_full_size_descriptor_opens_without_data(tmp_path):
    path = write_release_descriptor(tmp_path / "glm53.descriptor.json", "glm5_next", "full")
    src = open_source(path)
    cfg = release_config("glm5_next", "full")["text_config"]
    n, e = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    assert (n, e, cfg["hidden_size"]) == (45, 288, 4096)
    t = src.tensors[f"{P}.{n}.mlp.experts.{e - 1}.down_proj.weight"]
    assert t.is_fp8 and t.shape == (4096, 2048) and t.scale.shape == (32, 16)
    assert f"{P}.{n}.shared_head.head.weight" not in src.tensors  # the MTP head is lm_head
    assert src.tensors["lm_head.weight"].shape == (154880, 4096)
    # 42 MoE layers + the MTP layer, 288 experts, 3 projections each
    assert sum(".mlp.experts." in k for k in src.tensors) == 43 * 288 * 3
    with pytest.raises(SourceError, match="header-only descriptor"):
        src.read(f"{P}.0.self_attn.q_proj.weight")
