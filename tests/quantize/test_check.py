"""``quantize check``: clean builds pass; each broken property is named with its tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_recipes import moe_layer

from formats.checkpoint import INDEX_NAME
from quantize.cli import main
from quantize.convert.pipeline import convert
from quantize.inspect.check import check_build


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    src, _ = moe_layer(root, n_layers=2)
    out = {}
    for fmt in ("compressed-tensors", "modelopt"):
        out[fmt] = root / fmt
        convert(src, out[fmt], fmt=fmt, progress=False)
    return out


@pytest.fixture
def build(clean, tmp_path, request):
    folder = tmp_path / "b"
    shutil.copytree(clean[request.param], folder)
    return folder


def set_tensor(folder, name, value=None):
    """Replace (or with value None, delete) one tensor in its shard, keeping the index true."""
    idx = json.loads((folder / INDEX_NAME).read_text())
    shard = idx["weight_map"].setdefault(name, sorted(set(idx["weight_map"].values()))[0])
    tensors = load_file(str(folder / shard))
    if value is None:
        del tensors[name], idx["weight_map"][name]
    else:
        tensors[name] = value
    (folder / INDEX_NAME).write_text(json.dumps(idx))
    save_file(tensors, str(folder / shard))


def edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def errors(folder, **kw):
    return [(f.kind, f.tensor) for f in check_build(folder, **kw) if f.level == "error"]


E = "model.layers.1.mlp.experts.3"


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_clean_builds_pass(clean, fmt):
    assert check_build(clean[fmt]) == []


@pytest.mark.parametrize("build", ["compressed-tensors", "modelopt"], indirect=True)
def test_nan_block_scale_byte_named(build):
    name = f"{E}.up_proj.weight_scale"
    s = load_file(str(build / json.loads((build / INDEX_NAME).read_text())["weight_map"][name]))[name]
    s.view(torch.uint8)[0, 0] = 0x7F
    set_tensor(build, name, s)
    assert errors(build) == [("scale", name)]


@pytest.mark.parametrize("build", ["compressed-tensors", "modelopt"], indirect=True)
def test_fused_group_scalar_mismatch_named(build):
    """FC-06 in the check: gate and up of one expert with different global scales."""
    key = "weight_scale_2" if (build / "hf_quant_config.json").exists() else "weight_global_scale"
    name = f"{E}.up_proj.{key}"
    old = load_file(str(build / json.loads((build / INDEX_NAME).read_text())["weight_map"][name]))[name]
    set_tensor(build, name, old * 2)
    assert errors(build) == [("fused-group", f"{E}.gate_up_proj")]


@pytest.mark.parametrize("build", ["modelopt"], indirect=True)
def test_modelopt_required_keys_and_engine_support(build):
    edit_json(build / "hf_quant_config.json", lambda d: d["quantization"].pop("group_size"))
    msgs = lambda engine: [f.message for f in check_build(build, engine=engine) if f.level == "error"]  # noqa: E731
    assert "vllm requires quantization.group_size" in msgs("vllm")
    assert not any("requires" in m for m in msgs("trtllm"))  # TRT-LLM reads group_size optionally
    assert "group_size None, NVFP4 needs 16" in msgs("trtllm")
    msgs = [f.message for f in check_build(build, engine="sglang") if f.level == "error"]
    assert any("W4A16_NVFP4" in m and "accepts only FP8 / NVFP4" in m for m in msgs)


@pytest.mark.parametrize("build", ["modelopt"], indirect=True)
def test_substring_exclude_hits_a_quantized_expert(build):
    """vLLM also matches exclude entries as substrings: 'experts.3' would skip experts.3.*."""
    edit_json(build / "hf_quant_config.json", lambda d: d["quantization"]["exclude_modules"].append(E))
    edit_json(build / "config.json", lambda d: d["quantization_config"]["ignore"].append(E))
    assert sorted(errors(build)) == [("ignore", f"{E}.{m}") for m in ("down_proj", "gate_proj", "up_proj")]


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_leftover_scale_inv_and_stale_source_config(build):
    set_tensor(build, f"{E}.down_proj.weight_scale_inv", torch.ones(1, 1))
    edit_json(build / "config.json", lambda d: d.setdefault("text_config", {}).update(
        quantization_config={"quant_method": "fp8"}))
    assert sorted(errors(build)) == [("config", "config.json"), ("layout", f"{E}.down_proj.weight_scale_inv")]


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_mtp_piece_missing(build):
    set_tensor(build, "model.layers.2.hnorm.weight", None)
    assert errors(build) == [("mtp", "model.layers.2")]


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_source_config_left_in_place(build):
    edit_json(build / "config.json", lambda d: d.update(quantization_config={"quant_method": "fp8"}))
    assert errors(build) == [("config", "config.json")]


def test_trtllm_refuses_ct_weight_only(clean):
    assert errors(clean["compressed-tensors"], engine="trtllm") == [("config", "config.json")]


@pytest.mark.parametrize("build", ["modelopt"], indirect=True)
def test_cli_exit_codes(build, capsys):
    assert main(["check", str(build)]) == 0
    edit_json(build / "config.json", lambda d: d["quantization_config"].pop("ignore"))
    assert main(["check", str(build), "--engine", "vllm", "--tp", "2"]) == 1
    out = capsys.readouterr().out
    assert "ERROR [config] config.json: config.json quantization_config has no 'ignore'" in out
    assert "1 error(s), 0 warning(s) for vllm TP=2" in out
