"""``quantize check``: clean builds pass; each broken property is named with its tensor."""

import json
import os
import shutil

import pytest
import torch
from conftest import BLOCK_FP8_QC, fp8_pair, write_checkpoint
from safetensors.torch import load_file, save_file
from test_recipes import moe_layer

from formats.checkpoint import INDEX_NAME
from quantize.base.errors import CheckFailed
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


# ---- vLLM 0.26 model-level rules (formats.engines VLLM_*) ---------------------------------

def findings(folder, **kw):
    return [(f.level, f.kind, f.tensor, f.message) for f in check_build(folder, **kw)
            if f.kind in ("model", "mtp", "align")]


B = "model.layers.1.mlp.gate.e_score_correction_bias"


@pytest.mark.parametrize("build", ["compressed-tensors", "modelopt"], indirect=True)
def test_vllm_router_bias_needs_noaux_tc(build):
    edit_json(build / "config.json", lambda d: d.pop("topk_method"))
    assert findings(build) == [("error", "model", B, "2 e_score_correction_bias tensor(s) but config.json "
                                "topk_method is None: vLLM creates the bias only with topk_method "
                                "'noaux_tc' (unknown parameter at load)")]
    assert [f for f in findings(build, engine="sglang") if f[1] == "model"] == []  # a vLLM rule


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_vllm_noaux_tc_needs_every_bias_and_scoring_func(build):
    set_tensor(build, B, None)
    edit_json(build / "config.json", lambda d: d.pop("scoring_func"))
    assert findings(build) == [
        ("error", "model", B, "topk_method 'noaux_tc' but 1 router(s) lack e_score_correction_bias: vLLM "
         "would route with an uninitialised bias"),
        ("warning", "model", "config.json", "topk_method 'noaux_tc' without scoring_func: vLLM defaults to "
         "softmax; DeepSeek-V3 and GLM-5 route with 'sigmoid'")]


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_vllm_mla_dims(build):
    """The old tiny fixtures' MLA dims (kv_lora_rank 32, rope 16, nope 32, v 32)."""
    edit_json(build / "config.json", lambda d: d.update(kv_lora_rank=32, qk_rope_head_dim=16,
                                                        qk_nope_head_dim=32, v_head_dim=32))
    assert findings(build) == [
        ("error", "model", "config.json", "kv_lora_rank 32 + qk_rope_head_dim 16 = 48: vLLM's MLA backends "
         "take 576 (kv_lora_rank 512 + qk_rope_head_dim 64)"),
        ("error", "model", "config.json", "(qk_nope_head_dim, qk_rope_head_dim, v_head_dim) = (32, 16, 32): "
         "vLLM's SM90 MLA prefill (FLASH_ATTN) takes (128, 64, 128), (192, 64, 256), (64, 64, 128)")]
    edit_json(build / "config.json", lambda d: d.update(kv_lora_rank=512, qk_rope_head_dim=64,
                                                        qk_nope_head_dim=192, v_head_dim=256))
    assert findings(build) == []  # GLM-5's real dims


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_vllm_dsa_index_dims_and_indexer_parts(build):
    edit_json(build / "config.json", lambda d: d.update(
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_topk=32,
        index_head_dim=32, index_n_heads=4))
    got = findings(build)
    assert got[:2] == [
        ("error", "model", "config.json", "index_head_dim 32: vLLM's DSA indexer needs 128 (quant block 128, "
         "DeepGEMM head_dim)"),
        ("error", "model", "config.json", "index_n_heads 4: DeepGEMM's MQA logits take 16, 32, 64")]
    parts = ", ".join(f"self_attn.indexer.{p}" for p in ("wq_b.weight", "wk.weight", "k_norm.weight",
                                                         "k_norm.bias", "weights_proj.weight"))
    assert got[2:] == [
        ("error", "model", "model.layers.0.self_attn.indexer.wq_b.weight",
         f"layer 0: vLLM builds a DSA indexer here but the build lacks {parts}"),
        ("error", "model", "model.layers.1.self_attn.indexer.wq_b.weight",
         f"layer 1: vLLM builds a DSA indexer here but the build lacks {parts}"),
        ("error", "mtp", "model.layers.2.self_attn.indexer.wq_b.weight",
         f"layer 2: vLLM builds a DSA indexer here but the build lacks {parts}")]


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_vllm_layer_types_moe_placement_and_extra_layers(build):
    edit_json(build / "config.json", lambda d: d.update(
        layer_types=["indexed_attention", "deepseek_sparse_attention"], first_k_dense_replace=0))
    set_tensor(build, "model.layers.5.input_layernorm.weight", torch.ones(64, dtype=torch.bfloat16))
    assert findings(build) == [
        ("error", "model", "config.json", "layer_types has ['indexed_attention']: transformers 5.17 (vLLM "
         "0.26) rejects it; 'deepseek_sparse_attention' is read by transformers 5.17 and 5.24"),
        ("error", "model", "config.json", "vLLM places MoE by first_k_dense_replace 0 / moe_layer_freq 1 on "
         "layers [0, 1]; the build has routed experts on layers [1]"),
        ("error", "model", "model.layers.5", "layer(s) 5 beyond num_hidden_layers 2 + "
         "num_nextn_predict_layers 1: vLLM has no parameters for them (KeyError at load)")]


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_vllm_mtp_moe_block_parts(build):
    set_tensor(build, "model.layers.2.mlp.gate.weight", None)
    assert findings(build) == [("error", "mtp", "model.layers.2.mlp.gate.weight",
                                "MTP layer 2: vLLM builds an MoE block here but the build lacks mlp.gate.weight")]


def test_vllm_nvfp4_expert_hidden_multiple_of_64(tmp_path):
    """hidden 48: K of gate / up is a multiple of 16 (NVFP4 loads) but not of 64 (Marlin MoE)."""
    g = torch.Generator().manual_seed(0)
    t = {}
    for e in range(8):
        for m, shape in (("gate_proj", (32, 48)), ("up_proj", (32, 48)), ("down_proj", (48, 32))):
            t.update(fp8_pair(f"model.layers.0.mlp.experts.{e}.{m}", torch.randn(*shape, generator=g) * 0.05))
    t["model.layers.0.mlp.gate.weight"] = torch.randn(8, 48, generator=g).bfloat16()
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 1, "n_routed_experts": 8,
           "quantization_config": BLOCK_FP8_QC}
    src = write_checkpoint(tmp_path / "src", t, cfg, n_shards=1)
    with pytest.raises(CheckFailed, match=r"K=48: vLLM's Marlin NVFP4 MoE needs hidden_size % 64"):
        convert(src, tmp_path / "b", fmt="compressed-tensors", progress=False)  # the final check
    assert findings(tmp_path / "b") == [
        ("error", "align", "model.layers.0.mlp.experts.0.gate_proj", "K=48: vLLM's Marlin NVFP4 MoE needs "
         "hidden_size % 64 (prepare_nvfp4_moe_layer_for_marlin)")]


MLA_FP8_RECIPE = """name = "experts-nvfp4-mla-fp8"
description = "routed experts NVFP4, MLA projections 128x128 block FP8"
[[rule]]
match = "role:routed_expert"
target = "nvfp4"
[[rule]]
match = "role:mla"
target = "fp8-block"
[[rule]]
match = "re:.*"
target = "keep"
"""


def test_vllm_refuses_modelopt_mixed_block_fp8(tmp_path, capsys):
    """Measured in vLLM 0.26.0 on the H200: a ModelOpt MIXED_PRECISION build with FP8_PB_WO MLA
    projections fails to load (KeyError ...o_proj.weight_scale); the compressed-tensors build of
    the same recipe loads. Pre-flight refuses the first plan before any byte is written (the
    rule the final check applies, formats.engines.FORMAT_SUPPORT), and the second converts
    and passes the final check."""
    from quantize.data.fixtures import write_release_fixture

    src = write_release_fixture(tmp_path / "src", "deepseek_v3")
    (tmp_path / "r.toml").write_text(MLA_FP8_RECIPE)
    args = ["--src", str(src), "--recipe", str(tmp_path / "r.toml"), "--no-showcase", "--quiet"]
    capsys.readouterr()
    assert main(["nvfp4", "--out", str(tmp_path / "mo"), "--format", "modelopt", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 1 problem(s) in src:\nerror: [config] vllm and modelopt "
                          "MIXED_PRECISION:FP8_PB_WO: vLLM 0.26.0 cannot load FP8_PB_WO (128x128 block "
                          "FP8) modules of a MIXED_PRECISION build")
    assert "--format compressed-tensors" in err
    assert not (tmp_path / "mo").exists()
    assert main(["nvfp4", "--out", str(tmp_path / "ct"), "--format", "compressed-tensors", *args]) == 0
    assert [f for f in check_build(tmp_path / "ct") if f.level == "error"] == []
    assert main(["nvfp4", "--out", str(tmp_path / "mo-sg"), "--format", "modelopt", "--engine",
                 "trtllm", *args]) == 0  # another engine's rows decide for it


# ---- FP8 KV scales vLLM 0.26 does not load (formats.engines VLLM_MLA_KV_SCALES_LOADED) -----

def kv_findings(folder, **kw):
    return [(f.level, f.kind, f.tensor, f.message) for f in check_build(folder, **kw)
            if f.kind in ("scale", "config")]


SCALE_1 = "vLLM will run the fp8 KV cache with scale 1.0, not the calibrated scales"


def mla_kv_warning(name):
    return ("warning", "scale", name, (f"2 k_scale / v_scale tensor(s) on MLA attention (e.g. {name}): "
            "vLLM 0.26 loads no KV scale of MLA attention under any name (it looks for "
            "layers.L.self_attn.attn.attn.k_scale, the parameter is self_attn.mla_attn.mla_attn.k_scale): "
            + SCALE_1))


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_vllm_ignores_ct_kv_scales_on_mla(build):
    """compressed-tensors ``self_attn.k_scale`` on DeepSeek MLA: a warning (scale 1.0 is vLLM's
    default), vLLM only: SGLang gets no such finding."""
    p = "model.layers.1.self_attn"
    set_tensor(build, f"{p}.k_scale", torch.tensor([0.02]))
    set_tensor(build, f"{p}.v_scale", torch.tensor([0.02]))
    edit_json(build / "config.json", lambda d: d["quantization_config"].update(kv_cache_scheme={
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}))
    assert kv_findings(build) == [mla_kv_warning(f"{p}.k_scale")]
    assert [f for f in kv_findings(build, engine="sglang") if f[1] == "scale"] == []
    assert main(["check", str(build)]) == 0  # a warning, not a failure


@pytest.mark.parametrize("build", ["modelopt"], indirect=True)
def test_vllm_ignores_modelopt_kv_scales_on_mla_and_hf_only_kv_setting(build):
    """ModelOpt names ``self_attn.k_proj.k_scale`` on MLA: vLLM 0.26 loads them under no name;
    FP8 KV declared only in hf_quant_config.json: config.json is what vLLM reads."""
    p = "model.layers.1.self_attn"
    set_tensor(build, f"{p}.k_proj.k_scale", torch.tensor(0.02))
    set_tensor(build, f"{p}.v_proj.v_scale", torch.tensor(0.02))
    edit_json(build / "hf_quant_config.json", lambda d: d["quantization"].update(kv_cache_quant_algo="FP8"))
    edit_json(build / "config.json", lambda d: d["quantization_config"].update(
        kv_cache_scheme={"dynamic": False, "num_bits": 8, "type": "float"}))
    assert kv_findings(build) == [mla_kv_warning(f"{p}.k_proj.k_scale")]
    edit_json(build / "config.json", lambda d: d["quantization_config"].pop("kv_cache_scheme"))
    hf_only = ("warning", "config", "config.json", ("kv_cache_quant_algo FP8 only in hf_quant_config.json; "
               "config.json quantization_config.kv_cache_scheme is null, not "
               '{"dynamic": false, "num_bits": 8, "type": "float"}: vLLM 0.26 reads the KV-cache setting '
               "from config.json, so --kv-cache-dtype auto keeps a bf16 KV cache"))
    assert kv_findings(build) == [hf_only, mla_kv_warning(f"{p}.k_proj.k_scale")]
    for f in ("config.json", "hf_quant_config.json"):  # MIXED_PRECISION: no KV method at all
        edit_json(build / f, lambda d: (d.get("quantization") or d["quantization_config"]).update(
            quant_algo="MIXED_PRECISION"))
    got = [f for f in kv_findings(build) if f[0] == "warning"]
    assert got == [(*hf_only[:3], hf_only[3] + f", and with --kv-cache-dtype fp8 {SCALE_1} "
                    "(MIXED_PRECISION attaches no KV method)"), mla_kv_warning(f"{p}.k_proj.k_scale")]


@pytest.mark.parametrize("build", ["compressed-tensors"], indirect=True)
def test_ct_group_weight_args_must_be_the_writers(build):
    """An nvfp4-pack-quantized group that says 8 bits / group size 32 passed before; engines
    would misread the packed tensors."""
    def edit(d):
        d["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8, group_size=32)

    edit_json(build / "config.json", edit)
    found = [(f.level, f.kind, f.message) for f in check_build(build) if f.kind == "config"]
    assert found == [("error", "config", "config_groups.group_0.weights: num_bits 8 (the nvfp4 layout "
                      "has 4); group_size 32 (the nvfp4 layout has 16)")]


# ---- the scale rule from the converter's counts (issue 18) --------------------------------

class ShardReads:
    """Every read of shard bytes through ``formats.shards`` (the only code that opens weight
    files): ``(file, offset, bytes)`` of header reads (file objects) and of tensor reads
    (``os.preadv`` of ``ShardReader``)."""

    def __init__(self, monkeypatch):
        from formats import shards

        self.header: list[tuple[str, int, int]] = []
        self.data: list[tuple[str, int, int]] = []
        real_open, real_preadv = open, os.preadv
        reads = self

        class Counted:
            def __init__(self, f):
                self.f = f

            def read(self, n=-1):
                at = self.f.tell()
                b = self.f.read(n)
                reads.header.append((os.path.basename(self.f.name), at, len(b)))
                return b

            def __getattr__(self, k):
                return getattr(self.f, k)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        def preadv(fd, bufs, offset):
            n = real_preadv(fd, bufs, offset)
            reads.data.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, n))
            return n

        monkeypatch.setattr(shards, "open", lambda p, mode="r", *a, **k: Counted(real_open(p, mode, *a, **k)),
                            raising=False)
        monkeypatch.setattr(os, "preadv", preadv)

    @property
    def bytes(self) -> int:
        return sum(n for *_, n in self.header) + sum(n for *_, n in self.data)


def _infos(folder):
    from formats.shards import read_header

    return {n: i for p in sorted(folder.glob("*.safetensors")) for n, i in read_header(p).items()}


def _header_ends(folder):
    import struct

    return {p.name: 8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in folder.glob("*.safetensors")}


def _tensor_at(infos, shard, offset, n):
    """The tensors of ``shard`` whose bytes a read of ``n`` bytes at ``offset`` touches."""
    return {name for name, i in infos.items()
            if i.shard == shard and i.offset < offset + n and offset < i.offset + i.nbytes}


def test_fresh_glm5_next_check_reads_headers_and_scalars_only(glm5_next_src, tmp_path, monkeypatch):
    """GLM-5.3-Flash fixture, spark-mixed: on the fresh build ``quantize check`` reads shard
    headers and one-element global scales, never a block scale; ``full`` reads every one."""
    from quantize.inspect.check import ScaleReads

    build = tmp_path / "b"
    convert(glm5_next_src, build, recipe="spark-mixed", progress=False, device="cpu")
    infos, ends = _infos(build), _header_ends(build)
    block_scales = {n for n, i in infos.items() if n.endswith(".weight_scale") and i.dtype == "F8_E4M3"}
    assert len(block_scales) > 100
    counted = ShardReads(monkeypatch)
    reads = ScaleReads()
    assert check_build(build, reads=reads) == []
    assert (reads.recorded, reads.read, reads.problem) == (sorted(ends), [], None)
    assert all(at + n <= ends[f] for f, at, n in counted.header)  # headers only
    touched = set().union(*(_tensor_at(infos, f, at, n) for f, at, n in counted.data))
    assert touched and all(infos[t].shape == (1,) and t.endswith(".weight_global_scale") for t in touched)
    assert sum(n for *_, n in counted.data) == 4 * len(counted.data)  # one F32 each
    monkeypatch.undo()
    full = ShardReads(monkeypatch)
    full_reads = ScaleReads()
    assert check_build(build, full=True, reads=full_reads) == []
    assert (full_reads.recorded, full_reads.read, full_reads.problem) == ([], sorted(ends), None)
    assert block_scales <= set().union(*(_tensor_at(infos, f, at, n) for f, at, n in full.data))


def test_fresh_build_check_reads_under_one_percent(tmp_path, monkeypatch):
    """GLM-5.3-Flash-shaped routed experts (gate/up [1024, 2048], down [2048, 1024]): the
    check of the fresh build reads <= 1 % of the shard bytes (headers and the 4 gate/up
    global scales); with ``full`` it reads every block scale (1/9 of an NVFP4 build)."""
    from quantize.data.fixtures import write_synthetic_fp8

    src = write_synthetic_fp8(tmp_path / "src", n_shards=1, experts_per_shard=2, fast=True)
    build = tmp_path / "b"
    convert(src, build, progress=False, device="cpu", kernel="reference")
    total = sum(p.stat().st_size for p in build.glob("*.safetensors"))
    scales = sum(i.nbytes for n, i in _infos(build).items() if n.endswith(".weight_scale"))
    counted = ShardReads(monkeypatch)
    check_build(build)
    assert sum(n for *_, n in counted.data) == 4 * 4  # gate/up weight_global_scale of 2 experts
    assert counted.bytes <= total / 100
    monkeypatch.undo()
    full = ShardReads(monkeypatch)
    check_build(build, full=True)
    assert full.bytes > scales > total / 10


def _plant_nan(build, name):
    """Overwrite the first byte of block-scale tensor ``name`` in its shard, in place, with
    the e4m3 NaN code 0x7F (the file keeps its size and inode)."""
    shard = json.loads((build / INDEX_NAME).read_text())["weight_map"][name]
    info = _infos(build)[name]
    with open(build / shard, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x7f")
    return shard


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_nan_planted_after_the_build_is_caught(tmp_path, fmt, capsys):
    """A block-scale byte overwritten with NaN after the build: the shard no longer matches
    the converter's record, so check reads its scales and fails naming the tensor (also when
    the file's mtime is set back: its ctime moved)."""
    from formats.manifest import CHECK_STATS_NAME
    from quantize.inspect.check import ScaleReads

    src, _ = moe_layer(tmp_path, n_layers=2)
    build = tmp_path / "b"
    convert(src, build, fmt=fmt, progress=False)
    name = f"{E}.up_proj.weight_scale"
    st = os.stat(build / json.loads((build / INDEX_NAME).read_text())["weight_map"][name])
    shard = _plant_nan(build, name)
    os.utime(build / shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime as it was
    reads = ScaleReads()
    assert errors(build, reads=reads) == [("scale", name)]
    assert reads.read == [shard] and shard not in reads.recorded
    assert reads.problem == (f"1 shard(s) changed or copied since the build ({shard}: size, mtime, "
                             f"ctime or inode differ from {CHECK_STATS_NAME})")
    capsys.readouterr()
    assert main(["check", str(build)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"ERROR [scale] {name}: 1 NaN e4m3 byte(s) (0x7F/0xFF) (FC-11)",
        f"note: scales of 1 shard(s) read from the files: {reads.problem}",
        f"{build}: 1 error(s), 0 warning(s) for vllm TP=1 (engine and TP as spark_quant_manifest.json "
        "records; --engine / --tp check another)"]


def test_converter_garbage_scale_fails_the_build_from_its_counts(tmp_path, monkeypatch):
    """The in-build check takes the scale rule's counts from the converter, which counts the
    tensors it writes: a NaN block-scale byte out of the kernel still fails the build."""
    import formats.compressed_tensors as ct

    real = ct.emit_nvfp4

    def poisoned(module, packed, block_scale, *a, **k):
        if module == E + ".down_proj":
            block_scale = block_scale.clone()
            block_scale.view(torch.uint8)[0, 1] = 0xFF
        return real(module, packed, block_scale, *a, **k)

    monkeypatch.setattr(ct, "emit_nvfp4", poisoned)
    src, _ = moe_layer(tmp_path, n_layers=2)
    with pytest.raises(CheckFailed, match=rf"ERROR \[scale\] {E}.down_proj.weight_scale: 1 NaN e4m3 byte"):
        convert(src, tmp_path / "b", progress=False)
    stats = json.loads((tmp_path / "b" / ".spark-quant-stats.json").read_text())
    assert [r["faults"] for r in stats["shards"].values() if r["faults"]] == [{f"{E}.down_proj.weight_scale": 1}]


def test_stats_file_layout_and_verify(clean):
    """The file the converter writes (formats.manifest CHECK_STATS_NAME): one record per
    shard, its identity, sha256 (the manifest's), the scale tensors it counted; local to the
    folder: the manifest does not list it and verify does not flag it."""
    from formats.manifest import CHECK_STATS_NAME, MANIFEST_NAME, file_identity
    from quantize.inspect.check import SCALE_NAMES
    from quantize.inspect.verify import verify

    build = clean["compressed-tensors"]
    stats = json.loads((build / CHECK_STATS_NAME).read_text())
    manifest = json.loads((build / MANIFEST_NAME).read_text())
    shards = sorted(set(json.loads((build / INDEX_NAME).read_text())["weight_map"].values()))
    assert stats["version"] == 1 and sorted(stats["shards"]) == shards
    infos = _infos(build)
    for s, rec in stats["shards"].items():
        assert rec == {"file": file_identity(build / s), "sha256": manifest["files"][s]["sha256"],
                       "scales": sum(i.shard == s and n.rsplit(".", 1)[1] in SCALE_NAMES for n, i in infos.items()),
                       "faults": {}}
    assert CHECK_STATS_NAME not in manifest["files"]
    rep = verify(build)
    assert rep.ok, rep.render()


def test_scale_faults_counts_what_the_scale_rule_flags():
    from quantize.inspect.check import scale_faults

    b = torch.tensor([[0x01, 0x7E, 0x7F], [0xFF, 0x80, 0x38]], dtype=torch.uint8)
    assert scale_faults(b.view(torch.float8_e4m3fn)) == 2  # 0x7F, 0xFF; -0 (0x80) is not NaN
    assert scale_faults(torch.tensor([[1, 2], [3, 0x7E]], dtype=torch.uint8).view(torch.float8_e4m3fn)) == 0
    f = torch.tensor([float("nan"), float("inf"), -1.0, 0.0, 1e-3, 448.0])
    assert scale_faults(f) == 4 and scale_faults(f.bfloat16()) == 4
    assert scale_faults(torch.tensor([0, 255], dtype=torch.uint8)) == 0  # e8m0: not judged here
