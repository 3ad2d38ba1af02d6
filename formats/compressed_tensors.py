"""compressed-tensors layouts (vLLM, SGLang, transformers).

Per quantized Linear ``<m>`` [compressed-tensors compressors/nvfp4/base.py
NVFP4PackedCompressor, naive_quantized/base.py, mxfp8/base.py]:

| target    | tensor                      | dtype         | shape                        |
| nvfp4     | ``<m>.weight_packed``       | uint8         | [N, K/2] e2m1, even col low  |
|           | ``<m>.weight_scale``        | float8_e4m3fn | [N, K/16] block scale        |
|           | ``<m>.weight_global_scale`` | float32       | [1], quantize dir. 2688/amax |
| fp8-block | ``<m>.weight``              | float8_e4m3fn | [N, K]                       |
|           | ``<m>.weight_scale``        | float32 (*)   | [ceil(N/128), ceil(K/128)], multiplier |
| mxfp8     | ``<m>.weight``              | float8_e4m3fn | [N, K]                       |
|           | ``<m>.weight_scale``        | uint8 (e8m0)  | [N, K/32]                    |

(*) a passed-through DeepSeek ``weight_scale_inv`` keeps its stored dtype (F32, or BF16 in
some third-party releases); it is renamed only.
|           | ``<m>.input_global_scale``  | float32       | [1], W4A4 only: 2688/amax_in |

FP8 KV cache (``kv_cache_scheme`` 8-bit float, strategy tensor, static): ``<attn>.k_scale`` and
``<attn>.v_scale`` [1] in the dequant direction (amax / 448), dtype of the attention module
[compressed-tensors quantization/lifecycle/initialize.py initialize_attn_qparams;
docs/formats.md §B.4].

``config.json`` ``quantization_config`` is built with compressed-tensors' own
``QuantizationConfig`` / ``QuantizationScheme`` (presets NVFP4A16, FP8_BLOCK, MXFP8A16) and
serialised with ``model_dump``. One format: one group targeting ``Linear`` plus ``ignore``.
Several formats (``mixed-precision``): one group per format whose targets are ``re:``
patterns (digits generalised) checked to match only that group's modules, or exact names;
TRT-LLM rejects class-name targets in mixed configs (docs/formats.md §B.3.5).
"""

import re

import torch

from formats.fp8_layouts import emit_fp8_block, emit_mxfp8, fp8_output_specs  # noqa: F401 (writer API)
from quantize.kernels.act_scales import input_global_scale_from_amax
from quantize.kernels.nvfp4 import global_scale_from_amax

__all__ = ["FORMAT_NAME", "NVFP4_ORDER", "NVFP4_NAMES", "KV_NAMES", "GROUP_FORMATS",
           "nvfp4_weight_scalar", "nvfp4_input_scalar", "nvfp4_global_scale", "emit_nvfp4", "emit_fp8_block", "emit_mxfp8", "emit_kv_scales",
           "output_specs", "kv_scale_specs", "quantization_config", "extra_files", "QUANTIZED_SUFFIXES",
           "compact_targets"]

FORMAT_NAME = "nvfp4-pack-quantized"
NVFP4_ORDER = "global"
"""compressed-tensors divides by ``block_scale / global_scale`` (quantize direction)."""
NVFP4_NAMES = {"packed": "weight_packed", "block_scale": "weight_scale",
               "scalar": "weight_global_scale", "input_scalar": "input_global_scale"}
"""Local names (after ``<m>.``) of the NVFP4 tensors: what :func:`emit_nvfp4` and
:func:`output_specs` write, and what ``quantize check`` / ``verify`` look for."""
QUANTIZED_SUFFIXES = tuple("." + n for n in NVFP4_NAMES.values())
KV_NAMES = {"k": "k_scale", "v": "v_scale"}
"""Local names (after ``<attn>.``) of the FP8 KV scales (:func:`emit_kv_scales`)."""
_PRESETS = {"w4a16": "NVFP4A16", "w4a4": "NVFP4"}
_TARGET_SCHEME = {"nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"),
                  "fp8-block": ("FP8_BLOCK", "float-quantized"),
                  "mxfp8": ("MXFP8A16", "mxfp8-quantized")}
GROUP_FORMATS = {target: fmt for target, (_, fmt) in _TARGET_SCHEME.items()}
"""Quantized target -> the ``format`` of its config group (the top-level ``format`` of a
build with one target; ``mixed-precision`` for several)."""
_KV_SCHEMES = {"fp8": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                       "symmetric": True}}


def nvfp4_weight_scalar(amax: torch.Tensor | float) -> torch.Tensor:
    """The one NVFP4 weight scalar of this format, from the amax of the tensor or its fused
    group: the quantize-direction global scale ``2688 / amax``, float32 [1]. The kernels divide
    by ``block_scale / scalar`` (``NVFP4_ORDER`` ``global``) and :func:`emit_nvfp4` stores it."""
    return global_scale_from_amax(amax)


def nvfp4_input_scalar(amax_in: torch.Tensor | float) -> torch.Tensor:
    """W4A4 input scalar from the calibrated input amax: ``input_global_scale = 2688 / amax_in``,
    quantize direction, float32 [1]."""
    return input_global_scale_from_amax(amax_in)


def emit_nvfp4(module: str, packed: torch.Tensor, block_scale: torch.Tensor,
               scalar: torch.Tensor, *, input_scalar: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Name the NVFP4 tensors of ``module`` for this format.

    Args:
        packed: uint8 [N, K/2]. block_scale: float8_e4m3fn [N, K/16].
        scalar: :func:`nvfp4_weight_scalar`, float32 [1], quantize direction (2688 / amax),
            stored as ``weight_global_scale``.
        input_scalar: :func:`nvfp4_input_scalar`, W4A4 only, float32 [1] (2688 / amax_in),
            stored as ``input_global_scale``.
    """
    names = NVFP4_NAMES
    out = {
        f"{module}.{names['packed']}": packed,
        f"{module}.{names['block_scale']}": block_scale,
        f"{module}.{names['scalar']}": scalar.to(torch.float32).reshape(1),
    }
    if input_scalar is not None:
        out[f"{module}.{names['input_scalar']}"] = input_scalar.to(torch.float32).reshape(1)
    return out


def nvfp4_global_scale(scalar: torch.Tensor) -> torch.Tensor:
    """The quantize-direction global scale (``2688 / amax``) from the stored weight scalar:
    ``weight_global_scale`` itself, float32 [1]."""
    return scalar.reshape(1).to(torch.float32)


def output_specs(module: str, target: str, shape: tuple[int, int], fp8_scale_dtype: str = "F32",
                 scheme: str = "w4a16") -> dict:
    """Names, safetensors dtypes and shapes the ``emit_*`` functions write for a quantized
    ``target`` of a weight [N, K] (``scheme`` ``w4a4`` adds NVFP4's ``input_global_scale``)."""
    n, k = shape
    if target == "nvfp4":
        names = NVFP4_NAMES
        specs = {f"{module}.{names['packed']}": ("U8", (n, k // 2)),
                 f"{module}.{names['block_scale']}": ("F8_E4M3", (n, k // 16)),
                 f"{module}.{names['scalar']}": ("F32", (1,))}
        if scheme == "w4a4":
            specs[f"{module}.{names['input_scalar']}"] = ("F32", (1,))
        return specs
    specs = fp8_output_specs(module, target, shape, fp8_scale_dtype)
    if specs is not None:
        return specs
    raise ValueError(f"{target!r} is not a quantized target")


def emit_kv_scales(attention: str, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """FP8 KV-cache scales of one attention block: ``<attention>.k_scale`` / ``.v_scale``,
    shape [1], dequant direction (amax / 448), in the attention module's ``dtype``."""
    return {f"{attention}.{KV_NAMES['k']}": k_scale.reshape(1).to(dtype),
            f"{attention}.{KV_NAMES['v']}": v_scale.reshape(1).to(dtype)}


def kv_scale_specs(attention: str, dtype: str) -> dict:
    """What :func:`emit_kv_scales` writes: names, safetensors ``dtype`` (the module's) and shapes."""
    return {f"{attention}.{KV_NAMES['k']}": (dtype, (1,)), f"{attention}.{KV_NAMES['v']}": (dtype, (1,))}


def _template(module: str) -> str:
    """``re:`` pattern of ``module`` with every numeric path component generalised."""
    parts = [r"\d+" if p.isdigit() else re.escape(p) for p in module.split(".")]
    return "re:^" + r"\.".join(parts) + "$"


def compact_targets(groups: dict[str, list[str]], others: list[str]) -> dict[str, list[str]]:
    """Per group, a short target list matching exactly its modules.

    A digit-generalised pattern is used when every module it matches (among all groups'
    modules and ``others``) belongs to that group; otherwise the exact names are listed.
    """
    owner = {m: g for g, ms in groups.items() for m in ms}
    for m in others:
        owner.setdefault(m, None)
    by_template: dict[str, set] = {}
    for m, g in owner.items():
        by_template.setdefault(_template(m), set()).add(g)
    out = {}
    for g, ms in groups.items():
        targets = set()
        for m in ms:
            t = _template(m)
            targets.add(t if by_template[t] == {g} else m)
        out[g] = sorted(targets)
    return out


def quantization_config(targets: dict[str, str], ignore: list[str], scheme: str = "w4a16",
                        producer: dict | None = None, kv_cache: str | None = None) -> dict:
    """``quantization_config`` for config.json.

    Args:
        targets: quantized module name -> target (``nvfp4``, ``fp8-block``, ``mxfp8``).
        ignore: exact module names written unquantized (derived from what was written).
        scheme: ``w4a16`` (weight-only NVFP4A16) or ``w4a4`` (NVFP4 modules get the NVFP4
            preset: activations e2m1 with dynamic e4m3 block scales and a static global scale,
            ``dynamic: "local"``).
        producer: unused (compressed-tensors records only its own ``version``).
        kv_cache: ``fp8`` declares a static per-tensor FP8 KV cache (``kv_cache_scheme``).

    Raises:
        ValueError: unknown scheme or KV-cache type.
    """
    # compressed-tensors' schema classes, imported here: the package pulls in transformers and
    # torch.distributed (about 5 s of a 2-core machine), which no conversion worker, check or plan
    # that never writes a config should pay
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme

    if scheme not in _PRESETS:
        raise ValueError(f"scheme {scheme!r} is not available for compressed-tensors output "
                         f"(valid: {', '.join(_PRESETS)})")
    if kv_cache is not None and kv_cache not in _KV_SCHEMES:
        raise ValueError(f"kv cache {kv_cache!r} is not available (valid: {', '.join(_KV_SCHEMES)})")

    def scheme_of(kind: str, targets_: list[str]):
        preset, fmt = _TARGET_SCHEME[kind]
        group = preset_name_to_scheme(_PRESETS[scheme] if kind == "nvfp4" else preset, targets_)
        group.format = fmt
        return group

    kinds = sorted(set(targets.values())) or ["nvfp4"]
    if len(kinds) == 1:
        groups, top = {"group_0": scheme_of(kinds[0], ["Linear"])}, _TARGET_SCHEME[kinds[0]][1]
    else:
        by_kind = {k: sorted(m for m, t in targets.items() if t == k) for k in kinds}
        compact = compact_targets(by_kind, list(ignore))
        groups = {f"group_{i}": scheme_of(k, compact[k]) for i, k in enumerate(kinds)}
        top = "mixed-precision"
    kv = QuantizationArgs(**_KV_SCHEMES[kv_cache]) if kv_cache else None
    cfg = QuantizationConfig(config_groups=groups, format=top, quantization_status="compressed",
                             ignore=sorted(ignore), kv_cache_scheme=kv)
    out = cfg.model_dump(mode="json")
    out["version"] = compressed_tensors.__version__
    return out


def extra_files(targets: dict[str, str], ignore: list[str], scheme: str = "w4a16",
                producer: dict | None = None, kv_cache: str | None = None) -> dict[str, dict]:
    """Files besides config.json this format needs: none."""
    return {}
