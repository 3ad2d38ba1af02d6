"""GPTQ through llm-compressor, run in its own environment (skipped when none is given)."""

import json
import os
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny

from calibrate.gptq import convert_gptq

GPTQ_PYTHON = os.environ.get("SPARK_QUANT_GPTQ_PYTHON")


def test_gptq_without_environment_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARK_QUANT_GPTQ_PYTHON", raising=False)
    with pytest.raises(RuntimeError, match="needs an environment with llm-compressor"):
        convert_gptq(tmp_path, tmp_path / "out", dataset="random")


@pytest.mark.skipif(not GPTQ_PYTHON or not Path(GPTQ_PYTHON).is_file(),
                    reason="set SPARK_QUANT_GPTQ_PYTHON to an environment with llmcompressor==0.14.0.1")
def test_gptq_build_loads_and_tracks_the_source(tmp_path):
    from eval.models import load_build_model

    src, ref = build_tiny(tmp_path, "llama", n_layers=2, hidden=64, inter=128)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    tok.save_pretrained(src)
    out = convert_gptq(src, tmp_path / "g", dataset="random", samples=4, seq_len=32, python=GPTQ_PYTHON)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and qc["ignore"] == ["lm_head"]
    model = load_build_model(out)
    from tiny_models import load_reference

    base = load_reference(ref, "llama")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits, base(ids).logits
    assert 0 < (a - b).abs().max() < 0.5 * b.abs().max()
