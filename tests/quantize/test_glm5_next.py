"""The tiny GLM-5.3-Flash (glm5_next) FP8 release fixture converted with every preset and format."""

import json

import pytest
import torch
from conftest import load_all

from formats.checkpoint import INDEX_NAME
from formats.shards import read_header
from formats.sources import open_source
from quantize import archs
from quantize.base.errors import RecipeError
from quantize.convert.pipeline import convert
from quantize.inspect.check import check_build
from quantize.kernels.nvfp4 import dequantize_nvfp4, unpack_e2m1
from quantize.plan.recipe import load_recipe
from quantize.plan.tensors import plan_tensors, predicted_bytes

P = "model.language_model.layers"
FORMATS = ("compressed-tensors", "modelopt")
# (format, preset, engine). vLLM cannot load a weight-only glm5_next build (it builds the MLA,
# indexer and KDA projections unquantized, formats.engines.MODEL_RULES), so that plan is refused
# for --engine vllm; the weight-only build here is planned for TensorRT-LLM, which loads
# ModelOpt W4A16_NVFP4 (its compressed-tensors NVFP4A16 row is an error, so no CT weight-only).
BUILDS = [(fmt, preset, "vllm") for fmt in FORMATS for preset in ("spark-mixed", "experts-only")] + [
    ("modelopt", "weight-only", "trtllm")]
NVFP4_SUFFIXES = {"compressed-tensors": (".weight_packed", ".weight_scale", ".weight_global_scale"),
                  "modelopt": (".weight", ".weight_scale", ".weight_scale_2")}


@pytest.fixture(scope="module")
def builds(glm5_next_src, tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5_builds")
    out = {}
    for fmt, preset, engine in BUILDS:
        folder = root / f"{fmt}-{preset}"
        out[fmt, preset] = (folder, convert(glm5_next_src, folder, fmt=fmt, recipe=preset, engine=engine,
                                            progress=False, device="cpu"))
    return out


def source_module_of(name: str, fmt: str, out_names: set[str]) -> str:
    """Undo the documented renames: a build tensor -> the source tensor it came from."""
    for suffix in (".weight_packed", ".weight_global_scale", ".weight_scale_2", ".weight_scale"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return name


@pytest.mark.parametrize("fmt,preset,engine", BUILDS)
def test_every_source_tensor_accounted_for_and_check_clean(builds, glm5_next_src, fmt, preset, engine):
    folder, summary = builds[fmt, preset]
    src = open_source(glm5_next_src)
    idx = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    derived = {source_module_of(n, fmt, set(idx)) for n in idx}
    assert derived == set(src.tensors)  # nothing dropped, nothing invented (FC-18)
    assert not any(n.endswith("_scale_inv") for n in idx)
    mtp = {n for n in idx if n.startswith(f"{P}.4.")}
    # the release's MTP layer: no shared_head.head (vLLM uses lm_head) and no mHC (§A.3.4)
    assert {f"{P}.4.{s}" for s in archs.MTP_EXTRA_TENSORS if s != "shared_head.head.weight"} <= mtp
    assert not [n for n in mtp if n.startswith((f"{P}.4.shared_head.head", f"{P}.4.hc_"))]
    assert check_build(folder, engine=engine) == summary.findings
    assert not [f for f in summary.findings if f.level == "error"]
    # predicted bytes (headers only) == what was written, to the byte
    decisions = plan_tensors(src, load_recipe(preset), engine=engine)
    index = json.loads((folder / INDEX_NAME).read_text())
    assert sum(predicted_bytes(src, decisions, fmt).values()) == index["metadata"]["total_size"]
    assert summary.bytes_out == index["metadata"]["total_size"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_routers_bias_kda_mhc_untouched_in_spark_mixed(builds, glm5_next_src, fmt):
    folder, _ = builds[fmt, "spark-mixed"]
    out, src = load_all(folder), open_source(glm5_next_src)
    for layer in (1, 2, 3, 4):
        r = f"{P}.{layer}.mlp.gate"
        assert torch.equal(out[f"{r}.weight"].view(torch.int16), src.read_raw(f"{r}.weight").view(torch.int16))
        b = out[f"{r}.e_score_correction_bias"]
        assert b.dtype == torch.float32
        assert torch.equal(b.view(torch.int32), src.read_raw(f"{r}.e_score_correction_bias").view(torch.int32))
    for name in (f"{P}.0.hc_attn_fn", f"{P}.0.hc_ffn_base", f"{P}.0.self_attn.q_conv1d.weight",
                 f"{P}.0.self_attn.A_log", f"{P}.3.hc_attn_scale"):
        raw = src.read_raw(name)
        assert out[name].dtype == raw.dtype and torch.equal(out[name].view(torch.uint8), raw.view(torch.uint8))
    # KDA projections: the FP8 values, dequantized exactly and rounded once to bf16
    for m in ("q_proj", "b_proj", "f_a_proj", "g_b_proj", "o_proj"):
        name = f"{P}.0.self_attn.{m}.weight"
        assert out[name].dtype == torch.bfloat16
        assert torch.equal(out[name], src.read(name).to(torch.bfloat16))
    # experts, shared experts, dense MLP and the MTP layer's experts are NVFP4
    packed = NVFP4_SUFFIXES[fmt][0]
    for m in (f"{P}.1.mlp.experts.5.down_proj", f"{P}.2.mlp.shared_experts.up_proj", f"{P}.0.mlp.gate_proj",
              f"{P}.4.mlp.experts.0.gate_proj"):
        assert out[m + packed].dtype == torch.uint8, m
    assert out[f"{P}.4.eh_proj.weight"].dtype == torch.bfloat16


def test_every_engine_fusion_group_shares_one_global_scale(builds):
    """FC-07: enumerate every fused group of a build from the per-architecture map; each NVFP4
    group has one global scale. The weight-only (TRT-LLM) build quantizes the KDA, MLA and MLP
    fused groups; spark-mixed only the MLP ones."""
    for fmt, preset, key, want in (
            ("modelopt", "weight-only", ".weight_scale_2", {"in_proj_qkvbfg_a", "fused_qkv_a_proj", "gate_up_proj"}),
            ("compressed-tensors", "spark-mixed", ".weight_global_scale", {"gate_up_proj"})):
        folder, _ = builds[fmt, preset]
        out = load_all(folder)
        modules = {n[: -len(key)] for n in out if n.endswith(key)}
        seen, kinds = set(), set()
        for mod in sorted(modules):
            grp = archs.fused_group_of(mod, modules)
            if grp is None or grp[0] in seen:
                continue
            seen.add(grp[0])
            kinds.add(grp[0].rsplit(".", 1)[-1])
            vals = {float(out[m + key]) for m in grp[1]}
            assert len(vals) == 1, grp
        assert kinds == want, (fmt, preset)


def test_ignore_lists_match_tensors(builds):
    """FC-15 invariant on the real layout: every unquantized 2-D Linear weight is ignored and
    no ignored module has quantized tensors; ModelOpt ignore == exclude_modules (FC-25)."""
    for fmt in FORMATS:
        folder, _ = builds[fmt, "spark-mixed"]
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        heads = {}
        for shard in {p.name for p in folder.glob("*.safetensors")}:
            heads.update(read_header(folder / shard))
        plain = {n[:-7] for n, i in heads.items() if n.endswith(".weight") and len(i.shape) == 2
                 and i.dtype in ("BF16", "F32")}
        assert plain <= set(qc["ignore"])
        quantized = {n.rsplit(".", 1)[0] for n in heads if n.endswith(NVFP4_SUFFIXES[fmt][2])}
        assert not quantized & set(qc["ignore"])
        assert f"{P}.1.mlp.gate" in qc["ignore"] and "model.visual.blocks.0.attn.qkv" in qc["ignore"]
        if fmt == "modelopt":
            hf = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
            assert hf["exclude_modules"] == qc["ignore"] and hf["quant_algo"] == qc["quant_algo"] == "W4A16_NVFP4"


VLLM_WEIGHT_ONLY_REFUSAL = (
    "recipe weight-only quantizes 27 kda, 2 indexer, 10 mla Linear(s) of glm5_next that vllm cannot "
    f"load: {P}.0.self_attn.b_proj.weight -> nvfp4; vLLM 0.32 glm5next builds every KDA projection "
    "with quant_config=None (models/glm5next/common/kda.py:210-216): a quantized KDA projection does "
    "not load. Choose a recipe that keeps them bf16 (spark-mixed)")


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_only_is_refused_for_vllm_before_writing(glm5_next_src, tmp_path, fmt):
    """vLLM 0.32 glm5next builds MLA, indexer (wq_b) and KDA without a quant_config: the plan
    is refused before any shard is written (27 KDA = 3 layers x 9, 10 MLA = q_a/kv_a/q_b/kv_b/o
    on layers 3 and 4, 2 indexer wq_b; weights_proj is sensitive and wk follows its group)."""
    with pytest.raises(RecipeError) as e:
        convert(glm5_next_src, tmp_path / "out", fmt=fmt, recipe="weight-only", progress=False, device="cpu")
    assert str(e.value) == VLLM_WEIGHT_ONLY_REFUSAL
    assert not list((tmp_path / "out").glob("*.safetensors")) if (tmp_path / "out").exists() else True


def test_check_names_each_vllm_glm5next_error(builds):
    """The TRT-LLM weight-only build checked for vLLM: one error per role, exact text."""
    folder, _ = builds["modelopt", "weight-only"]
    got = sorted((f.level, f.kind, f.message, f.tensor) for f in check_build(folder, engine="vllm"))
    assert got == [
        ("error", "sensitive", "10 mla Linear(s) quantized: vLLM 0.32 glm5next builds the MLA (fused_qkv_a_proj, "
         "q_b_proj, kv_b_proj, o_proj) with quant_config=None (models/glm5next/common/model.py:397): a "
         "quantized MLA projection does not load", f"{P}.3.self_attn.kv_b_proj"),
        ("error", "sensitive", "2 indexer Linear(s) quantized: vLLM 0.32 glm5next builds the DSA indexer "
         "(wq_b, wk_weights_proj) with quant_config=None (models/glm5next/common/attention.py:229-245): a "
         "quantized indexer projection does not load", f"{P}.3.self_attn.indexer.wq_b"),
        ("error", "sensitive", "27 kda Linear(s) quantized: vLLM 0.32 glm5next builds every KDA projection "
         "with quant_config=None (models/glm5next/common/kda.py:210-216): a quantized KDA projection does "
         "not load", f"{P}.0.self_attn.g_a_proj"),
    ]
    # the DSA indexer pair stays high precision: weights_proj is sensitive, wk follows its group
    out = load_all(folder)
    assert out[f"{P}.3.self_attn.indexer.wk.weight"].dtype == torch.bfloat16
    assert out[f"{P}.3.self_attn.indexer.wq_b.weight"].dtype == torch.uint8


def test_modelopt_and_ct_builds_agree_up_to_ties(builds):
    """Same plan, two formats: block scales identical; packed bytes differ only where the two
    libraries' arithmetic orders round an exact e2m1 tie differently; dequantized values
    differ by one adjacent e2m1 code where they differ (at most 2 units: the 4 -> 6 gap)."""
    ct, mo = load_all(builds["compressed-tensors", "spark-mixed"][0]), load_all(builds["modelopt", "spark-mixed"][0])
    total = diff = 0
    for name in [n for n in ct if n.endswith(".weight_packed")]:
        m = name[: -len(".weight_packed")]
        assert torch.equal(ct[m + ".weight_scale"].view(torch.uint8), mo[m + ".weight_scale"].view(torch.uint8))
        g = ct[m + ".weight_global_scale"]
        assert abs(float(1 / g) - float(mo[m + ".weight_scale_2"])) <= 2.4e-7 * float(1 / g)  # 2 ulp
        total += ct[name].numel()
        diff += int((ct[name] != mo[m + ".weight"]).sum())
        a = dequantize_nvfp4(ct[name], ct[m + ".weight_scale"], g)
        b = dequantize_nvfp4(mo[m + ".weight"], mo[m + ".weight_scale"], 1 / mo[m + ".weight_scale_2"].reshape(1))
        unit = ct[m + ".weight_scale"].to(torch.float32).repeat_interleave(16, 1) / g
        assert ((a - b).abs() <= 2 * unit * 1.0001).all()
        ca, cb = unpack_e2m1(ct[name]).int(), unpack_e2m1(mo[m + ".weight"]).int()
        assert ((ca & 7) - (cb & 7)).abs().max() <= 1
    assert diff / total < 0.02


def test_kl_tiny_glm5_next_build_tracks_source(builds, glm5_next_src):
    """transformers runs the compressed-tensors build (decompressed by compressed-tensors'
    own compressors) and its next-token distributions track the FP8 source."""
    from eval.kl import teacher_forced_kl
    from eval.models import build_dense_state, load_dense_model, source_dense_state
    from quantize.data.texts import essay_texts

    class Bytes:  # the fixture's vocabulary is 256: UTF-8 bytes are valid ids
        def encode(self, text, add_special_tokens=False):
            return list(text.encode("utf-8"))

    cfg = json.loads((glm5_next_src / "config.json").read_text())
    ref = load_dense_model(source_dense_state(glm5_next_src), cfg)
    test = load_dense_model(build_dense_state(builds["compressed-tensors", "spark-mixed"][0]), cfg)
    r = teacher_forced_kl(ref, test, Bytes(), essay_texts(2000), max_tokens=128, window=128)
    print(f"glm5_next tiny spark-mixed CT build: {r}")
    assert 0 < r["mean_kl"] < 0.02
    assert abs(r["ppl_test"] / r["ppl_ref"] - 1) < 0.05
