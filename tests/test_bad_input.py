"""No silent garbage (issue 17): kinds 1-3 of bad input, each with its exact message.

1. fused 3-D experts are split per expert and quantized, or refused; unplaced weights are
   reported and listed in ``ignore``;
2. the source folder is what the index says (unreferenced shards, another framework's
   metadata, F8_E8M0 scales, ``scale_fmt: ue8m0`` over scales that are not powers of two);
3. activation / KV sidecars of an FP8 source never reach the build; ``quantize check`` flags
   scale tensors on unquantized modules and k/v scales without a KV-cache scheme.
"""

import json

import pytest
import torch
from conftest import (
    BLOCK_FP8_QC,
    ct_nvfp4_reference,
    fp8_pair,
    load_all,
    write_checkpoint,
)
from safetensors.torch import save_file

from formats.sources import inspect_source, open_source
from quantize.base.errors import SourceError
from quantize.convert.pipeline import convert
from quantize.inspect.check import check_build, render_check
from quantize.inspect.preflight import preflight

H, I, E = 32, 32, 4
MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "hidden_size": H, "moe_intermediate_size": I, "num_experts": E,
              "num_hidden_layers": 1, "vocab_size": 64, "torch_dtype": "bfloat16"}


def _moe_tensors(gen, fused=True):
    t = {"model.embed_tokens.weight": torch.randn(64, H, generator=gen).bfloat16(),
         "model.norm.weight": torch.ones(H).bfloat16(),
         "lm_head.weight": torch.randn(64, H, generator=gen).bfloat16(),
         "model.layers.0.self_attn.o_proj.weight": torch.randn(H, H, generator=gen).bfloat16(),
         "model.layers.0.mlp.gate.weight": torch.randn(E, H, generator=gen).bfloat16()}
    gu = torch.randn(E, 2 * I, H, generator=gen).bfloat16()
    down = torch.randn(E, H, I, generator=gen).bfloat16()
    if fused:
        t["model.layers.0.mlp.experts.gate_up_proj"] = gu
        t["model.layers.0.mlp.experts.down_proj"] = down
    else:
        for e in range(E):
            p = f"model.layers.0.mlp.experts.{e}"
            t[f"{p}.gate_proj.weight"], t[f"{p}.up_proj.weight"] = gu[e, :I], gu[e, I:]
            t[f"{p}.down_proj.weight"] = down[e]
    return t


# ---- kind 1: fused 3-D experts -----------------------------------------------------------
def test_fused_experts_split_and_quantized_like_per_expert_release(tmp_path):
    gen = torch.Generator().manual_seed(0)
    fused = _moe_tensors(gen)
    gen = torch.Generator().manual_seed(0)
    per = _moe_tensors(gen, fused=False)
    a = write_checkpoint(tmp_path / "fused", fused, MOE_CONFIG, n_shards=2)
    b = write_checkpoint(tmp_path / "per", per, MOE_CONFIG, n_shards=2)
    src = open_source(a)
    assert src.split["model.layers.0.mlp.experts.gate_up_proj"][:2] == [
        "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight"]
    assert src.tensors["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (H, I)
    assert torch.equal(src.read("model.layers.0.mlp.experts.2.up_proj.weight"),
                       fused["model.layers.0.mlp.experts.gate_up_proj"][2, I:])
    assert torch.equal(src.read_rows("model.layers.0.mlp.experts.1.down_proj.weight", 3, 5),
                       fused["model.layers.0.mlp.experts.down_proj"][1, 3:5])
    sa = convert(a, tmp_path / "out_fused", progress=False)
    convert(b, tmp_path / "out_per", progress=False)
    ta, tb = load_all(tmp_path / "out_fused"), load_all(tmp_path / "out_per")
    assert sorted(ta) == sorted(tb)
    assert not any("gate_up_proj" in n for n in ta)
    for n in ta:
        assert torch.equal(ta[n].view(torch.uint8), tb[n].view(torch.uint8)), n
    # byte-exact against compressed-tensors' own NVFP4 (gate/up share the fused group's amax)
    gate, up = (fused["model.layers.0.mlp.experts.gate_up_proj"][1, s].float()
                for s in (slice(0, I), slice(I, 2 * I)))
    packed, scale, g = ct_nvfp4_reference(gate, torch.maximum(gate.abs().amax(), up.abs().amax()))
    assert torch.equal(ta["model.layers.0.mlp.experts.1.gate_proj.weight_packed"], packed)
    assert torch.equal(ta["model.layers.0.mlp.experts.1.gate_proj.weight_scale"].view(torch.uint8),
                       scale.view(torch.uint8))
    assert torch.equal(ta["model.layers.0.mlp.experts.1.gate_proj.weight_global_scale"], g.reshape(1))
    assert sa.tensors_by_target == {"keep": 4, "nvfp4": 3 * E + 1}  # embed, norm, head, router


@pytest.mark.parametrize("case,want", [
    ("transposed", "fused 3-D expert tensors model.layers.0.mlp.experts.gate_up_proj [4, 32, 64] "
                   "and model.layers.0.mlp.experts.down_proj [4, 32, 32] in "
                   "model-00001-of-00001.safetensors do not fit each other and hidden_size 32; "
                   "expected transformers' experts.gate_up_proj [E, 2I, H] (gate rows then up "
                   "rows) with experts.down_proj [E, H, I]; refusing to write routed experts "
                   "unquantized under a config that says every Linear is quantized"),
    ("alone", "fused 3-D expert tensor model.layers.0.mlp.experts.gate_up_proj in "
              "model-00001-of-00001.safetensors has no model.layers.0.mlp.experts.down_proj"),
    ("odd", "fused 3-D expert tensor model.layers.0.mlp.experts.w13 [4, 64, 32] in "
            "model-00001-of-00001.safetensors: layout not understood"),
    ("fp8", "fused 3-D expert tensor model.layers.0.mlp.experts.gate_up_proj in "
            "model-00001-of-00001.safetensors has dtype F8_E4M3: only bf16 / fp16 / fp32 fused "
            "experts are split"),
])
def test_fused_experts_not_understood_are_refused(tmp_path, case, want):
    t = _moe_tensors(torch.Generator().manual_seed(1))
    gu = "model.layers.0.mlp.experts.gate_up_proj"
    if case == "transposed":  # Llama-4 / gpt-oss orientation [E, H, 2I]
        t[gu] = t[gu].transpose(1, 2).contiguous()
    elif case == "alone":
        del t["model.layers.0.mlp.experts.down_proj"]
    elif case == "odd":
        t["model.layers.0.mlp.experts.w13"] = t.pop(gu)
    else:
        t[gu] = t[gu].float().to(torch.float8_e4m3fn)
    src = write_checkpoint(tmp_path, t, MOE_CONFIG)
    with pytest.raises(SourceError) as e:
        open_source(src)
    assert want in str(e.value)


def test_unplaced_weights_reported_and_ignored(tmp_path):
    t = _moe_tensors(torch.Generator().manual_seed(2), fused=False)
    t["model.visual.patch_embed.proj.weight"] = torch.randn(H, 3, 2, 2).bfloat16()
    src = write_checkpoint(tmp_path / "s", t, MOE_CONFIG)
    recipe = tmp_path / "experts.toml"
    recipe.write_text('name = "experts"\n[[rule]]\nmatch = "role:routed_expert"\ntarget = "nvfp4"\n')
    s = convert(src, tmp_path / "o", recipe=str(recipe), progress=False)
    assert ("2 weight(s) no recipe rule places, written unquantized and listed in ignore: "
            "model.layers.0.self_attn.o_proj.weight, model.visual.patch_embed.proj.weight") in s.notes
    ignore = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.self_attn.o_proj" in ignore and "model.visual.patch_embed.proj" in ignore


def test_check_flags_fused_expert_tensor_in_build(tmp_path):
    t = _moe_tensors(torch.Generator().manual_seed(3), fused=False)
    convert(write_checkpoint(tmp_path / "s", t, MOE_CONFIG), tmp_path / "o", progress=False)
    shard = tmp_path / "o" / "model-00001-of-00001.safetensors"
    from conftest import edit_shard
    edit_shard(shard, lambda d: d.update({"model.layers.0.mlp.experts.gate_up_proj":
                                          torch.zeros(E, 2 * I, H).bfloat16()}))
    idx = tmp_path / "o" / "model.safetensors.index.json"
    d = json.loads(idx.read_text())
    d["weight_map"]["model.layers.0.mlp.experts.gate_up_proj"] = shard.name
    idx.write_text(json.dumps(d))
    lines = [render_check(f) for f in check_build(tmp_path / "o") if f.level == "error"]
    assert lines == ["ERROR [layout] model.layers.0.mlp.experts.gate_up_proj: 3-D fused expert tensor "
                     "[4, 64, 32] in model-00001-of-00001.safetensors: engines load per-expert "
                     "Linears (experts.<e>.gate_proj / up_proj / down_proj), so it would be loaded "
                     "unquantized or not at all"]


# ---- kind 2: the folder is what the index says -------------------------------------------
def test_unreferenced_shard_with_unlisted_tensors_is_an_error(tmp_path):
    src = write_checkpoint(tmp_path, {"a.weight": torch.ones(2, 2)}, {})
    save_file({"mtp.fc.weight": torch.ones(2, 2)}, str(src / "model-extra.safetensors"))
    save_file({"a.weight": torch.ones(2, 2)}, str(src / "old-copy.safetensors"))
    _, findings = inspect_source(src)
    got = [(f.level, f.message) for f in findings if f.kind == "index"]
    assert got == [
        ("error", "model-extra.safetensors is in the folder but the index references no tensor "
                  "in it; it holds 1 tensor(s) the index does not list (e.g. mtp.fc.weight), "
                  "which would be left out of the build: add them to the index or remove the file"),
        ("warning", "old-copy.safetensors is in the folder but the index references no tensor in "
                    "it (its 1 tensor(s) are all listed in other shards); it is not read")]


def test_shard_metadata_of_another_framework_is_an_error(tmp_path):
    src = write_checkpoint(tmp_path, {"a.weight": torch.ones(2, 2)}, {})
    save_file({"a.weight": torch.ones(2, 2)}, str(src / "model-00001-of-00001.safetensors"),
              metadata={"format": "mlx"})
    with pytest.raises(SourceError) as e:
        open_source(src)
    assert ("shard model-00001-of-00001.safetensors: header metadata format 'mlx' says it was "
            "written by MLX, not PyTorch ('pt'); its tensor names and layouts are not "
            "transformers': convert it to a PyTorch checkpoint first") in str(e.value)
    save_file({"a.weight": torch.ones(2, 2)}, str(src / "model-00001-of-00001.safetensors"),
              metadata={"format": "pt"})
    assert open_source(src).tensors["a.weight"].shape == (2, 2)


@pytest.mark.parametrize("declared", [True, False])
def test_f8_e8m0_scales_read_as_powers_of_two(tmp_path, declared):
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(4))
    pair = fp8_pair("m", w)
    e = torch.tensor([[0.5], [0.25]])
    pair["m.weight_scale_inv"] = e.to(torch.float8_e8m0fnu)
    qc = dict(BLOCK_FP8_QC, **({"scale_fmt": "ue8m0"} if declared else {}))
    src = write_checkpoint(tmp_path, pair, {"quantization_config": qc})
    source, findings = inspect_source(src)
    want = pair["m.weight"].float() * torch.tensor([0.5] * 128 + [0.25] * 128)[:, None]
    assert torch.equal(source.read("m.weight"), want)
    assert torch.equal(source.read_rows("m.weight", 127, 130), want[127:130])
    warn = [f.message for f in findings if f.level == "warning"]
    assert warn == ([] if declared else [
        "shard model-00001-of-00001.safetensors: 1 scale(s) stored as F8_E8M0 (e.g. "
        "m.weight_scale_inv) but quantization_config declares no scale_fmt 'ue8m0'; read as the "
        "powers of two they encode"])


def test_ue8m0_declared_over_scales_not_powers_of_two_warns(tmp_path):
    pair = fp8_pair("m", torch.randn(128, 128, generator=torch.Generator().manual_seed(5)))
    pair["m.weight_scale_inv"] = torch.tensor([[0.0123]])
    pow2 = fp8_pair("n", torch.ones(128, 128))
    pow2["n.weight_scale_inv"] = torch.tensor([[0.5]])
    src = write_checkpoint(tmp_path, {**pair, **pow2}, {"quantization_config": dict(
        BLOCK_FP8_QC, scale_fmt="ue8m0")})
    pre = preflight(src)
    assert [f.message for f in pre.findings if f.level == "warning"] == [
        "shard model-00001-of-00001.safetensors: quantization_config declares scale_fmt 'ue8m0' "
        "but 1 scale tensor(s) hold 1 value(s) that are not powers of two (first "
        "m.weight_scale_inv = 0.0122999996); they are used as stored"]


# ---- kind 3: activation / KV sidecars ----------------------------------------------------
def test_block_fp8_activation_and_kv_sidecars_dropped_and_reported(tmp_path):
    g = torch.Generator().manual_seed(6)
    t = {**fp8_pair("model.layers.0.self_attn.q_proj", torch.randn(64, 64, generator=g)),
         "model.layers.0.self_attn.q_proj.input_scale": torch.tensor([0.02]),
         "model.layers.0.self_attn.k_scale": torch.tensor([0.1]),
         "model.layers.0.self_attn.v_scale": torch.tensor([0.2])}
    src = write_checkpoint(tmp_path / "s", t, {"quantization_config": BLOCK_FP8_QC})
    s = convert(src, tmp_path / "o", progress=False)
    assert ("dropped 3 FP8 activation/KV sidecars (input_scale 1, k_scale 1, v_scale 1; e.g. "
            "model.layers.0.self_attn.k_scale): they are in the source's FP8 convention and are not "
            "carried into the build (quantize calibrate writes W4A4 input scales and FP8 KV scales "
            "in the target's)") in s.notes
    out = load_all(tmp_path / "o")
    assert sorted(out) == ["model.layers.0.self_attn.q_proj.weight_global_scale",
                           "model.layers.0.self_attn.q_proj.weight_packed",
                           "model.layers.0.self_attn.q_proj.weight_scale"]


def test_check_flags_scales_on_unquantized_module_and_kv_without_scheme(tmp_path):
    g = torch.Generator().manual_seed(7)
    t = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).bfloat16(),
         "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64, generator=g).bfloat16()}
    convert(write_checkpoint(tmp_path / "s", t, {}), tmp_path / "o", progress=False)
    from conftest import edit_shard
    shard = tmp_path / "o" / "model-00001-of-00001.safetensors"
    # a bf16 v_proj in ignore, with an FP8 source's sidecars written through
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["model.layers.0.self_attn.v_proj"]
    (tmp_path / "o" / "config.json").write_text(json.dumps(cfg))
    extra = {"model.layers.0.self_attn.v_proj.weight": torch.randn(64, 64, generator=g).bfloat16(),
             "model.layers.0.self_attn.v_proj.input_scale": torch.tensor([0.02]),
             "model.layers.0.self_attn.k_scale": torch.tensor([0.1]).bfloat16(),
             "model.layers.0.self_attn.v_scale": torch.tensor([0.1]).bfloat16()}
    edit_shard(shard, lambda d: d.update(extra))
    idx = tmp_path / "o" / "model.safetensors.index.json"
    d = json.loads(idx.read_text())
    d["weight_map"].update({n: shard.name for n in extra})
    idx.write_text(json.dumps(d))
    lines = [render_check(f) for f in check_build(tmp_path / "o") if f.kind == "scale"]
    assert lines == [
        "ERROR [scale] model.layers.0.self_attn.k_scale: 2 k_scale / v_scale tensor(s) (e.g. "
        "model.layers.0.self_attn.k_scale) in a build whose config declares no KV-cache "
        "quantization: engines ignore them or read them in the wrong convention",
        "ERROR [scale] model.layers.0.self_attn.v_proj: input_scale attached to a module the "
        "config leaves unquantized (weight BF16): engines never read it (a carried FP8-source "
        "sidecar?)"]
