"""``load_model`` dispatch and the ModelOpt NVFP4 loader (docs/formats.md §B.2.1)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval.models import dequantized_reference_state, load_model
from quantize.convert.pipeline import convert


def test_modelopt_layout_loads_to_the_same_weights(tiny_fp8_llama, tmp_path):
    convert(tiny_fp8_llama, tmp_path / "ct", device="cpu", progress=False)
    ct = load_model(tmp_path / "ct")  # compressed-tensors -> transformers decompression
    mo = tmp_path / "mo"
    mo.mkdir()
    tensors = {}
    for shard in (tmp_path / "ct").glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            out[name.replace(".weight_packed", ".weight")] = t
        elif name.endswith(".weight_global_scale"):  # CT quantize direction -> ModelOpt amax/2688
            out[name.replace(".weight_global_scale", ".weight_scale_2")] = (1.0 / t.float()).reshape(())
        else:
            out[name] = t
    save_file(out, str(mo / "model.safetensors"))
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}
    (mo / "config.json").write_text(json.dumps(cfg))
    model = load_model(mo)
    ours = dequantized_reference_state(tmp_path / "ct")
    sd = model.state_dict()
    name = "model.layers.1.mlp.gate_proj.weight"
    # 1 / (1 / g) may differ from g by an ulp, so compare to within float32 rounding
    assert torch.allclose(sd[name], ours[name], rtol=1e-6, atol=0)
    assert not torch.equal(sd[name], torch.zeros_like(sd[name]))
    ids = torch.tensor([[1, 5, 9, 200, 17]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ct(ids).logits, atol=2e-2)
    del out["model.layers.0.mlp.up_proj.weight_scale_2"]
    save_file(out, str(mo / "model.safetensors"))
    with pytest.raises(RuntimeError, match="model.layers.0.mlp.up_proj.weight without"):
        load_model(mo)
