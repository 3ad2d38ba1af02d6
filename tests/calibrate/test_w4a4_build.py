"""W4A4 and FP8-KV builds from calibration statistics (compressed-tensors layout)."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import build_tiny

from calibrate import calibrate_sequences
from calibrate.data import CalibSet
from formats.calib_stats import CalibStats
from quantize.base.errors import CalibrationError
from quantize.cli import main
from quantize.convert.pipeline import convert
from quantize.inspect.calib_check import check_activation_scales
from quantize.kernels.act_scales import fp8_kv_scale_from_amax
from quantize.kernels.nvfp4 import global_scale_from_amax


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a4")
    src, ref = build_tiny(root, "llama", n_layers=2)
    g = torch.Generator().manual_seed(2)
    stats = calibrate_sequences(src, CalibSet([torch.randint(0, 256, (1, 20), generator=g)
                                               for _ in range(2)], {"dataset": "t"}), progress=False)
    return root, src, ref, stats, stats.save(root / "stats")


def read_all(folder):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out, where = {}, {}
    for name, shard in idx.items():
        with safe_open(str(folder / shard), "pt") as f:
            out[name] = f.get_tensor(name)
        where[name] = shard
    return out, where


def test_w4a4_input_scales_and_fp8_kv(llama, tmp_path):
    root, src, _, stats, stats_dir = llama
    out = tmp_path / "b"
    convert(src, out, scheme="w4a4", kv_cache="fp8", calibration=stats_dir, progress=False, device="cpu")
    t, where = read_all(out)
    p = "model.layers.1"
    qkv = max(stats.input_amax[f"{p}.self_attn.{m}_proj"] for m in "qkv")
    for m in "qkv":  # one input scale per fused group
        assert torch.equal(t[f"{p}.self_attn.{m}_proj.input_global_scale"], global_scale_from_amax(qkv))
    assert t[f"{p}.mlp.gate_proj.input_global_scale"].item() == pytest.approx(
        2688 / stats.input_amax[f"{p}.mlp.gate_proj"], rel=1e-6)
    assert torch.equal(t[f"{p}.mlp.down_proj.input_global_scale"],
                       global_scale_from_amax(stats.input_amax[f"{p}.mlp.down_proj"]))
    kv = stats.kv_amax[f"{p}.self_attn"]
    k_scale = t[f"{p}.self_attn.k_scale"]
    assert k_scale.dtype == torch.float32 and k_scale.shape == (1,)  # the tiny source is fp32
    assert torch.equal(k_scale, fp8_kv_scale_from_amax(kv["k"]))
    assert torch.equal(t[f"{p}.self_attn.v_scale"], fp8_kv_scale_from_amax(kv["v"]))
    # in the shard of the attention block's first source tensor (k_proj.weight)
    assert where[f"{p}.self_attn.k_scale"] == where[f"{p}.self_attn.k_proj.weight_packed"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True,
                                     "group_size": None, "strategy": "tensor", "dynamic": False}
    act = qc["config_groups"]["group_0"]["input_activations"]
    assert act["dynamic"] == "local" and act["strategy"] == "tensor_group" and act["group_size"] == 16
    assert check_activation_scales(out) == []
    # weights are the same bytes as a weight-only build: activation scales add tensors only
    convert(src, tmp_path / "w", progress=False, device="cpu")
    w, _ = read_all(tmp_path / "w")
    for name, v in w.items():
        assert torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           t[name].view(torch.uint8) if t[name].dtype == torch.float8_e4m3fn else t[name]), name


def test_w4a4_needs_calibration_covering_every_module(llama, tmp_path):
    _, src, _, stats, _ = llama
    with pytest.raises(CalibrationError, match="--scheme w4a4 needs --calibration"):
        convert(src, tmp_path / "a", scheme="w4a4", progress=False)
    partial = CalibStats(dict(stats.input_amax), stats.kv_amax, stats.expert_tokens, {}, stats.meta)
    del partial.input_amax["model.layers.0.mlp.down_proj"]
    with pytest.raises(CalibrationError, match="model.layers.0.mlp.down_proj"):
        convert(src, tmp_path / "b", scheme="w4a4", calibration=partial.save(tmp_path / "s"), progress=False)
    with pytest.raises(CalibrationError, match="channel statistics"):
        convert(src, tmp_path / "c", scales="mse-act", calibration=tmp_path / "s", progress=False)
    assert not (tmp_path / "b" / "spark_quant_manifest.json").exists()


def test_check_flags_unequal_fused_input_scales(llama, tmp_path):
    from safetensors.torch import save_file

    _, src, _, _, stats_dir = llama
    out = tmp_path / "b"
    convert(src, out, scheme="w4a4", calibration=stats_dir, progress=False)
    name = "model.layers.0.self_attn.k_proj.input_global_scale"
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out / idx[name]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(out / idx[name]))
    findings = check_activation_scales(out)
    assert len(findings) == 1 and findings[0].startswith("fused group model.layers.0.self_attn.qkv_proj")


def test_cli_calibrate_then_w4a4(llama, tmp_path, capsys):
    _, src, _, _, _ = llama
    assert main(["calibrate", "--src", str(src), "--dataset", "random", "--samples", "2",
                 "--seq-len", "8", "--out", str(tmp_path / "st"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "2 samples, 16 tokens of random" in printed and "no routed experts" in printed
    assert main(["nvfp4", "--src", str(src), "--out", str(tmp_path / "b"), "--scheme", "w4a4",
                 "--calibration", str(tmp_path / "st"), "--kv-cache", "fp8", "--scales", "mse-act",
                 "--quiet"]) == 0
    assert main(["check", str(tmp_path / "b")]) == 0
    man = json.loads((tmp_path / "b" / "spark_quant_manifest.json").read_text())
    assert man["options"]["scales"] == "mse-act" and man["calibration"]["meta"]["dataset"] == "random"


def test_w4a4_build_runs_with_activation_quantization(llama, tmp_path):
    from eval.models import load_build_model
    from eval.w4a4 import attach_activation_quant
    from quantize.kernels.act_scales import fake_quantize_nvfp4_activation

    _, src, _, _, stats_dir = llama
    out = tmp_path / "b"
    convert(src, out, scheme="w4a4", calibration=stats_dir, progress=False)
    model = load_build_model(out)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        w4a16 = model(ids).logits
        handles = attach_activation_quant(model, out)
        assert len(handles) == 14  # 7 Linears x 2 layers
        w4a4 = model(ids).logits
        seen = []
        h = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
        model(ids)
        h.remove()
    assert 0 < (w4a4 - w4a16).abs().max() < w4a16.abs().max()
    # what down_proj received is already on the NVFP4 grid: quantizing it again is exact
    g = read_all(out)[0]["model.layers.0.mlp.down_proj.input_global_scale"]
    assert torch.equal(fake_quantize_nvfp4_activation(seen[0], g), seen[0])


def test_modelopt_w4a4_input_scale_and_kv_scales(llama, tmp_path):
    """ModelOpt W4A4: ``input_scale`` = amax_in / 2688 (0-dim, dequant direction, docs/formats.md
    §B.2.1), one per fused group; quant_algo NVFP4; k/v scales as ``k_proj.k_scale``; weights the
    same bytes as the weight-only ModelOpt build; the build passes ``quantize check``."""
    from quantize.inspect.check import check_build
    from quantize.kernels.nvfp4 import scale_2_from_amax

    _, src, _, stats, stats_dir = llama
    out = tmp_path / "mo"
    convert(src, out, scheme="w4a4", fmt="modelopt", kv_cache="fp8", calibration=stats_dir,
            progress=False, device="cpu")
    t, _ = read_all(out)
    p = "model.layers.1"
    qkv = max(stats.input_amax[f"{p}.self_attn.{m}_proj"] for m in "qkv")
    for m in "qkv":
        s = t[f"{p}.self_attn.{m}_proj.input_scale"]
        assert s.shape == () and torch.equal(s, scale_2_from_amax(qkv))
    assert t[f"{p}.mlp.down_proj.input_scale"].item() == pytest.approx(
        stats.input_amax[f"{p}.mlp.down_proj"] / 2688, rel=1e-6)
    kv = stats.kv_amax[f"{p}.self_attn"]
    assert torch.equal(t[f"{p}.self_attn.k_proj.k_scale"], fp8_kv_scale_from_amax(kv["k"]).reshape(()))
    hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "NVFP4" and hf["kv_cache_quant_algo"] == "FP8"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}  # what vLLM reads
    assert check_build(out) == []  # llama (not MLA): vLLM loads self_attn.k_proj.k_scale
    # one member's input_scale off (as a hand-patched fused group would be): refused, by name
    shard_of = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    bad = f"{p}.mlp.up_proj.input_scale"
    with safe_open(str(out / shard_of[bad]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[bad] = tensors[bad] * 2
    broken = tmp_path / "mo-broken"
    shutil.copytree(out, broken)
    save_file(tensors, str(broken / shard_of[bad]))
    errs = [f for f in check_build(broken) if f.level == "error"]
    assert [(f.kind, f.tensor) for f in errs] == [("fused-group", f"{p}.mlp.gate_up_proj")]
    assert errs[0].message.startswith("input_scale differs across members gate_proj=")
    convert(src, tmp_path / "mo16", fmt="modelopt", progress=False, device="cpu")
    w, _ = read_all(tmp_path / "mo16")
    assert all(torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           t[n].view(torch.uint8) if t[n].dtype == torch.float8_e4m3fn else t[n])
               for n, v in w.items())


def test_scale_search_in_modelopt_order(llama, tmp_path):
    """ModelOpt output takes the block-scale search (its scale_2 order): the weighted search
    changes block scales against RTN, and the compiled kernel writes the reference's bytes."""
    from conftest import assert_same_build

    from quantize.kernels.fused import _has_cxx

    _, src, _, _, stats_dir = llama
    opts = {"fmt": "modelopt", "progress": False, "device": "cpu", "calibration": stats_dir}
    convert(src, tmp_path / "rtn", kernel="reference", **opts)
    convert(src, tmp_path / "ref", kernel="reference", scales="mse-act", **opts)
    rtn, _ = read_all(tmp_path / "rtn")
    got, _ = read_all(tmp_path / "ref")
    scales = [n for n in got if n.endswith(".weight_scale")]
    assert scales and set(got) == set(rtn)
    changed = [n for n in scales if not torch.equal(got[n].view(torch.uint8), rtn[n].view(torch.uint8))]
    assert len(changed) == len(scales)  # every NVFP4 weight has blocks whose scale moved
    if _has_cxx():
        convert(src, tmp_path / "fast", kernel="inductor", scales="mse-act", **opts)
        assert_same_build(tmp_path / "ref", tmp_path / "fast")


def test_check_build_runs_the_calibration_rules(llama, tmp_path):
    """``quantize check`` (check_build) carries the calibration rules: a CT W4A4 build missing
    one module's input_global_scale fails with rule ``calibration``."""
    from safetensors.torch import save_file

    from quantize.inspect.check import check_build

    _, src, _, _, stats_dir = llama
    out = tmp_path / "b"
    convert(src, out, scheme="w4a4", calibration=stats_dir, progress=False)
    victim = "model.layers.0.mlp.up_proj.input_global_scale"
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / idx["weight_map"].pop(victim)
    with safe_open(str(shard), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != victim}
    save_file(kept, str(shard))
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    errors = [f for f in check_build(out) if f.level == "error"]
    assert [(f.kind, f.tensor) for f in errors] == [("calibration", "model.layers.0.mlp.up_proj")]


def test_fast_kernel_and_workers_write_the_reference_calibrated_build(llama, tmp_path):
    """W4A4 input scales and FP8 KV scales through the compiled kernel in two worker
    processes: the single-process reference build's bytes, with the block-scale search (mse)
    in the compiled kernel too."""
    from conftest import assert_same_build

    from quantize.kernels.fused import _has_cxx

    _, src, _, _, stats_dir = llama
    kernel = "inductor" if _has_cxx() else "reference"
    for scales, workers in (("rtn", 2), ("mse", 1)):
        opts = dict(scheme="w4a4", kv_cache="fp8", calibration=stats_dir, scales=scales,
                    progress=False, device="cpu")
        convert(src, tmp_path / f"ref-{scales}", kernel="reference", **opts)
        s = convert(src, tmp_path / f"fast-{scales}", kernel=kernel, workers=workers, **opts)
        assert s.shards_written == 2
        assert_same_build(tmp_path / f"ref-{scales}", tmp_path / f"fast-{scales}")
