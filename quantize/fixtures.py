"""Synthetic checkpoints in the exact on-disk layout of FP8 releases, for benchmarks and tests.

Weights are random (normal, scaled like trained Linears), stored as DeepSeek-style block FP8
(``weight`` F8_E4M3 + ``weight_scale_inv`` F32, block 128x128).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantize.kernels.fp8 import quantize_fp8_block

__all__ = ["BLOCK_FP8_CONFIG", "write_synthetic_fp8"]

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
