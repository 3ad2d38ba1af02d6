"""End-to-end conversion on small checkpoints: layout, decisions, field cases, resume."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import (
    BLOCK_FP8_QC,
    assert_same_build,
    fp8_pair,
    killed_at_write,
    load_all,
    write_checkpoint,
)

from formats.checkpoint import INDEX_NAME
from formats.manifest import MANIFEST_NAME, PROGRESS_NAME
from formats.shards import read_header
from quantize.base.errors import OutputError, SourceError
from quantize.convert.pipeline import convert
from quantize.kernels.nvfp4 import dequantize_nvfp4


def deq(t: dict, module: str) -> torch.Tensor:
    return dequantize_nvfp4(t[f"{module}.weight_packed"], t[f"{module}.weight_scale"],
                            t[f"{module}.weight_global_scale"])


def assert_within_fp4_error(deq: torch.Tensor, ref: torch.Tensor) -> None:
    """Each element within half an e2m1 step of its block: |err| <= block_amax / 6 (the 4..6
    gap), plus the e4m3 rounding of the block scale (<= 1/16 relative)."""
    n, k = ref.shape
    block_amax = ref.view(n, k // 16, 16).abs().amax(-1, keepdim=True)
    err = (deq - ref).abs().view(n, k // 16, 16)
    assert (err <= block_amax / 6 * (1 + 1 / 16) + 1e-12).all()
    assert (deq - ref).norm() / ref.norm() < 0.15


def moe_checkpoint(tmp_path: Path) -> Path:
    """DeepSeek-style names: 1 dense layer, 1 MoE layer (8 experts), MTP layer 2, FP8 blocks."""
    g = torch.Generator().manual_seed(1)
    h, e = 64, 8
    t = {"model.embed_tokens.weight": torch.randn(128, h, generator=g).bfloat16(),
         "lm_head.weight": torch.randn(128, h, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(h).bfloat16()}

    def lin(name, n, k, scale=0.05):
        t.update(fp8_pair(name, torch.randn(n, k, generator=g) * scale))

    for layer in (0, 1, 2):
        p = f"model.layers.{layer}"
        lin(f"{p}.self_attn.q_a_proj", 32, h)
        lin(f"{p}.self_attn.kv_a_proj_with_mqa", 48, h, scale=0.4)
        lin(f"{p}.self_attn.kv_b_proj", 64, 32)
        lin(f"{p}.self_attn.o_proj", h, 64)
        if layer == 0:
            lin(f"{p}.mlp.gate_proj", 96, h)
            lin(f"{p}.mlp.up_proj", 96, h, scale=0.3)
            lin(f"{p}.mlp.down_proj", h, 96)
            continue
        t[f"{p}.mlp.gate.weight"] = torch.randn(e, h, generator=g).bfloat16()
        t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.tensor(
            [0.1234567, 1e-8, -3.3, 7.0, 0.0, 2.5, 1 / 3, -0.1], dtype=torch.float32)
        for x in range(e):
            lin(f"{p}.mlp.experts.{x}.gate_proj", 32, h)
            lin(f"{p}.mlp.experts.{x}.up_proj", 32, h, scale=0.5 if x == 3 else 0.05)
            lin(f"{p}.mlp.experts.{x}.down_proj", h, 32)
        lin(f"{p}.mlp.shared_experts.gate_proj", 32, h)
        lin(f"{p}.mlp.shared_experts.up_proj", 32, h)
        lin(f"{p}.mlp.shared_experts.down_proj", h, 32)
    t["model.layers.2.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g).bfloat16()
    t["model.layers.2.enorm.weight"] = torch.ones(h).bfloat16()
    t["model.layers.2.hnorm.weight"] = torch.ones(h).bfloat16()
    t["model.layers.2.shared_head.head.weight"] = torch.randn(128, h, generator=g).bfloat16()
    t["model.layers.2.shared_head.norm.weight"] = torch.ones(h).bfloat16()
    lin("model.layers.1.self_attn.narrow_proj", 16, 40)  # K=40: not a multiple of 16
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_nextn_predict_layers": 1,
              "n_routed_experts": e, "tie_word_embeddings": False, "topk_method": "noaux_tc",
              "quantization_config": BLOCK_FP8_QC}
    return write_checkpoint(tmp_path / "moe", t, config, n_shards=4)


@pytest.fixture
def moe_build(tmp_path):
    src = moe_checkpoint(tmp_path)
    summary = convert(src, tmp_path / "out", progress=False)
    return src, tmp_path / "out", summary


def test_fc21b_index_matches_shards_and_total_size(moe_build):
    _, out, _ = moe_build
    idx = json.loads((out / INDEX_NAME).read_text())
    union, total = {}, 0
    for shard in set(idx["weight_map"].values()):
        for name, info in read_header(out / shard).items():
            union[name] = shard
            total += info.nbytes
    assert union == idx["weight_map"]
    assert idx["metadata"]["total_size"] == total
    assert not any(n.endswith("_scale_inv") for n in union)  # FC-03: no sidecars leak


def test_fc18_every_key_accounted_for_mtp_complete(moe_build):
    src, out, _ = moe_build
    src_keys = set(json.loads((src / INDEX_NAME).read_text())["weight_map"])
    expected = set()
    for k in src_keys:
        if k.endswith(".weight_scale_inv"):
            continue
        expected.add(k)
    out_keys = set(json.loads((out / INDEX_NAME).read_text())["weight_map"])
    renamed = {k[: -len("_packed")] for k in out_keys if k.endswith(".weight_packed")}
    plain = {k for k in out_keys if not k.endswith(("_packed", "_scale", "_global_scale"))}
    assert renamed | plain == expected
    mtp = {k for k in out_keys if k.startswith("model.layers.2.")}
    assert "model.layers.2.mlp.experts.7.down_proj.weight_packed" in mtp
    assert "model.layers.2.eh_proj.weight" in mtp  # eh_proj stays bf16
    assert "model.layers.2.shared_head.head.weight" in mtp


def test_fc16_fc20_routers_and_bias_bit_identical(moe_build):
    src, out, _ = moe_build
    t, s = load_all(out), load_all(src)
    for layer in (1, 2):
        r = f"model.layers.{layer}.mlp.gate"
        assert torch.equal(t[f"{r}.weight"].view(torch.int16), s[f"{r}.weight"].view(torch.int16))
        b = t[f"{r}.e_score_correction_bias"]
        assert b.dtype == torch.float32
        assert torch.equal(b.view(torch.int32), s[f"{r}.e_score_correction_bias"].view(torch.int32))
        assert b[0].item() == torch.tensor(0.1234567, dtype=torch.float32).item()
        assert f"model.layers.{layer}.mlp.experts.0.gate_proj.weight_packed" in t
        assert f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight_packed" in t
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.1.mlp.gate" in ignore and "model.layers.2.eh_proj" in ignore


@pytest.mark.parametrize("fmt,packed", [("compressed-tensors", ".weight_packed"), ("modelopt", ".weight")])
def test_fc16_router_found_structurally_not_by_substring(tmp_path, fmt, packed):
    h = 64
    t = {"model.layers.1.mlp.gate.weight": torch.randn(8, h).bfloat16(),
         "model.layers.1.block_sparse_moe.gate.weight": torch.randn(8, h).bfloat16(),
         "model.layers.1.mlp.experts.0.gate_proj.weight": torch.randn(32, h).bfloat16(),
         "model.layers.1.mlp.experts.0.up_proj.weight": torch.randn(32, h).bfloat16(),
         "model.layers.1.mlp.shared_experts.gate_proj.weight": torch.randn(32, h).bfloat16(),
         "model.layers.1.mlp.shared_experts.up_proj.weight": torch.randn(32, h).bfloat16()}
    src = write_checkpoint(tmp_path / "s", t, {"n_routed_experts": 8})
    convert(src, tmp_path / "o", fmt=fmt, progress=False)
    o = load_all(tmp_path / "o")
    for r in ("model.layers.1.mlp.gate", "model.layers.1.block_sparse_moe.gate"):
        assert torch.equal(o[f"{r}.weight"].view(torch.int16), t[f"{r}.weight"].view(torch.int16))
    assert o["model.layers.1.mlp.experts.0.gate_proj" + packed].dtype == torch.uint8
    assert o["model.layers.1.mlp.shared_experts.gate_proj" + packed].dtype == torch.uint8


def test_fc20_softmax_router_gets_no_invented_bias(tmp_path):
    t = {"model.layers.1.mlp.gate.weight": torch.randn(8, 64).bfloat16()}
    src = write_checkpoint(tmp_path / "s", t, {"num_experts": 8, "scoring_func": "softmax"})
    convert(src, tmp_path / "o", progress=False)
    assert set(load_all(tmp_path / "o")) == {"model.layers.1.mlp.gate.weight"}


def test_fused_groups_share_one_global_scale(moe_build):
    src, out, _ = moe_build
    t, s = load_all(out), load_all(src)
    groups = [("model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"),
              ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
              ("model.layers.1.mlp.experts.3.gate_proj", "model.layers.1.mlp.experts.3.up_proj"),
              ("model.layers.1.mlp.shared_experts.gate_proj", "model.layers.1.mlp.shared_experts.up_proj")]
    from formats.sources import open_source
    source = open_source(src)
    for a, b in groups:
        ga, gb = t[f"{a}.weight_global_scale"], t[f"{b}.weight_global_scale"]
        assert torch.equal(ga, gb), (a, b)
        amax = max(source.read(f"{a}.weight").abs().max(), source.read(f"{b}.weight").abs().max())
        assert ga.item() == pytest.approx(2688.0 / amax.item(), rel=1e-6)
        for m in (a, b):  # block scales re-derived against the shared value
            ref = source.read(f"{m}.weight")
            assert_within_fp4_error(deq(t, m), ref)
    # o_proj is alone: its own amax
    o = source.read("model.layers.0.self_attn.o_proj.weight")
    assert t["model.layers.0.self_attn.o_proj.weight_global_scale"].item() == pytest.approx(
        2688.0 / o.abs().max().item(), rel=1e-6)


def test_k_not_multiple_of_16_kept_bf16_and_reported(moe_build):
    src, out, summary = moe_build
    t = load_all(out)
    assert t["model.layers.1.self_attn.narrow_proj.weight"].dtype == torch.bfloat16
    assert any("narrow_proj.weight kept as bf16: K=40" in n for n in summary.notes)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.self_attn.narrow_proj" in qc["ignore"]
    assert "lm_head" in qc["ignore"] and "model.embed_tokens" in qc["ignore"]
    # FC-15 invariant: ignored modules have no packed weight; unquantized Linear weights are ignored
    packed = {k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed")}
    assert not packed & set(qc["ignore"])
    plain_2d = {k[: -len(".weight")] for k, v in t.items() if k.endswith(".weight") and v.ndim == 2}
    assert plain_2d <= set(qc["ignore"])


def test_fc23_tied_embeddings_write_no_lm_head(tmp_path, tiny_fp8_llama):
    out = tmp_path / "o"
    convert(tiny_fp8_llama, out, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    assert not any(k.startswith("lm_head") for k in load_all(out))
    assert "lm_head" in cfg["quantization_config"]["ignore"]
    assert (out / "tokenizer_config.json").exists()  # non-weight files carried


def test_config_and_manifest(tmp_path, tiny_fp8_llama):
    out = tmp_path / "o"
    convert(tiny_fp8_llama, out, progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert qc["quantization_status"] == "compressed"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["group_size"], w["strategy"], w["scale_dtype"]) == (
        4, "float", 16, "tensor_group", "torch.float8_e4m3fn")
    man = json.loads((out / MANIFEST_NAME).read_text())
    assert man["options"]["recipe"] == "weight-only" and man["source"]["layout"] == "fp8"
    for name, entry in man["files"].items():
        assert entry["bytes"] == (out / name).stat().st_size
    assert not (out / PROGRESS_NAME).exists()


def test_non_empty_out_refused_without_resume(tmp_path, tiny_fp8_llama):
    out = tmp_path / "o"
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(OutputError, match="not empty; choose another --out"):
        convert(tiny_fp8_llama, out, progress=False)
    with pytest.raises(OutputError, match="holds no spark-quant build"):
        convert(tiny_fp8_llama, out, progress=False, resume=True)
    assert sorted(p.name for p in out.iterdir()) == ["x"]


@pytest.mark.parametrize("where", ["same", "inside"])
def test_out_never_overwrites_the_source(tiny_fp8_llama, where):
    out = tiny_fp8_llama if where == "same" else tiny_fp8_llama / "nvfp4"
    before = {p.name: p.read_bytes() for p in tiny_fp8_llama.iterdir()}
    for resume in (False, True):
        with pytest.raises(OutputError, match="is the source folder or inside it"):
            convert(tiny_fp8_llama, out, progress=False, resume=resume)
    assert {p.name: p.read_bytes() for p in tiny_fp8_llama.iterdir()} == before


def test_interrupted_resume_over_finished_build_leaves_nothing_complete(tmp_path, tiny_fp8_llama, monkeypatch):
    out = tmp_path / "o"
    convert(tiny_fp8_llama, out, progress=False)
    import quantize.convert.pipeline as pl
    monkeypatch.setattr(pl, "write_shard_atomic", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_fp8_llama, out, progress=False, resume=True)
    for marker in (MANIFEST_NAME, INDEX_NAME, "config.json"):
        assert not (out / marker).exists()


def test_resume_reconverts_a_changed_source_shard(tmp_path, tiny_fp8_llama, monkeypatch):
    clean = tmp_path / "clean"
    out = tmp_path / "o"
    killed_at_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_fp8_llama, out, progress=False)
    monkeypatch.undo()
    # shard 1 is re-downloaded with new values of the same shapes (headers unchanged)
    shard1 = tiny_fp8_llama / "model-00001-of-00003.safetensors"
    from safetensors.torch import load_file, save_file
    t = load_file(str(shard1))
    t["model.embed_tokens.weight"] = -t["model.embed_tokens.weight"]
    save_file(t, str(shard1))
    summary = convert(tiny_fp8_llama, out, progress=False, resume=True)
    assert summary.shards_skipped == 0
    convert(tiny_fp8_llama, clean, progress=False)
    assert shard1.name in os.listdir(out)
    assert (out / shard1.name).read_bytes() == (clean / shard1.name).read_bytes()


def test_fc23_tied_flag_with_a_different_lm_head_keeps_it(tmp_path):
    emb = torch.randn(128, 64).bfloat16()
    t = {"model.embed_tokens.weight": emb, "lm_head.weight": (emb * 2)}
    src = write_checkpoint(tmp_path / "s", t, {"tie_word_embeddings": True})
    summary = convert(src, tmp_path / "o", progress=False)
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert torch.equal(load_all(tmp_path / "o")["lm_head.weight"], emb * 2)
    assert any("differs from embed_tokens" in n for n in summary.notes)
    # an identical stored head is dropped and the tie kept
    src2 = write_checkpoint(tmp_path / "s2", {"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone()},
                            {"tie_word_embeddings": True})
    convert(src2, tmp_path / "o2", progress=False)
    assert "lm_head.weight" not in load_all(tmp_path / "o2")
    assert json.loads((tmp_path / "o2" / "config.json").read_text())["tie_word_embeddings"] is True


def test_nan_in_a_kept_tensor_is_refused(tmp_path):
    e = torch.randn(64, 32).bfloat16()
    e[1, 1] = float("nan")
    src = write_checkpoint(tmp_path / "s", {"model.embed_tokens.weight": e}, {})
    with pytest.raises(SourceError, match=r"model.embed_tokens.weight in shard .* has 1 NaN/Inf values; refusing"):
        convert(src, tmp_path / "o", progress=False)


def test_sensitive_modules_under_other_names_stay_unquantized(tmp_path):
    h = 64
    names = ["gpt_neox.embed_in", "embed_out", "model.decoder.embed_positions",
             "model.layers.0.mlp.shared_expert_gate", "model.layers.0.feed_forward.router",
             "model.layers.1.mlp.gate"]
    t = {f"{n}.weight": torch.randn(8 if "gate" in n or "router" in n else 128, h).bfloat16() for n in names}
    t["model.layers.0.mlp.shared_expert_gate.weight"] = torch.randn(1, h).bfloat16()
    t["model.layers.1.mlp.experts.0.down_proj.weight"] = torch.randn(h, 32).bfloat16()
    t["model.layers.0.feed_forward.experts.0.down_proj.weight"] = torch.randn(h, 32).bfloat16()
    src = write_checkpoint(tmp_path / "s", t, {})  # no expert count in the config
    convert(src, tmp_path / "o", progress=False)
    o = load_all(tmp_path / "o")
    for n in names:
        assert torch.equal(o[f"{n}.weight"], t[f"{n}.weight"]), n
    assert "model.layers.1.mlp.experts.0.down_proj.weight_packed" in o


def test_fc04_resume_after_kill_is_byte_identical(tmp_path, monkeypatch):
    src = moe_checkpoint(tmp_path)
    clean = tmp_path / "clean"
    convert(src, clean, progress=False)
    killed_at_write(monkeypatch, 3)  # killed while converting shard 3
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, progress=False)
    assert not (out / INDEX_NAME).exists() and not (out / MANIFEST_NAME).exists()
    monkeypatch.undo()
    summary = convert(src, out, progress=False, resume=True)
    assert summary.shards_skipped == 2 and summary.shards_written == 2
    assert_same_build(clean, out, same_source=False)


def test_resume_refuses_a_different_job(tmp_path, tiny_fp8_llama, monkeypatch):
    out = tmp_path / "o"
    import quantize.convert.pipeline as pl
    monkeypatch.setattr(pl, "write_index", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_fp8_llama, out, progress=False)
    monkeypatch.undo()
    (tmp_path / "r.toml").write_text('name="other"\n[[rule]]\nmatch="re:.*mlp.*"\ntarget="nvfp4"\n')
    with pytest.raises(OutputError, match="holds a different build"):
        convert(tiny_fp8_llama, out, progress=False, resume=True, recipe=str(tmp_path / "r.toml"))


def test_nan_weight_refused_with_name(tmp_path):
    w = torch.randn(16, 32)
    w[3, 3] = float("nan")
    src = write_checkpoint(tmp_path / "s", {"model.layers.0.mlp.down_proj.weight": w}, {})
    with pytest.raises(SourceError, match="down_proj.weight in shard model-00001-of-00001.safetensors has 1 NaN/Inf"):
        convert(src, tmp_path / "o", progress=False)
    assert not (tmp_path / "o" / INDEX_NAME).exists()
