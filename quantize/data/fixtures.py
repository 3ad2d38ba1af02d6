"""Synthetic checkpoints in the exact on-disk layout of FP8 releases, for benchmarks and tests.

Weights are random (normal, scaled like trained Linears), stored as DeepSeek-style block FP8
(``weight`` F8_E4M3 + ``weight_scale_inv`` F32, block 128x128).

- :func:`write_synthetic_fp8`: expert-only shards of any size (benchmarks).
- :func:`write_release_fixture` / :func:`write_release_descriptor`: GLM-5.3-Flash
  (``glm5_next``), GLM-5 (``glm_moe_dsa``) and DeepSeek-V3 releases with names and shapes from
  the real transformers classes (tiny with data, or a header-only full-size descriptor).
  What each release stores in FP8 / BF16 / F32 is the data row ``archs.RELEASE_LAYOUTS``.
"""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantize.archs import text_config
from quantize.kernels.fp8 import quantize_fp8_block

__all__ = ["BLOCK_FP8_CONFIG", "write_synthetic_fp8", "RELEASE_MODEL_TYPES", "release_config",
           "release_tensors", "write_release_fixture", "write_release_descriptor", "DESCRIPTOR_SUFFIX"]

BLOCK_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def write_synthetic_fp8(folder: Path, n_shards: int, experts_per_shard: int,
                        hidden: int = 2048, inter: int = 1024, seed: int = 0,
                        fast: bool = False) -> Path:
    """Write ``n_shards`` shards of MoE experts (gate/up [inter, hidden], down [hidden, inter])
    shaped like GLM-5.3-Flash routed experts, plus index and config.json.

    Each shard holds ``experts_per_shard`` experts of one layer, i.e.
    ``3 * inter * hidden * experts_per_shard`` FP8 bytes plus scales.

    ``fast`` writes random e4m3 bytes instead of quantizing random normals (same layout and
    value range, far quicker to build for multi-GB benchmarks).

    Returns:
        the folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for s in range(n_shards):
        tensors = {}
        for e in range(experts_per_shard):
            p = f"model.layers.{s}.mlp.experts.{e}"
            for m, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                             ("down_proj", (hidden, inter))):
                if fast:  # random e4m3 bytes (no NaN codes) and random scales: instant
                    b = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)
                    b |= torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
                    q = b.view(torch.float8_e4m3fn)
                    sc = torch.rand(-(-shape[0] // 128), -(-shape[1] // 128), generator=g) * 1e-4
                else:
                    q, sc = quantize_fp8_block(torch.randn(*shape, generator=g) * 0.02)
                tensors[f"{p}.{m}.weight"], tensors[f"{p}.{m}.weight_scale_inv"] = q, sc
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, str(folder / name))
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = {"model_type": "deepseek_v3", "num_hidden_layers": n_shards, "hidden_size": hidden,
              "moe_intermediate_size": inter, "n_routed_experts": experts_per_shard,
              "quantization_config": BLOCK_FP8_CONFIG}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# ---- release-layout fixtures (GLM-5.3-Flash, GLM-5, DeepSeek-V3) -------------------------

RELEASE_MODEL_TYPES = ("glm5_next", "glm_moe_dsa", "deepseek_v3")

# Tiny dims vLLM 0.26 accepts on Hopper (docs/formats.md §B.3.7): MLA kv_lora_rank 512 + qk_rope 64 = 576 (the MLA backends' head size) and
# (qk_nope, v) = (128, 128), DeepSeek-V3's pair in the FA prefill set; 16 heads (FlashMLA sparse
# prefill pads heads to 64 and needs 64 % heads == 0); DSA index_head_dim 128 with 32 index heads
# (DeepGEMM MQA logits: head dim 128, 16 / 32 / 64 heads) and index_topk 512 (a fast top-k size,
# >= any prompt here, so DSA selects every token); hidden 256 and intermediate sizes multiples of
# 128 (Marlin FP4 tiles without padding: N % 64 and K % 128; block FP8 merged partitions % 128).
# GLM-5.3-Flash keeps its real KDA / MLA head dims (linear_head_dim 128; NoPE MLA qk_nope = v = 256,
# qk_rope 0, kv_lora_rank 512; index_head_dim 128).
_MLA = dict(kv_lora_rank=512, q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, num_attention_heads=16, num_key_value_heads=16)
_TINY_TEXT = {
    "glm5_next": dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=256,
                      qk_nope_head_dim=256, v_head_dim=256, index_topk=64, index_head_dim=128,
                      index_n_heads=4, index_kpool=16, linear_head_dim=128, linear_num_heads=4,
                      hc_mult=2, pad_token_id=0, max_position_embeddings=512,
                      mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    "glm_moe_dsa": dict(vocab_size=256, hidden_size=256, intermediate_size=512,
                        moe_intermediate_size=128, num_hidden_layers=3, n_routed_experts=8,
                        num_experts_per_tok=2, **_MLA, head_dim=64, index_topk=512, index_head_dim=128,
                        index_n_heads=32, first_k_dense_replace=1, max_position_embeddings=512),
    "deepseek_v3": dict(vocab_size=256, hidden_size=256, intermediate_size=512,
                        moe_intermediate_size=128, num_hidden_layers=3, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, **_MLA,
                        first_k_dense_replace=1, max_position_embeddings=512),
}
_TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=256,
                    projection_intermediate_size=64, image_size=28)


def release_config(model_type: str, size: str = "tiny", initializer_range: float | None = None) -> dict:
    """``config.json`` of an FP8 release: the transformers config class's ``to_dict()``
    (defaults for ``size="full"``, small dimensions for ``"tiny"``), one MTP layer
    (``num_nextn_predict_layers: 1``), the release's router keys and ``layer_types`` names
    (``archs.ReleaseLayout.config_keys`` / ``portable_layer_types``) and the block-FP8
    ``quantization_config``.

    Args:
        initializer_range: std of the random Linear weights the fixture gets (the config key
            of that name; transformers' default 0.02 when None).

    Raises:
        ValueError: unknown model_type or size.
    """
    from transformers import AutoConfig

    from quantize.archs import RELEASE_LAYOUTS, portable_layer_types

    if model_type not in RELEASE_LAYOUTS:
        raise ValueError(f"unknown model_type {model_type!r} (valid: {', '.join(RELEASE_MODEL_TYPES)})")
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    layout = RELEASE_LAYOUTS[model_type]
    text = dict(_TINY_TEXT[model_type]) if size == "tiny" else {}
    text["num_nextn_predict_layers"] = 1
    text.update(layout.config_keys)
    if initializer_range is not None:
        text["initializer_range"] = float(initializer_range)
    if model_type == "glm5_next":
        kwargs = {"text_config": text}
        if size == "tiny":
            kwargs["vision_config"] = dict(_TINY_VISION)
    else:
        kwargs = text
    cfg = AutoConfig.for_model(model_type, **kwargs).to_dict()
    text_cfg = text_config(cfg)
    for key, value in layout.config_keys.items():  # kept even where the config class drops them
        text_cfg.setdefault(key, value)
    if isinstance(text_cfg.get("layer_types"), list):
        text_cfg["layer_types"] = portable_layer_types(text_cfg["layer_types"])
    cfg["architectures"] = [layout.hf_class]
    cfg["quantization_config"] = dict(BLOCK_FP8_CONFIG)
    for k in ("transformers_version", "_name_or_path"):
        cfg.pop(k, None)
    return cfg


def _mtp_extended(config: dict, layout) -> dict:
    """Config with one more decoder layer, of the MTP layer's kind, for building its tensors."""
    cfg = json.loads(json.dumps(config))
    cfg.pop("quantization_config", None)
    text = text_config(cfg)
    text["num_hidden_layers"] += 1
    for key, value in layout.mtp_layer_kind.items():
        if isinstance(text.get(key), list):
            text[key] = text[key] + [value]
    return cfg


def _layers_prefix(model) -> str:
    """``model.layers.`` or ``model.language_model.layers.``: where the decoder layers live."""
    import torch.nn as nn

    for name, mod in model.named_modules():
        if name.endswith("layers") and isinstance(mod, nn.ModuleList) and "visual" not in name:
            return name + "."
    raise ValueError(f"{type(model).__name__} has no decoder layer list")


def release_tensors(config: dict, *, with_data: bool, seed: int = 0) -> dict[str, tuple]:
    """Every tensor of an FP8 release with ``config``, in its on-disk layout.

    The real transformers class is instantiated (on the meta device unless ``with_data``,
    then on CPU with its own seeded initialisation, float32), with one extra decoder layer
    of the MTP kind. Its state dict is mapped to on-disk names by transformers' own reverse
    conversion mapping (``core_model_loading.revert_weight_conversion``: per-expert 2-D
    experts, GLM-5.3 ``f_a_proj`` / ``hc_attn_fn`` / ``q_conv1d`` names), the extra layer
    becomes ``<layers>.{num_hidden_layers}`` plus :data:`archs.MTP_EXTRA_TENSORS`, less the
    tensors the release's MTP layer lacks (``ReleaseLayout.mtp_drop``: GLM-5.3-Flash's has no
    mHC and no ``shared_head.head``), and each tensor gets the release's storage
    (:func:`archs.release_storage`, by name and by the module's roles).

    Returns:
        on-disk name -> ``(storage, shape, value)``: storage ``fp8`` / ``F32`` / ``BF16``,
        value a float32 tensor (``with_data``) or None. FP8 entries stand for the weight;
        its ``weight_scale_inv`` is implied.
    """
    import torch.nn as nn
    import transformers
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    from quantize.archs import (
        MTP_EXTRA_TENSORS,
        RELEASE_LAYOUTS,
        module_roles,
        release_storage,
        text_config,
    )

    layout = RELEASE_LAYOUTS[config["model_type"]]
    ext = _mtp_extended(config, layout)
    hf_cfg = AutoConfig.for_model(**ext)
    cls = getattr(transformers, layout.hf_class)
    torch.manual_seed(seed)
    if with_data:
        model = cls(hf_cfg).eval()
    else:
        with torch.device("meta"):
            model = cls(hf_cfg)
    all_modules = {n: m for n, m in model.named_modules()}
    linears = {n for n, m in all_modules.items() if isinstance(m, nn.Linear)}
    prefix = _layers_prefix(model)
    state = revert_weight_conversion(model, model.state_dict())
    text = text_config(config)
    n, hidden, vocab = text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]
    mtp = f"{prefix}{n}."

    def dropped(name: str) -> bool:  # not in the release's MTP layer (ReleaseLayout.mtp_drop)
        return name.startswith(mtp) and any(re.search(p, name[len(mtp):]) for p in layout.mtp_drop)

    state = {k: v for k, v in state.items() if not dropped(k)}
    on_disk_modules = {k.rsplit(".", 1)[0] for k in state}
    g = torch.Generator().manual_seed(seed + 1)
    out: dict[str, tuple] = {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        is_linear = module in linears or module not in all_modules
        roles = module_roles(module, on_disk_modules, config)
        storage = release_storage(layout, name, tuple(t.shape), is_linear, roles)
        value = None
        if with_data:
            value = t.detach().to(torch.float32).contiguous()
            if name.endswith("e_score_correction_bias"):  # init is zeros; make bits distinctive
                value = torch.randn(t.shape, generator=g) * 0.1
        out[name] = (storage, tuple(t.shape), value)
    extra_shapes = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                    "eh_proj.weight": (hidden, 2 * hidden), "shared_head.norm.weight": (hidden,),
                    "shared_head.head.weight": (vocab, hidden), "embed_tokens.weight": (vocab, hidden)}
    for suffix in MTP_EXTRA_TENSORS:
        shape = extra_shapes[suffix]
        name = mtp + suffix
        if dropped(name):
            continue
        value = None
        if with_data:
            value = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        out[name] = (release_storage(layout, name, shape, suffix == "eh_proj.weight"), shape, value)
    return out


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    bh, bw = BLOCK_FP8_CONFIG["weight_block_size"]
    return (-(-shape[0] // bh), -(-shape[1] // bw))


def write_release_fixture(folder: Path, model_type: str, seed: int = 0, n_shards: int = 3,
                          initializer_range: float | None = None) -> Path:
    """Write a tiny FP8 checkpoint in the exact on-disk layout of the ``model_type`` release
    (see :func:`release_tensors`): shards (a weight and its scale may sit in different
    shards), index from the written headers, ``config.json``. Takes seconds.
    ``initializer_range``: std of the random Linear weights (see :func:`release_config`).

    Returns:
        the folder.
    """
    from formats.checkpoint import write_index, write_json_atomic
    from formats.shards import write_shard_atomic

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = release_config(model_type, "tiny", initializer_range)
    tensors: dict[str, torch.Tensor] = {}
    for name, (storage, shape, value) in release_tensors(config, with_data=True, seed=seed).items():
        if storage == "fp8":
            q, s = quantize_fp8_block(value, tuple(BLOCK_FP8_CONFIG["weight_block_size"]))
            tensors[name], tensors[name + "_scale_inv"] = q, s
        else:
            tensors[name] = value.to(torch.float32 if storage == "F32" else torch.bfloat16)
    names = sorted(tensors)
    shards = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    for i, shard in enumerate(shards):
        write_shard_atomic({n: tensors[n] for n in names[i::n_shards]}, folder / shard)
    write_index(folder, shards)
    write_json_atomic(config, folder / "config.json")
    return folder


DESCRIPTOR_SUFFIX = ".descriptor.json"


def write_release_descriptor(path: Path, model_type: str, size: str = "full") -> Path:
    """Write a header-only descriptor of an FP8 release (no tensor data):
    ``{"config": {...}, "tensors": {name: {"dtype": "F8_E4M3", "shape": [N, K]}, ...}}``,
    with every ``weight_scale_inv`` listed. ``formats.sources.open_source`` accepts it for
    planning (``recipe show``, fit planning); reading data from it raises.

    Returns:
        the path written.
    """
    from formats.checkpoint import write_json_atomic

    config = release_config(model_type, size)
    tensors = {}
    for name, (storage, shape, _) in release_tensors(config, with_data=False).items():
        if storage == "fp8":
            tensors[name] = {"dtype": "F8_E4M3", "shape": list(shape)}
            tensors[name + "_scale_inv"] = {"dtype": "F32", "shape": list(_scale_shape(shape))}
        else:
            tensors[name] = {"dtype": storage, "shape": list(shape)}
    path = Path(path)
    write_json_atomic({"config": config, "tensors": dict(sorted(tensors.items()))}, path)
    return path
