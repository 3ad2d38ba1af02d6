"""The tiny GLM-5.3-Flash (glm5_next) FP8 release fixture converted with every preset and format."""

import json

import pytest
import torch
from conftest import load_all

from formats.checkpoint import INDEX_NAME
from formats.shards import read_header
from formats.sources import open_source
from quantize import archs
from quantize.convert.pipeline import convert
from quantize.inspect.check import check_build
from quantize.kernels.nvfp4 import dequantize_nvfp4, unpack_e2m1
from quantize.plan.recipe import load_recipe
from quantize.plan.tensors import plan_tensors, predicted_bytes

P = "model.language_model.layers"
PRESETS = ("weight-only", "spark-mixed", "experts-only")
FORMATS = ("compressed-tensors", "modelopt")
NVFP4_SUFFIXES = {"compressed-tensors": (".weight_packed", ".weight_scale", ".weight_global_scale"),
                  "modelopt": (".weight", ".weight_scale", ".weight_scale_2")}


@pytest.fixture(scope="module")
def builds(glm5_next_src, tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5_builds")
    out = {}
    for fmt in FORMATS:
        for preset in PRESETS:
            folder = root / f"{fmt}-{preset}"
            out[fmt, preset] = (folder, convert(glm5_next_src, folder, fmt=fmt, recipe=preset,
                                                progress=False, device="cpu"))
    return out


def source_module_of(name: str, fmt: str, out_names: set[str]) -> str:
    """Undo the documented renames: a build tensor -> the source tensor it came from."""
    for suffix in (".weight_packed", ".weight_global_scale", ".weight_scale_2", ".weight_scale"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_source_tensor_accounted_for_and_check_clean(builds, glm5_next_src, fmt, preset):
    folder, summary = builds[fmt, preset]
    src = open_source(glm5_next_src)
    idx = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    derived = {source_module_of(n, fmt, set(idx)) for n in idx}
    assert derived == set(src.tensors)  # nothing dropped, nothing invented (FC-18)
    assert not any(n.endswith("_scale_inv") for n in idx)
    mtp = {n for n in idx if n.startswith(f"{P}.4.")}
    assert {f"{P}.4.{s}" for s in archs.MTP_EXTRA_TENSORS} <= mtp
    assert check_build(folder, engine="vllm") == summary.findings
    assert not [f for f in summary.findings if f.level == "error"]
    # predicted bytes (headers only) == what was written, to the byte
    decisions = plan_tensors(src, load_recipe(preset))
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
                 f"{P}.0.self_attn.A_log", f"{P}.4.hc_attn_scale"):
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
    """FC-07: enumerate every fused group of the weight-only build from the per-architecture
    map; each NVFP4 group has one global scale, and it is 2688 / (max member amax)."""
    for fmt, key in (("compressed-tensors", ".weight_global_scale"), ("modelopt", ".weight_scale_2")):
        folder, _ = builds[fmt, "weight-only"]
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
        assert {"in_proj_qkvbfg_a", "fused_qkv_a_proj", "gate_up_proj"} <= kinds


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


def test_weight_only_gets_the_unconfirmed_vllm_warning_only(builds):
    _, summary = builds["compressed-tensors", "weight-only"]
    assert {(f.level, f.kind) for f in summary.findings} == {("warning", "sensitive")}
    assert any("27 kda Linear(s)" in f.message for f in summary.findings)
    # the DSA indexer pair stays high precision: weights_proj is sensitive, wk follows its group
    out = load_all(builds["compressed-tensors", "weight-only"][0])
    assert out[f"{P}.3.self_attn.indexer.wk.weight"].dtype == torch.bfloat16
    assert f"{P}.3.self_attn.indexer.wq_b.weight_packed" in out


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
