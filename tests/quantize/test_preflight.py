"""Pre-flight: every finding of every kind at once, scale values, output folder, size prediction."""

import json

import pytest
import torch
from conftest import BLOCK_FP8_QC, edit_json, edit_shard, fp8_pair, write_checkpoint

from formats.checkpoint import INDEX_NAME
from quantize.base.errors import OutputError, SourceError
from quantize.cli import main
from quantize.convert.pipeline import convert
from quantize.inspect.preflight import check_output, preflight

S1, S2, S3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))


def test_all_findings_of_all_kinds_reported_at_once(tmp_path, tiny_fp8_llama):
    src = tiny_fp8_llama
    edit_json(src / "config.json", lambda c: c.update(num_hidden_layers=3))

    def nan_and_orphan(t):
        t["model.layers.0.self_attn.o_proj.weight_scale_inv"][0, 0] = float("nan")
        t["ghost.weight_scale_inv"] = torch.ones(1, 1)

    edit_shard(src / S1, nan_and_orphan)

    def index(d):
        d["weight_map"]["ghost.weight_scale_inv"] = S1
        d["weight_map"]["mtp.fc.weight"] = "model-00004-of-00003.safetensors"
        del d["weight_map"]["model.layers.0.self_attn.k_proj.weight_scale_inv"]

    edit_json(src / INDEX_NAME, index)
    (src / S3).write_bytes((src / S3).read_bytes()[:-10])
    out = tmp_path / "out"
    out.mkdir()
    (out / "stray").write_text("x")
    with pytest.raises(SourceError) as e:
        convert(src, out, progress=False)
    lines = str(e.value).splitlines()
    assert lines == [
        "8 problem(s) in src:",
        "error: [index] index names shard files that are missing or empty: "
        "model-00004-of-00003.safetensors",
        f"error: [index] model.layers.0.self_attn.k_proj.weight_scale_inv (in {S2}, not listed in "
        "the index)",
        f"error: [header] shard {S3}: tensor model.layers.1.self_attn.q_proj.weight declares bytes "
        "[12568, 16664) but needs 4096 inside a data section of 16654 bytes (truncated or corrupt)",
        f"error: [fp8] orphan scale ghost.weight_scale_inv in {S1}: no weight ghost.weight",
        f"error: [fp8] FP8 weight model.layers.0.self_attn.k_proj.weight in {S1} has no "
        "model.layers.0.self_attn.k_proj.weight_scale_inv",
        f"error: [scale] scale model.layers.0.self_attn.o_proj.weight_scale_inv in {S1} has 1 "
        "NaN/Inf value(s) (first at flat index 0); model.layers.0.self_attn.o_proj.weight cannot "
        "be dequantized",
        "error: [layout] config.json declares num_hidden_layers=3 but the checkpoint has no "
        "tensors for layer(s) 2",
        f"error: [output] output folder {out} is not empty; choose another --out"]
    assert list(out.iterdir()) == [out / "stray"]  # nothing written


def test_missing_scale_of_readable_weight_is_named(tmp_path):
    t = fp8_pair("model.layers.0.mlp.down_proj", torch.randn(32, 64))
    del t["model.layers.0.mlp.down_proj.weight_scale_inv"]
    src = write_checkpoint(tmp_path / "s", t, {"quantization_config": BLOCK_FP8_QC})
    pre = preflight(src)
    assert [f.render() for f in pre.errors] == [
        "error: [fp8] FP8 weight model.layers.0.mlp.down_proj.weight in "
        "model-00001-of-00001.safetensors has no model.layers.0.mlp.down_proj.weight_scale_inv"]


def scaled_source(tmp_path, scale_values):
    t = {}
    for i, v in enumerate(scale_values):
        q = torch.ones(128, 256).to(torch.float8_e4m3fn)
        t[f"model.layers.0.m{i}.weight"] = q
        t[f"model.layers.0.m{i}.weight_scale_inv"] = torch.tensor([[1e-3, v]], dtype=torch.float32)
    return write_checkpoint(tmp_path / "s", t, {"quantization_config": BLOCK_FP8_QC})


def test_scale_values_checked_before_converting(tmp_path):
    src = scaled_source(tmp_path, [float("inf"), -2e-3, 0.0, 1e30, 2e-3])
    msgs = [f.render() for f in preflight(src).findings]
    sh = "model-00001-of-00001.safetensors"
    assert msgs == [
        f"error: [scale] scale model.layers.0.m0.weight_scale_inv in {sh} has 1 NaN/Inf value(s) "
        "(first at flat index 1); model.layers.0.m0.weight cannot be dequantized",
        f"error: [scale] scale model.layers.0.m1.weight_scale_inv in {sh} has 1 negative "
        "value(s) (min -0.002); FP8 scales are magnitudes",
        f"warning: [scale] scale model.layers.0.m2.weight_scale_inv in {sh} has 1 of 2 value(s) "
        "equal to 0: those blocks of model.layers.0.m2.weight dequantize to 0",
        f"error: [scale] scale model.layers.0.m3.weight_scale_inv in {sh} has max 1e+30, so "
        "|model.layers.0.m3.weight| may reach 4.48e+32, beyond 65504 (the float16 range, which no "
        "trained weight exceeds): a corrupt scale",
        "info: [layout] config.json has no num_hidden_layers: layers, MTP layers and experts not "
        "checked against it"]


def test_zero_scale_warning_reaches_the_manifest(tmp_path):
    src = scaled_source(tmp_path, [0.0])
    summary = convert(src, tmp_path / "o", progress=False)
    man = json.loads((tmp_path / "o" / "spark_quant_manifest.json").read_text())
    note = ("warning: scale model.layers.0.m0.weight_scale_inv in model-00001-of-00001.safetensors "
            "has 1 of 2 value(s) equal to 0: those blocks of model.layers.0.m0.weight dequantize to 0")
    assert note in summary.notes and note in man["summary"]["notes"]


def test_output_inside_source_or_a_file_refused(tmp_path, tiny_fp8_llama):
    assert [f.message for f in check_output(tiny_fp8_llama / "nvfp4", tiny_fp8_llama, False)] == [
        f"--out {tiny_fp8_llama / 'nvfp4'} is the source folder or inside it; choose a folder "
        "outside the source"]
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputError, match="--out .*/f exists and is not a folder"):
        convert(tiny_fp8_llama, tmp_path / "f", progress=False)


def test_preflight_command(tmp_path, tiny_fp8_llama, capsys):
    assert main(["preflight", str(tiny_fp8_llama), "--out", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out.startswith(
        "pre-flight: 0 error(s), 0 warning(s); 20 tensors in 3 shards, layout fp8; predicted "
        "build ")
    (tiny_fp8_llama / S2).write_bytes(b"\x00" * 4)
    assert main(["preflight", str(tiny_fp8_llama)]) == 1
    assert capsys.readouterr().out.splitlines()[1] == (
        f"error: [header] shard {S2} is empty or truncated (4 bytes)")
    assert not (tmp_path / "o").exists()
