"""eval/: teacher-forced KL, essay texts, and the reference / build model loaders."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from eval.kl import teacher_forced_kl, token_windows
from eval.models import dequantized_reference_state, load_build_model, load_source_model
from quantize.data.texts import essay_texts, texts_sha256
from quantize.kernels.fp8 import quantize_fp8_block

VOCAB = 128
BLOCK = [32, 32]  # several FP8 scale blocks per 64-wide weight


class CharTokenizer:
    """Byte-ish tokenizer for the tiny model: one id per character, ord(c) % 128."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=512, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs. " * 4]


# ---- teacher_forced_kl ---------------------------------------------------------------
def test_windows_cover_stream():
    wins = token_windows(CharTokenizer(), TEXTS, max_tokens=100, window=32)
    assert [w.shape[1] for w in wins] == [32, 32, 32, 4]
    assert all(w.dtype == torch.long for w in wins)
    with pytest.raises(ValueError):
        token_windows(CharTokenizer(), ["a"], max_tokens=100, window=32)


def test_kl_self_is_zero(model):
    r = teacher_forced_kl(model, model, CharTokenizer(), TEXTS, max_tokens=100, window=32)
    assert r["mean_kl"] == 0.0
    assert r["top1_agree"] == 1.0
    assert r["ppl_ref"] == r["ppl_test"]
    assert r["tokens"] == 3 * 31 + 3
    assert 1.0 < r["ppl_ref"] < 10 * VOCAB  # random model: perplexity near the vocabulary size


def test_kl_perturbed_is_positive(model):
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.model.layers[0].parameters():
            p.add_(0.05 * torch.randn_like(p))
    r = teacher_forced_kl(model, other, CharTokenizer(), TEXTS, max_tokens=100, window=32)
    assert r["mean_kl"] > 0.0
    assert r["ppl_ref"] != r["ppl_test"]
    assert 0.0 <= r["top1_agree"] <= 1.0
    assert r["tokens"] == 96


# ---- essay texts ---------------------------------------------------------------------
def test_essay_texts_deterministic():
    a, b = essay_texts(), essay_texts()
    assert a == b
    assert sum(map(len, a)) == 20000
    assert a[0][:40] == "July 2010What hard liquor, cigarettes, h"  # addiction.txt
    assert texts_sha256(a) == "c71c6ff414bc4d57db81401bf1e69b0477a70c36edb8a904c395c56c6d7a5fae"
    small = essay_texts(100)
    assert len(small) == 1 and small[0] == a[0][:100]
    with pytest.raises(ValueError):
        essay_texts(0)


# ---- model loaders on a tiny block-FP8 source ---------------------------------------------
def write_fp8_source(folder: Path, model: LlamaForCausalLM, extra: dict | None = None) -> dict:
    """Save ``model`` like a DeepSeek block-FP8 release; returns the float32 state it encodes."""
    folder.mkdir(parents=True)
    tensors, expected = {}, {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("_proj.weight"):
            q, s = quantize_fp8_block(w, tuple(BLOCK))
            tensors[name], tensors[name + "_scale_inv"] = q, s
            expected[name] = q.to(torch.float32) * s.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
        else:
            tensors[name] = w.to(torch.bfloat16)
            expected[name] = tensors[name].to(torch.float32)
    tensors.update(extra or {})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.update(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": BLOCK}, architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return expected


def test_load_source_model(model, tmp_path):
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}  # MTP layer
    expected = write_fp8_source(tmp_path / "src", model, extra=mtp)
    ref = load_source_model(tmp_path / "src")
    sd = ref.state_dict()
    for name, w in expected.items():
        assert torch.equal(sd[name], w), name
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32


def test_load_source_model_reports_unexpected(model, tmp_path):
    write_fp8_source(tmp_path / "src", model, extra={"model.bogus.weight": torch.zeros(4)})
    with pytest.raises(RuntimeError, match="unexpected .*model.bogus.weight"):
        load_source_model(tmp_path / "src")


def test_build_model_matches_own_dequantization(model, tmp_path):
    from quantize.convert.pipeline import convert

    write_fp8_source(tmp_path / "src", model)
    convert(tmp_path / "src", tmp_path / "build", device="cpu", progress=False)
    with safe_open(next((tmp_path / "build").glob("*.safetensors")), "pt") as f:
        assert "model.layers.0.mlp.down_proj.weight_packed" in f.keys()
    built = load_build_model(tmp_path / "build")
    state = dequantized_reference_state(tmp_path / "build", weight_dtype=torch.bfloat16)
    assert "model.layers.0.mlp.down_proj.weight" in state
    ours = tiny_llama(seed=1)
    result = ours.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    ours.tie_weights()
    ids = torch.tensor([CharTokenizer().encode(TEXTS[0][:64])])
    with torch.no_grad():
        assert torch.equal(built(ids).logits, ours(ids).logits)
    r = teacher_forced_kl(load_source_model(tmp_path / "src"), built, CharTokenizer(), TEXTS, 100, 32)
    assert 0.0 < r["mean_kl"] < 1.0
