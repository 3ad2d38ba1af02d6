"""NVIDIA ModelOpt unified HF checkpoint layout (``quant_method: modelopt``).

Per quantized Linear ``<m>`` [ModelOpt export/unified_export_hf.py _export_quantized_weight,
quant_utils.py; vLLM modelopt.py ModelOptNvFp4LinearMethod / ModelOptMxFp8LinearMethod]:

| target    | tensor                 | dtype         | shape                                   |
| nvfp4     | ``<m>.weight``         | uint8         | [N, K/2] e2m1, even col low              |
|           | ``<m>.weight_scale``   | float8_e4m3fn | [N, K/16] (same bytes rule as CT)        |
|           | ``<m>.weight_scale_2`` | float32       | [] (0-dim), dequant direction amax/2688 |
|           | ``<m>.input_scale``    | float32       | [] (0-dim), W4A4 only: amax_in/2688      |
| fp8-block | ``<m>.weight``         | float8_e4m3fn | [N, K] (``FP8_PB_WO``)                    |
|           | ``<m>.weight_scale``   | float32 (*)   | [ceil(N/128), ceil(K/128)], multiplier   |
| mxfp8     | ``<m>.weight``         | float8_e4m3fn | [N, K]                                   |
|           | ``<m>.weight_scale``   | uint8 (e8m0)  | [N, K/32]                                |

(*) a passed-through DeepSeek ``weight_scale_inv`` keeps its stored dtype, renamed only.

FP8 KV cache (``kv_cache_quant_algo: "FP8"`` in hf_quant_config.json, and in config.json
``kv_cache_scheme: {"dynamic": false, "num_bits": 8, "type": "float"}`` as ModelOpt's
``convert_hf_quant_config_format`` writes it: vLLM 0.26 reads only config.json when it has a
``quantization_config``): ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` float32, dequant
direction amax / 448 (ModelOpt quant_utils.py ``_KV_CACHE_REPLACEMENTS``; vLLM remaps them to
``<attn>.attn.k_scale``; docs/formats.md §B.4). Written 0-dim like the other ModelOpt scalars
[UNCONFIRMED: shape of ModelOpt's own export]. MLA (DeepSeek / GLM-5) keeps ModelOpt's names
although vLLM 0.26 loads no KV-scale name for MLA attention (docs/formats.md §B.4;
``formats.engines.VLLM_MLA_KV_SCALES_LOADED``).

Two config files (ModelOpt ``_write_hf_export_config``):
``hf_quant_config.json`` ``{"producer", "quantization": {"quant_algo", "kv_cache_quant_algo",
"group_size", "exclude_modules"[, "quantized_layers"]}}`` (vLLM requires the three keys,
docs/formats.md §B.2.2) and ``config.json`` ``quantization_config`` as ModelOpt's
``convert_hf_quant_config_format`` writes it, whose ``ignore`` equals ``exclude_modules``
(FC-25). Weight-only NVFP4 is ``W4A16_NVFP4``; builds with several formats are
``MIXED_PRECISION`` with every quantized module in ``quantized_layers``.

Converting to compressed-tensors is renaming plus reciprocal scalars
(compressed-tensors entrypoints/convert/converters/modelopt_nvfp4.py): see
:func:`to_compressed_tensors` / :func:`from_compressed_tensors`.
"""

import torch

from formats.fp8_layouts import emit_fp8_block, emit_mxfp8, fp8_output_specs  # noqa: F401 (writer API)
from quantize.kernels.act_scales import input_scale_from_amax
from quantize.kernels.nvfp4 import scale_2_from_amax

__all__ = ["FORMAT_NAME", "NVFP4_ORDER", "HF_QUANT_CONFIG", "NVFP4_NAMES", "KV_NAMES", "ALGO_TARGETS",
           "nvfp4_weight_scalar", "nvfp4_input_scalar", "nvfp4_global_scale", "emit_nvfp4", "emit_fp8_block",
           "emit_mxfp8", "emit_kv_scales", "output_specs", "kv_scale_specs", "quant_algo_of", "hf_quant_config", "quantization_config",
           "extra_files", "to_compressed_tensors", "from_compressed_tensors"]

FORMAT_NAME = "modelopt"
NVFP4_ORDER = "scale_2"
"""ModelOpt divides by ``block_scale * scale_2`` (dequant direction) and gives all-zero
blocks scale 1.0 (``NVFP4QTensor.get_weights_scaling_factor``)."""
HF_QUANT_CONFIG = "hf_quant_config.json"
NVFP4_NAMES = {"packed": "weight", "block_scale": "weight_scale",
               "scalar": "weight_scale_2", "input_scalar": "input_scale"}
"""Local names (after ``<m>.``) of the NVFP4 tensors: what :func:`emit_nvfp4` and
:func:`output_specs` write, and what ``quantize check`` / ``verify`` look for."""
KV_NAMES = {"k": "k_proj.k_scale", "v": "v_proj.v_scale"}
"""Local names (after ``<attn>.``) of the FP8 KV scales (:func:`emit_kv_scales`)."""
_W4A4_NVFP4 = {"quant_algo": "NVFP4", "group_size": 16}
_KV_ALGOS = {"fp8": "FP8"}
_KV_SCHEMES = {"FP8": {"dynamic": False, "num_bits": 8, "type": "float"}}
"""config.json ``kv_cache_scheme`` per ``kv_cache_quant_algo`` (ModelOpt
``convert_hf_quant_config_format``; vLLM 0.26 modelopt.py ``ModelOptQuantConfigBase.from_config``
reads ``type float`` + ``num_bits 8`` as FP8, torch_utils.py ``get_kv_cache_quant_algo_string``
also needs ``dynamic: false`` to pick fp8 for ``--kv-cache-dtype auto``)."""
_LAYER_ALGO = {"nvfp4": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
               "fp8-block": {"quant_algo": "FP8_PB_WO"},
               "mxfp8": {"quant_algo": "MXFP8", "group_size": 32}}
ALGO_TARGETS = {_W4A4_NVFP4["quant_algo"]: "nvfp4",
                **{algo["quant_algo"]: target for target, algo in _LAYER_ALGO.items()}}
"""``quant_algo`` (of the build or a ``quantized_layers`` entry) -> the quantized target it
declares."""


def nvfp4_weight_scalar(amax: torch.Tensor | float) -> torch.Tensor:
    """The one NVFP4 weight scalar of this format, from the amax of the tensor or its fused
    group: the dequant-direction ``weight_scale_2 = amax / 2688``, float32 0-dim (1.0 for an
    all-zero tensor). The kernels divide by ``block_scale * scalar`` (``NVFP4_ORDER``
    ``scale_2``) and :func:`emit_nvfp4` stores it."""
    return scale_2_from_amax(amax)


def nvfp4_input_scalar(amax_in: torch.Tensor | float) -> torch.Tensor:
    """W4A4 input scalar from the calibrated input amax: ``input_scale = amax_in / 2688``,
    dequant direction, float32 0-dim (docs/formats.md §B.2.1; ModelOpt
    ``NVFP4QTensor.get_activation_scaling_factor``)."""
    return input_scale_from_amax(amax_in)


def emit_nvfp4(module: str, packed: torch.Tensor, block_scale: torch.Tensor,
               scalar: torch.Tensor, *, input_scalar: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Name the NVFP4 tensors of ``module``.

    Args:
        packed: uint8 [N, K/2]. block_scale: float8_e4m3fn [N, K/16].
        scalar: :func:`nvfp4_weight_scalar`, float32, dequant direction (amax / 2688), stored
            0-dim as ``weight_scale_2`` as ModelOpt does.
        input_scalar: :func:`nvfp4_input_scalar`, W4A4 only, float32 (amax_in / 2688),
            stored 0-dim as ``input_scale`` (docs/formats.md §B.2.1; ModelOpt
            ``NVFP4QTensor.get_activation_scaling_factor``).
    """
    names = NVFP4_NAMES
    out = {f"{module}.{names['packed']}": packed, f"{module}.{names['block_scale']}": block_scale,
           f"{module}.{names['scalar']}": scalar.to(torch.float32).reshape(())}
    if input_scalar is not None:
        out[f"{module}.{names['input_scalar']}"] = input_scalar.to(torch.float32).reshape(())
    return out


def nvfp4_global_scale(scalar: torch.Tensor) -> torch.Tensor:
    """The quantize-direction global scale (``2688 / amax``) from the stored weight scalar:
    the reciprocal of ``weight_scale_2``, float32 [1]."""
    return 1.0 / scalar.reshape(1).to(torch.float32)


def emit_kv_scales(attention: str, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """FP8 KV-cache scales of one attention block: ``<attention>.k_proj.k_scale`` /
    ``<attention>.v_proj.v_scale``, float32 0-dim, dequant direction (amax / 448); ``dtype``
    (the module's) is not used: ModelOpt stores float32."""
    return {f"{attention}.{KV_NAMES['k']}": k_scale.to(torch.float32).reshape(()),
            f"{attention}.{KV_NAMES['v']}": v_scale.to(torch.float32).reshape(())}


def kv_scale_specs(attention: str, dtype: str) -> dict:
    """What :func:`emit_kv_scales` writes (``dtype`` unused: always F32)."""
    return {f"{attention}.{KV_NAMES['k']}": ("F32", ()), f"{attention}.{KV_NAMES['v']}": ("F32", ())}


def output_specs(module: str, target: str, shape: tuple[int, int], fp8_scale_dtype: str = "F32",
                 scheme: str = "w4a16") -> dict:
    """Names, safetensors dtypes and shapes the ``emit_*`` functions write for a quantized
    ``target`` of a weight [N, K] (``scheme`` ``w4a4`` adds NVFP4's ``input_scale``)."""
    n, k = shape
    if target == "nvfp4":
        names = NVFP4_NAMES
        specs = {f"{module}.{names['packed']}": ("U8", (n, k // 2)),
                 f"{module}.{names['block_scale']}": ("F8_E4M3", (n, k // 16)),
                 f"{module}.{names['scalar']}": ("F32", ())}
        if scheme == "w4a4":
            specs[f"{module}.{names['input_scalar']}"] = ("F32", ())
        return specs
    specs = fp8_output_specs(module, target, shape, fp8_scale_dtype)
    if specs is not None:
        return specs
    raise ValueError(f"{target!r} is not a quantized target")


def _layer_algo(target: str, scheme: str) -> dict:
    return dict(_W4A4_NVFP4) if target == "nvfp4" and scheme == "w4a4" else dict(_LAYER_ALGO[target])


def quant_algo_of(targets: dict[str, str], scheme: str = "w4a16") -> str:
    """``W4A16_NVFP4`` (``NVFP4`` for W4A4) / ``FP8_PB_WO`` / ``MXFP8`` for one format,
    ``MIXED_PRECISION`` for several."""
    kinds = set(targets.values()) or {"nvfp4"}
    return _layer_algo(kinds.pop(), scheme)["quant_algo"] if len(kinds) == 1 else "MIXED_PRECISION"


def _check_options(scheme: str, kv_cache: str | None) -> None:
    if scheme not in ("w4a16", "w4a4"):
        raise ValueError(f"scheme {scheme!r} is not available for modelopt output (valid: w4a16, w4a4)")
    if kv_cache is not None and kv_cache not in _KV_ALGOS:
        raise ValueError(f"kv cache {kv_cache!r} is not available (valid: {', '.join(_KV_ALGOS)})")


def hf_quant_config(targets: dict[str, str], ignore: list[str], producer: dict, scheme: str = "w4a16",
                    kv_cache: str | None = None) -> dict:
    """``hf_quant_config.json`` contents.

    Args:
        targets: quantized module name -> target. ignore: unquantized module names (exact).
        producer: ``{"name": ..., "version": ...}``.
        scheme: ``w4a16`` or ``w4a4`` (NVFP4 modules ``quant_algo: NVFP4``, with ``input_scale``).
        kv_cache: ``fp8`` sets ``kv_cache_quant_algo: "FP8"``.

    Raises:
        ValueError: unknown scheme or KV-cache type.
    """
    _check_options(scheme, kv_cache)
    algo = quant_algo_of(targets, scheme)
    q = {"quant_algo": algo, "kv_cache_quant_algo": _KV_ALGOS[kv_cache] if kv_cache else None,
         "group_size": 16, "exclude_modules": sorted(ignore)}
    if algo == "MIXED_PRECISION":
        q["quantized_layers"] = {m: _layer_algo(t, scheme) for m, t in sorted(targets.items())}
    elif algo == "MXFP8":
        q["group_size"] = 32
    return {"producer": dict(producer), "quantization": q}


def _group_config(algo: str, group_size: int | None) -> dict:
    # ModelOpt export/convert_hf_config.py _quant_algo_to_group_config, for our algos.
    if algo == "W4A16_NVFP4":
        return {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size or 16}}
    if algo == "NVFP4":
        gs = group_size or 16
        return {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs},
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs}}
    if algo == "MXFP8":
        gs = group_size or 32
        return {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float", "group_size": gs},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float", "group_size": gs}}
    return {"quant_algo": algo}


def quantization_config(targets: dict[str, str], ignore: list[str], scheme: str = "w4a16",
                        producer: dict | None = None, kv_cache: str | None = None) -> dict:
    """config.json ``quantization_config``: ModelOpt's ``convert_hf_quant_config_format`` of
    :func:`hf_quant_config` (``quant_method: modelopt``, ``ignore`` == ``exclude_modules``;
    ``kv_cache`` ``fp8`` adds ``kv_cache_scheme`` ``{"dynamic": false, "num_bits": 8, "type":
    "float"}``, the only KV-cache setting vLLM 0.26 reads from a build whose config.json has a
    ``quantization_config``, docs/formats.md §B.4).

    Raises:
        ValueError: unknown scheme or KV-cache type.
    """
    q = hf_quant_config(targets, ignore, producer or {}, scheme, kv_cache)["quantization"]
    algo = q["quant_algo"]
    out: dict = {}
    if algo == "MIXED_PRECISION":
        by_cfg: dict[tuple, list[str]] = {}
        for layer, cfg in q["quantized_layers"].items():
            by_cfg.setdefault(tuple(sorted(cfg.items())), []).append(layer)
        groups = {}
        for i, (key, layers) in enumerate(by_cfg.items()):
            cfg = dict(key)
            g = _group_config(cfg["quant_algo"], cfg.get("group_size"))
            g["targets"] = sorted(layers)
            groups[f"group_{i}"] = g
        out["config_groups"] = groups
        out["quantized_layers"] = q["quantized_layers"]
    elif algo in ("W4A16_NVFP4", "NVFP4"):
        out["config_groups"] = {"group_0": {**_group_config(algo, q["group_size"]), "targets": ["Linear"]}}
    out["ignore"] = q["exclude_modules"]
    out["quant_algo"] = algo
    if q["kv_cache_quant_algo"]:
        out["kv_cache_scheme"] = dict(_KV_SCHEMES[q["kv_cache_quant_algo"]])
    if producer:
        out["producer"] = dict(producer)
    out["quant_method"] = "modelopt"
    return out


def extra_files(targets: dict[str, str], ignore: list[str], scheme: str = "w4a16",
                producer: dict | None = None, kv_cache: str | None = None) -> dict[str, dict]:
    """``{"hf_quant_config.json": ...}``: the legacy file every engine still reads."""
    return {HF_QUANT_CONFIG: hf_quant_config(targets, ignore, producer or {}, scheme, kv_cache)}


def to_compressed_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors -> compressed-tensors names: ``weight`` (uint8) ->
    ``weight_packed`` (same bytes), ``weight_scale`` unchanged, ``weight_scale_2`` ->
    ``weight_global_scale = 1 / x`` (float32 [1]). Other tensors pass unchanged.
    (compressed-tensors ModelOptNvfp4Converter; vLLM ModelOptNvFp4W4A16LinearMethod docstring.)
    """
    out = {}
    packed = {n[: -len(".weight_scale_2")] for n in tensors if n.endswith(".weight_scale_2")}
    for name, t in tensors.items():
        mod = name.rsplit(".", 1)[0]
        if mod in packed and name.endswith(".weight"):
            out[mod + ".weight_packed"] = t
        elif name.endswith(".weight_scale_2"):
            out[mod + ".weight_global_scale"] = (1.0 / t.to(torch.float32)).reshape(1)
        else:
            out[name] = t
    return out


def from_compressed_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_compressed_tensors`: ``weight_packed`` -> ``weight``,
    ``weight_global_scale`` -> ``weight_scale_2 = 1 / x`` (float32, 0-dim)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            out[name[: -len("_packed")]] = t
        elif name.endswith(".weight_global_scale"):
            out[name[: -len("weight_global_scale")] + "weight_scale_2"] = (1.0 / t.to(torch.float32)).reshape(())
        else:
            out[name] = t
    return out
