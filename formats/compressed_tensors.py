"""compressed-tensors ``nvfp4-pack-quantized`` layout (vLLM, SGLang, transformers).

Per quantized Linear ``<m>`` [compressed-tensors compressors/nvfp4/base.py
NVFP4PackedCompressor.compression_param_names]:

| tensor                    | dtype         | shape     | meaning                          |
| ``<m>.weight_packed``     | uint8         | [N, K/2]  | e2m1 codes, even column low      |
| ``<m>.weight_scale``      | float8_e4m3fn | [N, K/16] | block scale                      |
| ``<m>.weight_global_scale`` | float32     | [1]       | quantize direction, 2688 / amax  |

``config.json`` ``quantization_config`` is built with compressed-tensors' own
``QuantizationConfig`` / ``QuantizationScheme`` (preset NVFP4A16) and serialised with
``model_dump``; ``ignore`` lists exact module names.
"""

import compressed_tensors
import torch
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

__all__ = ["FORMAT_NAME", "emit_nvfp4", "quantization_config", "QUANTIZED_SUFFIXES"]

FORMAT_NAME = "nvfp4-pack-quantized"
QUANTIZED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale")
_PRESETS = {"w4a16": "NVFP4A16"}


def emit_nvfp4(module: str, packed: torch.Tensor, block_scale: torch.Tensor,
               global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Name the NVFP4 tensors of ``module`` for this format.

    Args:
        packed: uint8 [N, K/2]. block_scale: float8_e4m3fn [N, K/16].
        global_scale: float32 [1], quantize direction (2688 / amax), stored as is.
    """
    return {
        f"{module}.weight_packed": packed,
        f"{module}.weight_scale": block_scale,
        f"{module}.weight_global_scale": global_scale.to(torch.float32).reshape(1),
    }


def quantization_config(ignore: list[str], scheme: str = "w4a16") -> dict:
    """``quantization_config`` for config.json.

    Args:
        ignore: exact module names written unquantized (derived from what was written).
        scheme: ``w4a16`` (weight-only NVFP4A16).

    Raises:
        ValueError: unknown scheme.
    """
    if scheme not in _PRESETS:
        raise ValueError(f"scheme {scheme!r} is not available for compressed-tensors output "
                         f"(valid: {', '.join(_PRESETS)})")
    group = preset_name_to_scheme(_PRESETS[scheme], ["Linear"])
    group.format = FORMAT_NAME
    cfg = QuantizationConfig(config_groups={"group_0": group}, format=FORMAT_NAME,
                             quantization_status="compressed", ignore=sorted(ignore))
    out = cfg.model_dump(mode="json")
    out["version"] = compressed_tensors.__version__
    return out
