"""Block-FP8 and MXFP8 weight tensors, which compressed-tensors and ModelOpt name alike.

| target    | ``<m>.weight``        | ``<m>.weight_scale``                                     |
| fp8-block | float8_e4m3fn [N, K]  | F32 (or the passed-through source dtype) [ceil(N/128), ceil(K/128)], multiplier |
| mxfp8     | float8_e4m3fn [N, K]  | uint8 e8m0 [N, K/32]                                     |

[compressed-tensors naive_quantized/base.py + mxfp8/base.py; ModelOpt unified_export_hf.py
FP8_PB_WO / MXFP8 export; vLLM ModelOptMxFp8LinearMethod]
"""

import torch

__all__ = ["emit_fp8_block", "emit_mxfp8", "fp8_output_specs"]


def emit_fp8_block(module: str, weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` e4m3 [N, K] + ``weight_scale`` [ceil(N/128), ceil(K/128)] (multiplier)."""
    return {f"{module}.weight": weight, f"{module}.weight_scale": scale}


def emit_mxfp8(module: str, weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` e4m3 [N, K] + ``weight_scale`` uint8 e8m0 [N, K/32]."""
    return {f"{module}.weight": weight, f"{module}.weight_scale": scale}


def fp8_output_specs(module: str, target: str, shape: tuple[int, int], fp8_scale_dtype: str) -> dict | None:
    """Names, safetensors dtypes and shapes for ``fp8-block`` / ``mxfp8``; None for other targets."""
    n, k = shape
    if target == "fp8-block":
        return {f"{module}.weight": ("F8_E4M3", (n, k)),
                f"{module}.weight_scale": (fp8_scale_dtype, (-(-n // 128), -(-k // 128)))}
    if target == "mxfp8":
        return {f"{module}.weight": ("F8_E4M3", (n, k)), f"{module}.weight_scale": ("U8", (n, k // 32))}
    return None
