"""FC-13: an expert that receives no calibration tokens still gets a finite, positive input
scale (the documented fallback: the layer's max over experts), keeps weight scales from its
own weights, is reported, and shares the layer's quantization format."""

import json

import pytest
import torch
from conftest import load_all
from safetensors import safe_open
from tiny_models import build_tiny

from calibrate import calibrate_sequences
from calibrate.data import CalibSet
from formats.sources import open_source
from quantize.convert.pipeline import convert
from quantize.inspect.calib_check import check_activation_scales
from quantize.kernels.nvfp4 import global_scale_from_amax

E = 4


def starve_expert_3(tensors):
    # sigmoid scores are in (0, 1): a -100 correction bias means expert 3 is never in the top-2
    for layer in (0, 1):
        tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = torch.tensor([0.0, 0.0, 0.0, -100.0])


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("fc13")
    src, _ = build_tiny(root, "deepseek_v3", n_layers=2, edit=starve_expert_3)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (1, 32), generator=g) for _ in range(3)]
    stats = calibrate_sequences(src, CalibSet(seqs, {"dataset": "toy"}), progress=False)
    stats_dir = stats.save(root / "stats")
    return root, src, stats, stats_dir


def test_fc13_unrouted_expert_reported(toy):
    _, _, stats, _ = toy
    for layer in (0, 1):
        counts = stats.expert_tokens[f"model.layers.{layer}.mlp.experts"]
        assert counts[3] == 0 and min(counts[:3]) > 0
        assert f"model.layers.{layer}.mlp.experts.3.gate_proj" not in stats.input_amax
    bad = stats.uncovered_experts(min_tokens=1)
    assert [(u.block, u.expert, u.tokens) for u in bad] == [
        ("model.layers.0.mlp.experts", 3, 0), ("model.layers.1.mlp.experts", 3, 0)]
    report = stats.coverage_report(min_tokens=1)
    assert "6/8 experts" in report and "model.layers.1.mlp.experts.3: 0 tokens" in report


def test_fc13_w4a4_build_scales(toy, tmp_path):
    _, src, stats, stats_dir = toy
    summary = convert(src, tmp_path / "b", scheme="w4a4", calibration=stats_dir, progress=False,
                      device="cpu", min_expert_tokens=1)
    t = load_all(tmp_path / "b")
    for layer in (0, 1):
        blk = f"model.layers.{layer}.mlp.experts"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layer_max = max(stats.input_amax[f"{blk}.{e}.{proj}"] for e in range(3))
            got = t[f"{blk}.3.{proj}.input_global_scale"]
            assert torch.isfinite(got).all() and (got > 0).all()
            assert torch.equal(got, global_scale_from_amax(layer_max))
            for e in range(3):  # calibrated experts keep their own
                assert torch.equal(t[f"{blk}.{e}.{proj}.input_global_scale"],
                                   global_scale_from_amax(stats.input_amax[f"{blk}.{e}.{proj}"]))
        # weight scales of the starved expert come from its weights (gate/up fused)
        s = open_source(src)
        amax = max(s.read(f"{blk}.3.gate_proj.weight").abs().max(), s.read(f"{blk}.3.up_proj.weight").abs().max())
        s.close()
        assert torch.equal(t[f"{blk}.3.gate_proj.weight_global_scale"], global_scale_from_amax(amax))
        # every expert of the layer has the same set of tensors (one format per layer)
        kinds = {tuple(sorted(k.rsplit(".", 1)[1] for k in t if k.startswith(f"{blk}.{e}.")))
                 for e in range(E)}
        assert len(kinds) == 1
    manifest = json.loads((tmp_path / "b" / "spark_quant_manifest.json").read_text())
    listed = manifest["calibration"]["uncalibrated_experts"]
    assert len(listed) == 2 and listed[0].startswith("model.layers.0.mlp.experts.3: 0 tokens")
    assert any("use the layer's max input amax" in n for n in summary.notes)
    assert check_activation_scales(tmp_path / "b") == []


def test_check_refuses_w4a4_build_missing_an_expert_input_scale(toy, tmp_path):
    from safetensors.torch import save_file

    _, src, _, stats_dir = toy
    out = tmp_path / "b"
    convert(src, out, scheme="w4a4", calibration=stats_dir, progress=False, device="cpu")
    victim = "model.layers.1.mlp.experts.3.down_proj.input_global_scale"
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / idx["weight_map"][victim]
    with safe_open(str(shard), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != victim}
    save_file(kept, str(shard))
    del idx["weight_map"][victim]
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    findings = check_activation_scales(out)
    assert findings == ["model.layers.1.mlp.experts.3.down_proj: W4A4 build without "
                        "model.layers.1.mlp.experts.3.down_proj.input_global_scale"]
    from quantize.cli import main
    assert main(["check", str(out)]) == 1
