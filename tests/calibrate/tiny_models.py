"""Tiny checkpoints built with the real transformers classes, stored as block FP8 on disk,
plus a dense copy holding exactly the dequantized values (the reference model)."""

import json
from pathlib import Path

import torch
from conftest import BLOCK_FP8_QC, fp8_pair, write_checkpoint
from safetensors.torch import load_file

from formats.sources import open_source


def _config(kind: str, n_layers: int, hidden: int, inter: int):
    from transformers import DeepseekV3Config, LlamaConfig
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    if kind == "llama":
        return LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                           num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, tie_word_embeddings=True)
    if kind == "deepseek_v3":  # MLA + MoE; every layer MoE unless dense_first
        return DeepseekV3Config(vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                                moe_intermediate_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
                                num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
                                q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                v_head_dim=128, max_position_embeddings=512, num_nextn_predict_layers=0,
                                topk_method="noaux_tc", scoring_func="sigmoid")  # MLA dims vLLM takes
    if kind == "glm5_next":  # KDA + DSA-indexed MLA + hyper-connections + MoE
        return Glm5NextTextConfig(
            vocab_size=256, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=32,
            num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, v_head_dim=16,
            qk_nope_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2, linear_head_dim=16,
            linear_num_heads=4, index_kpool=4, pad_token_id=0,
            mlp_layer_types=["dense"] + ["sparse"] * (n_layers - 1),
            layer_types=["linear_attention", "indexed_attention"] * (n_layers // 2))
    raise ValueError(kind)


def _model_class(kind: str):
    if kind == "glm5_next":
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

        return Glm5NextTextModel
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def build_tiny(folder: Path, kind: str, n_layers: int = 2, hidden: int = 64, inter: int = 96,
               seed: int = 0, edit=None, reference: bool = True) -> tuple[Path, Path | None]:
    """Write ``folder/fp8`` (block FP8 source, 2 shards) and, if ``reference``, ``folder/ref``
    (dense, exactly the dequantized FP8 values). ``edit(state_dict)`` may change weights
    first (routing).

    Returns:
        (fp8 source folder, dense reference folder or None).
    """
    torch.manual_seed(seed)
    cfg = _config(kind, n_layers, hidden, inter)
    cls = _model_class(kind)
    model = cls.from_config(cfg) if hasattr(cls, "from_config") and cls.__name__.startswith("Auto") else cls(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.1)
            elif n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    raw_dir = folder / "raw"
    model.save_pretrained(raw_dir)
    tensors = load_file(str(raw_dir / "model.safetensors"))
    if edit is not None:
        edit(tensors)
    config = json.loads((raw_dir / "config.json").read_text())
    fp8 = {}
    for name, t in tensors.items():
        if t.ndim == 2 and name.endswith("_proj.weight"):
            fp8.update(fp8_pair(name[: -len(".weight")], t.float()))
        else:
            fp8[name] = t
    src = write_checkpoint(folder / "fp8", fp8, dict(config, quantization_config=BLOCK_FP8_QC), n_shards=2)
    if not reference:
        return src, None
    s = open_source(src)
    dense = {n: s.read(n).contiguous() for n in s.tensors}
    s.close()
    ref = write_checkpoint(folder / "ref", dense, config)
    return src, ref


def load_reference(ref: Path, kind: str):
    return _model_class(kind).from_pretrained(ref).eval()
