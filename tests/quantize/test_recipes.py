"""Recipes, fused groups, narrow projections under TP, mixed builds, and field cases
FC-06, FC-07, FC-15, FC-18 (FC-16 for both formats: tests/quantize/test_pipeline.py)."""

import json

import pytest
import torch
from conftest import BLOCK_FP8_QC, fp8_pair, load_all, write_checkpoint

from formats.checkpoint import INDEX_NAME
from formats.sources import open_source
from quantize.base.errors import RecipeError
from quantize.convert.pipeline import convert
from quantize.inspect.check import check_build
from quantize.kernels.nvfp4 import dequantize_nvfp4
from quantize.plan.recipe import Target, load_recipe, preset_names
from quantize.plan.tensors import plan_tensors, predicted_bytes


def with_amax(shape, amax, seed):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return w * (amax / w.abs().max())


def assert_fp4_close(deq, ref):
    n, k = ref.shape
    block_amax = ref.view(n, k // 16, 16).abs().amax(-1, keepdim=True)
    assert ((deq - ref).abs().view(n, k // 16, 16) <= block_amax / 6 * (1 + 1 / 16) + 1e-12).all()


def recipe_file(tmp_path, rules: list[tuple[str, str]], name="custom"):
    body = f'name = "{name}"\n' + "".join(f'[[rule]]\nmatch = "{m}"\ntarget = "{t}"\n' for m, t in rules)
    p = tmp_path / f"{name}.toml"
    p.write_text(body)
    return str(p)


def test_presets_ship_and_parse():
    assert {"weight-only", "spark-mixed", "experts-only"} <= set(preset_names())
    sm = load_recipe("spark-mixed")
    assert sm.resolve("x.mlp.experts.3.down_proj", frozenset({"routed_expert"})) is Target.NVFP4
    assert sm.resolve("x.self_attn.o_proj", frozenset({"kda"})) is Target.BF16
    assert sm.resolve("x.self_attn.o_proj", frozenset({"mla"})) is Target.BF16
    assert load_recipe("experts-only").resolve("x.mlp.shared_experts.up_proj", frozenset({"shared_expert"})) is Target.KEEP


def test_unknown_role_and_target_named(tmp_path):
    with pytest.raises(RecipeError, match="unknown role"):
        load_recipe(recipe_file(tmp_path, [("role:moe", "nvfp4")]))
    with pytest.raises(RecipeError, match="unknown target 'int4'"):
        load_recipe(recipe_file(tmp_path, [("re:.*", "int4")]))


def dense_mlp_source(tmp_path, **amax):
    t = {f"model.layers.0.mlp.{m}.weight": with_amax((96, 64), amax.get(m, 1.0), i)
         for i, m in enumerate(("gate_proj", "up_proj"))}
    t["model.layers.0.mlp.down_proj.weight"] = with_amax((64, 96), 1.0, 5)
    return write_checkpoint(tmp_path / "dense", t, {"model_type": "llama"})


def test_recipe_splitting_a_fused_group_is_refused_by_name(tmp_path):
    src = dense_mlp_source(tmp_path)
    r = recipe_file(tmp_path, [("re:.*gate_proj$", "nvfp4"), ("re:.*up_proj$", "fp8-block")])
    with pytest.raises(RecipeError, match=r"splits fused group model\.layers\.0\.mlp\.gate_up_proj "
                                          r"\(gate_proj -> nvfp4, up_proj -> fp8-block\)"):
        convert(src, tmp_path / "o", recipe=r, progress=False)
    assert not (tmp_path / "o").exists()


def test_fc06_gate_up_share_one_global_scale(tmp_path):
    """FC-06: gate amax 1.0, up amax 100.0 (64x64): both get 100/2688 (CT 26.88), gate's block
    scales re-derived against it (~4.48, not 448), both dequantize within FP4 error, and
    'take the first half's scale' loading shows no x100 error."""
    t = {"model.layers.1.mlp.experts.0.gate_proj.weight": with_amax((64, 64), 1.0, 1),
         "model.layers.1.mlp.experts.0.up_proj.weight": with_amax((64, 64), 100.0, 2),
         "model.layers.1.mlp.experts.0.down_proj.weight": with_amax((64, 64), 1.0, 3)}
    src = write_checkpoint(tmp_path / "s", t, {"model_type": "deepseek_v3", "n_routed_experts": 1})
    e = "model.layers.1.mlp.experts.0"
    convert(src, tmp_path / "mo", fmt="modelopt", progress=False)
    mo = load_all(tmp_path / "mo")
    s2 = torch.tensor(100.0) / 2688
    assert mo[f"{e}.gate_proj.weight_scale_2"] == s2 == mo[f"{e}.up_proj.weight_scale_2"]
    assert float(s2) == pytest.approx(0.0372, abs=1e-4)
    gate_scales = mo[f"{e}.gate_proj.weight_scale"].to(torch.float32)
    assert gate_scales.max() == torch.tensor(1 / (6 * float(s2))).to(torch.float8_e4m3fn).float() == 4.5
    for m in ("gate_proj", "up_proj"):
        # vLLM's "w1 scale for both" semantics: dequantize with the gate's scale_2
        w1 = mo[f"{e}.gate_proj.weight_scale_2"].reshape(1)
        assert_fp4_close(dequantize_nvfp4(mo[f"{e}.{m}.weight"], mo[f"{e}.{m}.weight_scale"], 1 / w1),
                         t[f"{e}.{m}.weight"])
    convert(src, tmp_path / "ct", progress=False)
    ct = load_all(tmp_path / "ct")
    assert ct[f"{e}.gate_proj.weight_global_scale"].item() == pytest.approx(26.88, rel=1e-6)
    assert torch.equal(ct[f"{e}.gate_proj.weight_global_scale"], ct[f"{e}.up_proj.weight_global_scale"])


def test_fc07_mla_and_dense_fusion_groups_from_the_map(tmp_path):
    """FC-07: q_a_proj (amax 2) + kv_a_proj_with_mqa (amax 8) -> 8/2688 (CT 336); dense gate/up
    (amax 1, 3) -> 3/2688; groups come from quantize.archs, not string guessing."""
    t = {"model.layers.0.self_attn.q_a_proj.weight": with_amax((32, 64), 2.0, 1),
         "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": with_amax((48, 64), 8.0, 2),
         "model.layers.0.mlp.gate_proj.weight": with_amax((96, 64), 1.0, 3),
         "model.layers.0.mlp.up_proj.weight": with_amax((96, 64), 3.0, 4)}
    src = write_checkpoint(tmp_path / "s", t, {"model_type": "deepseek_v3"})
    convert(src, tmp_path / "mo", fmt="modelopt", progress=False)
    mo = load_all(tmp_path / "mo")
    a = "model.layers.0.self_attn"
    assert mo[f"{a}.q_a_proj.weight_scale_2"] == mo[f"{a}.kv_a_proj_with_mqa.weight_scale_2"] == torch.tensor(8.0) / 2688
    assert float(mo[f"{a}.q_a_proj.weight_scale_2"]) == pytest.approx(0.002976, abs=1e-6)
    assert mo["model.layers.0.mlp.gate_proj.weight_scale_2"] == torch.tensor(3.0) / 2688
    convert(src, tmp_path / "ct", progress=False)
    ct = load_all(tmp_path / "ct")
    assert ct[f"{a}.q_a_proj.weight_global_scale"].item() == ct[f"{a}.kv_a_proj_with_mqa.weight_global_scale"].item() == 336.0


def moe_layer(tmp_path, n_layers=2, mtp=True):
    """DeepSeek-style FP8 layers 1..n-1 with 8 experts + router, MTP layer n (all FP8,
    eh_proj and shared_head.head included)."""
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(128, 64, generator=g).bfloat16(),
         "model.layers.0.input_layernorm.weight": torch.ones(64).bfloat16()}  # config has layer 0
    layers = range(1, n_layers + (1 if mtp else 0))
    for layer in layers:
        p = f"model.layers.{layer}"
        t[f"{p}.mlp.gate.weight"] = torch.randn(8, 64, generator=g).bfloat16()
        t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.randn(8, generator=g)
        for e in range(8):
            for m, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                t.update(fp8_pair(f"{p}.mlp.experts.{e}.{m}", torch.randn(*shape, generator=g) * 0.05))
        for m, shape in (("q_a_proj", (32, 64)), ("kv_a_proj_with_mqa", (48, 64)), ("kv_b_proj", (128, 32)),
                         ("o_proj", (64, 64))):
            t.update(fp8_pair(f"{p}.self_attn.{m}", torch.randn(*shape, generator=g) * 0.05))
    if mtp:
        p = f"model.layers.{n_layers}"
        for m, shape in (("eh_proj", (64, 128)), ("shared_head.head", (128, 64))):
            t.update(fp8_pair(f"{p}.{m}", torch.randn(*shape, generator=g) * 0.05))
        for m in ("enorm", "hnorm", "shared_head.norm"):
            t[f"{p}.{m}.weight"] = torch.ones(64).bfloat16()
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": n_layers, "num_nextn_predict_layers": int(mtp),
           "n_routed_experts": 8, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
           "quantization_config": BLOCK_FP8_QC}
    return write_checkpoint(tmp_path / f"moe{n_layers}", t, cfg, n_shards=3), t


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_fc18_mtp_layer_kept_complete(tmp_path, fmt):
    """FC-18: num_hidden_layers=2, one NextN layer: every input key appears after the
    documented renames, the MTP layer index comes from config, eh_proj / shared_head.head
    (FP8 on input) are written BF16 and ignored, MTP experts use the main scheme."""
    src, t = moe_layer(tmp_path, n_layers=2)
    out = tmp_path / fmt
    convert(src, out, fmt=fmt, progress=False)
    written = set(json.loads((out / INDEX_NAME).read_text())["weight_map"])
    renames = (".weight_packed", ".weight_global_scale", ".weight_scale_2", ".weight_scale")
    back = {next((n[: -len(s)] + ".weight" for s in renames if n.endswith(s)), n) for n in written}
    assert back == {k for k in t if not k.endswith("_scale_inv")}
    o = load_all(out)
    assert o["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16
    assert o["model.layers.2.shared_head.head.weight"].dtype == torch.bfloat16
    assert o["model.layers.2.mlp.experts.7.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {"model.layers.2.eh_proj", "model.layers.2.shared_head.head", "model.layers.2.mlp.gate"} <= set(qc["ignore"])
    assert not [f for f in check_build(out) if f.level == "error"]
    # the MTP index follows config: claim 3 main layers and the check finds no layer 3
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (out / "config.json").write_text(json.dumps(cfg))
    assert any(f.kind == "mtp" and "layer 3" in f.message for f in check_build(out))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_fc15_router_bf16_listed_in_both_lists(tmp_path, fmt):
    """FC-15: router [8, 64] BF16 + bias F32 [8] beside quantized experts: the router is in
    exclude_modules and ignore; the invariant holds and the check enforces it."""
    src, t = moe_layer(tmp_path, n_layers=2, mtp=False)
    out = tmp_path / fmt
    convert(src, out, fmt=fmt, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert "model.layers.1.mlp.gate" in cfg["quantization_config"]["ignore"]
    if fmt == "modelopt":
        hf = json.loads((out / "hf_quant_config.json").read_text())
        assert "model.layers.1.mlp.gate" in hf["quantization"]["exclude_modules"]
    o = load_all(out)
    assert torch.equal(o["model.layers.1.mlp.gate.weight"].view(torch.int16),
                       t["model.layers.1.mlp.gate.weight"].view(torch.int16))
    assert torch.equal(o["model.layers.1.mlp.gate.e_score_correction_bias"], t["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert check_build(out) == []
    # drop the router from the lists: the check names it
    cfg["quantization_config"]["ignore"].remove("model.layers.1.mlp.gate")
    (out / "config.json").write_text(json.dumps(cfg))
    if fmt == "modelopt":
        hf["quantization"]["exclude_modules"].remove("model.layers.1.mlp.gate")
        (out / "hf_quant_config.json").write_text(json.dumps(hf))
    errs = [f for f in check_build(out) if f.level == "error"]
    assert [(f.kind, f.tensor) for f in errs] == [("ignore", "model.layers.1.mlp.gate")]


def test_narrow_projections_under_tp_kept_and_listed(tmp_path):
    """--tp 4: row-parallel down_proj K=96 -> 24 per rank breaks NVFP4's K % 16; it stays
    BF16 with the reason; column-parallel gate/up (N split) stay NVFP4; the TP=4 check is
    clean, and a TP=1 build checked for TP=4 is not."""
    src = dense_mlp_source(tmp_path)
    summary = convert(src, tmp_path / "tp4", tp=4, progress=False)
    o = load_all(tmp_path / "tp4")
    assert o["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32  # dense f32 source: kept as is
    assert "model.layers.0.mlp.gate_proj.weight_packed" in o
    assert any("down_proj.weight kept as keep: K/TP=96/4=24 is not a multiple of 16" in n for n in summary.notes)
    assert check_build(tmp_path / "tp4", tp=4) == []
    convert(src, tmp_path / "tp1", progress=False)
    errs = check_build(tmp_path / "tp1", tp=4)
    assert [(f.kind, f.tensor) for f in errs] == [("align", "model.layers.0.mlp.down_proj")]


def test_fp8_block_narrow_column_split(tmp_path):
    """Block FP8 at TP=2: a column-parallel q_b_proj N=192 -> 96 per rank is not a multiple
    of 128 (vLLM validate_fp8_block_shape), so it is dequantized to BF16 and listed."""
    t = fp8_pair("model.layers.0.self_attn.q_b_proj", torch.randn(192, 128) * 0.05)
    t.update(fp8_pair("model.layers.0.self_attn.o_proj", torch.randn(128, 256) * 0.05))
    src = write_checkpoint(tmp_path / "s", t, {"model_type": "deepseek_v3", "quantization_config": BLOCK_FP8_QC})
    r = recipe_file(tmp_path, [("re:.*", "fp8-block")])
    summary = convert(src, tmp_path / "o", recipe=r, tp=2, progress=False)
    o = load_all(tmp_path / "o")
    assert o["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.bfloat16
    assert o["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn  # K/TP = 128
    assert any("N/TP=192/2=96 is not a multiple of 128" in n for n in summary.notes)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_mixed_build_passes_fp8_through_and_loads(tmp_path, fmt):
    """experts NVFP4, MLA fp8-block (source bytes + scales renamed, untouched), dense MXFP8:
    predicted bytes == written, the check is clean, compressed-tensors decodes every format."""
    from eval.models import build_dense_state

    src, t = moe_layer(tmp_path, n_layers=2, mtp=False)
    r = recipe_file(tmp_path, [("role:routed_expert", "nvfp4"), ("role:mla", "fp8-block")])
    out = tmp_path / fmt
    # vLLM 0.26 cannot load FP8_PB_WO inside ModelOpt MIXED_PRECISION (refused for it, see
    # test_check.test_vllm_refuses_modelopt_mixed_block_fp8); TensorRT-LLM loads that layout.
    engine = "trtllm" if fmt == "modelopt" else "vllm"
    convert(src, out, fmt=fmt, recipe=r, engine=engine, progress=False)
    o = load_all(out)
    for m in ("q_a_proj", "kv_b_proj", "o_proj"):
        p = f"model.layers.1.self_attn.{m}"
        assert torch.equal(o[f"{p}.weight"].view(torch.uint8), t[f"{p}.weight"].view(torch.uint8))
        assert torch.equal(o[f"{p}.weight_scale"], t[f"{p}.weight_scale_inv"])
    source = open_source(src)
    decisions = plan_tensors(source, load_recipe(r), engine=engine)
    total = json.loads((out / INDEX_NAME).read_text())["metadata"]["total_size"]
    assert sum(predicted_bytes(source, decisions, fmt).values()) == total
    assert check_build(out, engine=engine) == []
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if fmt == "compressed-tensors":
        assert qc["format"] == "mixed-precision"
        assert {g["format"] for g in qc["config_groups"].values()} == {"nvfp4-pack-quantized", "float-quantized"}
    else:
        assert qc["quant_algo"] == "MIXED_PRECISION"
        assert qc["quantized_layers"]["model.layers.1.self_attn.o_proj"] == {"quant_algo": "FP8_PB_WO"}
    dense = build_dense_state(out)
    ref = source.read("model.layers.1.self_attn.o_proj.weight")
    assert torch.equal(dense["model.layers.1.self_attn.o_proj.weight"].float(), ref)  # fp8 x scale, exact


def test_mxfp8_target(tmp_path):
    src = dense_mlp_source(tmp_path)
    r = recipe_file(tmp_path, [("re:.*", "mxfp8")])
    convert(src, tmp_path / "o", recipe=r, progress=False)
    o = load_all(tmp_path / "o")
    assert o["model.layers.0.mlp.gate_proj.weight_scale"].shape == (96, 2)
    assert o["model.layers.0.mlp.gate_proj.weight_scale"].dtype == torch.uint8
    findings = check_build(tmp_path / "o")
    assert [(f.level, f.kind) for f in findings] == [("warning", "config")]  # vLLM CT MXFP8 unconfirmed
    assert not [f for f in check_build(tmp_path / "o", engine="trtllm") if f.level == "error"]
