"""``fp8_source_from_gguf`` on an untied model (the Qwen2.5-Coder GGUFs have their own lm_head):
the FP8 source keeps a bf16 ``lm_head.weight``, converts, and loads back with every tensor."""

import json

import torch
import transformers
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from eval.models import load_model
from quantize.convert.pipeline import convert
from quantize.data.demo import fp8_source_from_gguf


def test_untied_gguf_model_becomes_fp8_source_and_build(tmp_path, demo_src, monkeypatch):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=False,
                      max_position_embeddings=512)
    tiny = Qwen2ForCausalLM(cfg).eval()
    tok = AutoTokenizer.from_pretrained(demo_src)
    seen = {}

    def fake_model(folder, gguf_file=None, **kw):
        seen["gguf"] = gguf_file
        return tiny

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(fake_model))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: tok))
    src = fp8_source_from_gguf(tmp_path / "m.gguf", tmp_path / "src", n_shards=2)
    monkeypatch.undo()
    assert seen["gguf"] == "m.gguf"
    config = json.loads((src / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["quant_method"] == "fp8"
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" in index and "model.layers.0.self_attn.q_proj.bias" in index
    with safe_open(str(src / index["lm_head.weight"]), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    with safe_open(str(src / index["model.layers.1.mlp.down_proj.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.down_proj.weight").dtype == torch.float8_e4m3fn
    ref = load_model(src)
    assert torch.equal(ref.lm_head.weight, tiny.lm_head.weight.bfloat16().float())
    convert(src, tmp_path / "nvfp4", device="cpu", progress=False)
    built = load_model(tmp_path / "nvfp4")
    assert type(built).__name__ == "Qwen2ForCausalLM"
    assert torch.equal(built.lm_head.weight, ref.lm_head.weight)  # lm_head stays high precision
    assert not torch.equal(built.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight)
