"""compressed-tensors ``nvfp4-pack-quantized`` layout (vLLM, SGLang, transformers).

Per quantized Linear ``<m>`` [compressed-tensors compressors/nvfp4/base.py
NVFP4PackedCompressor.compression_param_names]:

| tensor                    | dtype         | shape     | meaning                          |
| ``<m>.weight_packed``     | uint8         | [N, K/2]  | e2m1 codes, even column low      |
| ``<m>.weight_scale``      | float8_e4m3fn | [N, K/16] | block scale                      |
| ``<m>.weight_global_scale`` | float32     | [1]       | quantize direction, 2688 / amax  |
| ``<m>.input_global_scale`` | float32      | [1]       | W4A4 only: 2688 / amax_in        |

FP8 KV cache (``kv_cache_scheme`` 8-bit float, strategy tensor, static): ``<attn>.k_scale`` and
``<attn>.v_scale`` [1] in the dequant direction (amax / 448), dtype of the attention module
[compressed-tensors quantization/lifecycle/initialize.py initialize_attn_qparams;
formats_spec.md B.4].

``config.json`` ``quantization_config`` is built with compressed-tensors' own
``QuantizationConfig`` / ``QuantizationScheme`` (preset NVFP4A16) and serialised with
``model_dump``; ``ignore`` lists exact module names.
"""

import compressed_tensors
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme

__all__ = ["FORMAT_NAME", "emit_nvfp4", "emit_kv_scales", "quantization_config", "QUANTIZED_SUFFIXES"]

FORMAT_NAME = "nvfp4-pack-quantized"
QUANTIZED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale")
_PRESETS = {"w4a16": "NVFP4A16", "w4a4": "NVFP4"}
_KV_SCHEMES = {"fp8": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                       "symmetric": True}}


def emit_nvfp4(module: str, packed: torch.Tensor, block_scale: torch.Tensor,
               global_scale: torch.Tensor, input_global_scale: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    """Name the NVFP4 tensors of ``module`` for this format.

    Args:
        packed: uint8 [N, K/2]. block_scale: float8_e4m3fn [N, K/16].
        global_scale: float32 [1], quantize direction (2688 / amax), stored as is.
        input_global_scale: float32 [1], W4A4 only, quantize direction (2688 / amax_in).
    """
    out = {
        f"{module}.weight_packed": packed,
        f"{module}.weight_scale": block_scale,
        f"{module}.weight_global_scale": global_scale.to(torch.float32).reshape(1),
    }
    if input_global_scale is not None:
        out[f"{module}.input_global_scale"] = input_global_scale.to(torch.float32).reshape(1)
    return out


def emit_kv_scales(attention: str, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """FP8 KV-cache scales of one attention block: ``<attention>.k_scale`` / ``.v_scale``,
    shape [1], dequant direction (amax / 448), in the attention module's ``dtype``."""
    return {f"{attention}.k_scale": k_scale.reshape(1).to(dtype),
            f"{attention}.v_scale": v_scale.reshape(1).to(dtype)}


def quantization_config(ignore: list[str], scheme: str = "w4a16", kv_cache: str | None = None) -> dict:
    """``quantization_config`` for config.json.

    Args:
        ignore: exact module names written unquantized (derived from what was written).
        scheme: ``w4a16`` (weight-only NVFP4A16) or ``w4a4`` (NVFP4: activations e2m1 with
            dynamic e4m3 block scales and a static global scale, ``dynamic: "local"``).
        kv_cache: ``fp8`` declares a static per-tensor FP8 KV cache (``kv_cache_scheme``).

    Raises:
        ValueError: unknown scheme or KV-cache type.
    """
    if scheme not in _PRESETS:
        raise ValueError(f"scheme {scheme!r} is not available for compressed-tensors output "
                         f"(valid: {', '.join(_PRESETS)})")
    if kv_cache is not None and kv_cache not in _KV_SCHEMES:
        raise ValueError(f"kv cache {kv_cache!r} is not available (valid: {', '.join(_KV_SCHEMES)})")
    group = preset_name_to_scheme(_PRESETS[scheme], ["Linear"])
    group.format = FORMAT_NAME
    kv = QuantizationArgs(**_KV_SCHEMES[kv_cache]) if kv_cache else None
    cfg = QuantizationConfig(config_groups={"group_0": group}, format=FORMAT_NAME,
                             quantization_status="compressed", ignore=sorted(ignore),
                             kv_cache_scheme=kv)
    out = cfg.model_dump(mode="json")
    out["version"] = compressed_tensors.__version__
    return out
