"""Load the two sides of an accuracy comparison as transformers causal LMs on CPU.

- :func:`load_source_model`: the *reference*, an FP8 (or dense) source folder dequantized
  by our own reader (:func:`formats.sources.open_source`). transformers is given the config
  without ``quantization_config``, so it never tries its FP8 GPU path.
- :func:`load_build_model`: an NVFP4 ``nvfp4-pack-quantized`` build, decompressed by
  transformers + compressed-tensors themselves (what a user of the build gets).
- :func:`load_modelopt_build`: a ModelOpt NVFP4 build, dequantized by our own kernel
  (transformers has no ModelOpt loader).
- :func:`load_model`: whichever of the three a folder's ``quantization_config`` calls for.
- :func:`dequantized_reference_state`: the same build dequantized by our own kernel, to check
  that transformers' decompression agrees with ours.
- :func:`dequantized_build_state` / :func:`load_dense_state`: a whole build (either format,
  NVFP4 / FP8 block / MXFP8 modules) dequantized by our own kernels, and a dense on-disk state
  loaded into the transformers class through transformers' own conversion mapping (routed
  experts stacked into ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]).
  MoE models (sources and builds) load this way: compressed-tensors' ``dequantize=True``
  (transformers 5.24, compressed-tensors 0.20.1) multiplies fused expert weights by their
  global scale instead of dividing (values near 2688x), and the plain ``load_state_dict`` of
  per-expert names does not fit the fused parameters (docs/formats.md §L.2).

Heavy imports (transformers, safetensors) happen inside the functions.
"""

import json
import re
import warnings
from pathlib import Path

import torch

from formats.sources import open_source
from quantize import archs
from quantize.kernels.fp8 import dequantize_fp8_block
from quantize.kernels.mxfp8 import dequantize_mxfp8
from quantize.kernels.nvfp4 import dequantize_nvfp4

__all__ = ["load_source_model", "load_build_model", "load_modelopt_build", "load_model",
           "dequantized_reference_state", "source_dense_state", "build_dense_state", "load_dense_model",
           "dequantized_build_state", "load_dense_state", "is_moe"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ANY_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")
_NVFP4 = (".weight_packed", ".weight_scale", ".weight_global_scale")
_NOT_WEIGHTS = (".input_scale", ".input_global_scale", ".k_scale", ".v_scale")
"""Activation and KV-cache scales: not weights, dropped from a dense state."""


def _is_mtp(name: str, n_layers: int) -> bool:
    """``model.layers.{n_layers + k}.*``: DeepSeek/GLM multi-token-prediction layers."""
    m = _LAYER.match(name)
    return bool(m) and int(m.group(1)) >= n_layers


def load_source_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """Reference model of a source checkpoint (block FP8, compressed-tensors FP8 or dense).

    The model is built with ``AutoModelForCausalLM.from_config`` from ``config.json`` minus
    ``quantization_config`` (top level and ``text_config``), then every parameter is filled
    from :meth:`Source.read` (FP8 weights dequantized to float32 with their scales, other
    tensors as stored), cast to ``dtype``. Skipped on disk: MTP layers
    ``model.layers.{num_hidden_layers + k}.*`` (transformers does not model them) and
    ``lm_head.weight`` when ``tie_word_embeddings`` (the tied head reads embed_tokens, as
    the converter and transformers do).

    Args:
        folder: source folder (config.json, safetensors shards, index).
        dtype: parameter dtype of the returned model.

    Returns:
        ``PreTrainedModel`` in eval mode on CPU.

    Raises:
        SourceError: from :func:`open_source` (bad layout, unreadable tensor).
        RuntimeError: missing parameters (none on disk), unexpected tensors (on disk, not in
            the model) or shape mismatches, all listed together.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    src = open_source(folder)
    if is_moe(src.config):  # fused experts: through transformers' conversion mapping
        try:
            config = src.config
            state = {n: src.read(n) for n in sorted(src.tensors)}
        finally:
            src.close()
        return load_dense_state(state, config, dtype, Path(folder).name)
    try:
        cfg_dict = json.loads(json.dumps(src.config))  # deep copy
        cfg_dict.pop("quantization_config", None)
        archs.text_config(cfg_dict).pop("quantization_config", None)
        cfg = AutoConfig.for_model(**cfg_dict)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.eval()
        tied = bool(archs.text_config(cfg_dict).get("tie_word_embeddings", cfg_dict.get("tie_word_embeddings", False)))
        n_layers = int(archs.text_config(cfg_dict)["num_hidden_layers"])
        targets = model.state_dict(keep_vars=True)
        filled, unexpected, bad_shape = set(), [], []
        with torch.no_grad():
            for name in sorted(src.tensors):
                if _is_mtp(name, n_layers) or (tied and name == "lm_head.weight"):
                    continue
                if name not in targets:
                    unexpected.append(name)
                    continue
                t = src.read(name)
                if tuple(t.shape) != tuple(targets[name].shape):
                    bad_shape.append(f"{name}: disk {list(t.shape)} vs model {list(targets[name].shape)}")
                    continue
                targets[name].copy_(t.to(dtype))
                filled.add(name)
    finally:
        src.close()
    if tied:
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out_emb is not None and out_emb.weight is not in_emb.weight:
            model.tie_weights()
        if out_emb is not None and out_emb.weight is in_emb.weight:
            filled |= {k for k, v in targets.items() if v is out_emb.weight}
    missing = sorted(set(targets) - filled)
    if missing or unexpected or bad_shape:
        lines = ([f"missing (in model, not on disk): {n}" for n in missing]
                 + [f"unexpected (on disk, not in model): {n}" for n in unexpected]
                 + [f"shape mismatch {s}" for s in bad_shape])
        raise RuntimeError(f"{len(lines)} problem(s) loading {Path(folder).name} into "
                           f"{type(model).__name__}:\n  " + "\n  ".join(lines))
    return model


def load_build_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                     trust_remote_code: bool = False):
    """An NVFP4 compressed-tensors build, decompressed to ``dtype`` by transformers on CPU.

    Calls ``AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
    quantization_config=CompressedTensorsConfig(dequantize=True))``: transformers merges
    ``dequantize=True`` into the checkpoint's own quantization config (its "loading
    attributes" warning is silenced) and dequantizes every ``weight_packed / weight_scale /
    weight_global_scale`` triple into a plain ``.weight`` while loading, so the result is an
    ordinary dense model with ``nn.Linear`` weights.

    MoE builds (routed experts in the config) are instead dequantized by our own kernels
    (:func:`dequantized_build_state`) and loaded with :func:`load_dense_state`:
    ``dequantize=True`` multiplies fused expert weights by their global scale (2688 / amax)
    where it must divide, so their weights come out ~2688 / amax**2 times too large.

    Precision (transformers 5.24, compressed-tensors 0.20.1): ``NVFP4PackedCompressor``
    decompresses through bfloat16, so each weight equals
    ``bf16(dequantize_nvfp4(...))`` exactly, then cast to ``dtype``; compare against
    ``dequantized_reference_state(folder, weight_dtype=torch.bfloat16)``.

    A plain ``from_pretrained(folder, dtype=torch.float32)`` is not usable on CPU: it keeps
    the packed tensors and decompresses on the first forward pass into bfloat16 weights,
    and that forward then fails with "expected m1 and m2 to have the same dtype".

    Args:
        folder: build folder with a compressed-tensors ``quantization_config``.
        dtype: parameter dtype of the returned model.
        trust_remote_code: let transformers import custom modeling code carried in the
            build (``auto_map``); off by default, so custom code is never executed.
        device: where the decompressed model is moved after loading on CPU (``"cpu"``
            default, or ``"cuda"``).

    Returns:
        ``PreTrainedModel`` in eval mode on ``device``.
    """
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    config = json.loads((Path(folder) / "config.json").read_text())
    if is_moe(config):  # dequantize=True scales fused experts wrongly: our own dequantization
        return load_dense_state(dequantized_build_state(folder), config, dtype,
                                Path(folder).name).to(device).eval()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True),
            trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def dequantized_reference_state(folder: str | Path,
                                weight_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """State dict of an NVFP4 build dequantized with our own kernel.

    Each ``<m>.weight_packed`` (uint8 [N, K/2]), ``<m>.weight_scale`` (float8_e4m3fn
    [N, K/16]) and ``<m>.weight_global_scale`` (float32 [1], quantize direction) becomes
    ``<m>.weight`` [N, K] via :func:`quantize.kernels.nvfp4.dequantize_nvfp4` (exact float32),
    cast to ``weight_dtype``; every other tensor is returned as stored (dtype unchanged).
    Tied ``lm_head.weight`` is not added.

    Args:
        folder: build folder with ``*.safetensors`` shards.
        weight_dtype: dtype of the dequantized weights. ``torch.bfloat16`` reproduces what
            :func:`load_build_model` gets from compressed-tensors, bit for bit.

    Returns:
        dict name -> tensor, on CPU.

    Raises:
        RuntimeError: an NVFP4 triple is incomplete (one or two of the three tensors), or
            the folder has no safetensors files.
    """
    return _dequantize_nvfp4_state(_read_shards(Path(folder)), weight_dtype)


def _dequantize_nvfp4_state(raw: dict[str, torch.Tensor],
                            weight_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """:func:`dequantized_reference_state` of tensors already in memory (compressed-tensors
    names)."""
    state, groups = {}, {}
    for name, t in raw.items():
        suffix = next((s for s in _NVFP4 if name.endswith(s)), None)
        if suffix is None:
            state[name] = t
        else:
            groups.setdefault(name[: -len(suffix)], {})[suffix] = t
    incomplete = sorted(m for m, g in groups.items() if len(g) != 3)
    if incomplete:
        raise RuntimeError(f"incomplete NVFP4 tensors (need {', '.join(_NVFP4)}) for: "
                           + ", ".join(incomplete[:10]))
    for m, g in groups.items():
        state[m + ".weight"] = dequantize_nvfp4(g[".weight_packed"], g[".weight_scale"],
                                                g[".weight_global_scale"]).to(weight_dtype)
    return state


def source_dense_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every logical tensor of a source (FP8 dequantized to float32 by our reader, others as
    stored), under its on-disk name."""
    src = open_source(folder)
    try:
        return {n: src.read(n) for n in sorted(src.tensors)}
    finally:
        src.close()


def build_dense_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """A build decompressed by compressed-tensors' own compressors, module by module
    (``BaseCompressor.get_value_from_registry(format).decompress``, as transformers'
    ``CompressedTensorsDequantize`` does), under on-disk names. ModelOpt builds are first
    renamed to compressed-tensors names with reciprocal scalars
    (``formats.modelopt.to_compressed_tensors``), so the same reference decoder reads both.

    Quantized weights come back as bfloat16 (compressed-tensors decompresses through bf16).
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    from formats import modelopt

    folder = Path(folder)
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        raw.update(load_file(str(shard)))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    if qc["quant_method"] == "modelopt":
        raw = modelopt.to_compressed_tensors(raw)
    schemes = {"nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"), "fp8-block": ("FP8_BLOCK", "float-quantized"),
               "mxfp8": ("MXFP8A16", "mxfp8-quantized")}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    state = {}
    for name, t in raw.items():
        mod, local = name.rsplit(".", 1) if "." in name else ("", name)
        if local in ("weight", "weight_packed", "weight_scale", "weight_global_scale"):
            modules.setdefault(mod, {})[local] = t
        else:
            state[name] = t
    for mod, t in modules.items():
        if "weight_scale" not in t:
            state[f"{mod}.weight"] = t["weight"]
            continue
        kind = "nvfp4" if "weight_packed" in t else "mxfp8" if t["weight_scale"].dtype == torch.uint8 else "fp8-block"
        preset, fmt = schemes[kind]
        scheme = preset_name_to_scheme(preset, ["Linear"])
        local = dict(t)
        if kind == "nvfp4":
            local["weight_shape"] = torch.tensor([t["weight_packed"].shape[0], t["weight_packed"].shape[1] * 2])
        out = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)
        state[f"{mod}.weight"] = out["weight"]
    return state


def load_dense_model(state: dict[str, torch.Tensor], config: dict, dtype: torch.dtype = torch.float32):
    """Instantiate ``config``'s architecture from a dense state dict with on-disk names.

    The state is written to a temporary folder (one safetensors file, config without
    ``quantization_config``) and loaded with the ``architectures[0]`` class's
    ``from_pretrained``, so transformers' own conversion mapping turns the on-disk layout
    (per-expert 2-D experts, GLM-5.3 KDA names) into its modules.

    Raises:
        RuntimeError: the model has parameters the state does not provide.
    """
    import tempfile

    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = json.loads(json.dumps(config))
    cfg.pop("quantization_config", None)
    archs.text_config(cfg).pop("quantization_config", None)
    cls = getattr(transformers, cfg["architectures"][0])
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.contiguous().to(dtype) for k, v in state.items()}, f"{tmp}/model.safetensors")
        AutoConfig.for_model(**cfg).save_pretrained(tmp)
        model, info = cls.from_pretrained(tmp, dtype=dtype, output_loading_info=True)
    if info["missing_keys"]:
        raise RuntimeError(f"parameters missing from the state: {sorted(info['missing_keys'])[:10]}")
    return model.eval()


def is_moe(config: dict) -> bool:
    """True when the (text) config declares routed experts (``archs.num_routed_experts``)."""
    return archs.num_routed_experts(config) is not None


def _read_shards(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    shards = sorted(Path(folder).glob("*.safetensors"))
    if not shards:
        raise RuntimeError(f"{folder} has no .safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for shard in shards:
        raw.update(load_file(str(shard)))
    return raw


def dequantized_build_state(folder: str | Path,
                            weight_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every weight of a build (compressed-tensors or ModelOpt) dequantized by our own kernels,
    under on-disk names, for a dense reference.

    - NVFP4 (``weight_packed`` / ``weight_scale`` / ``weight_global_scale``; ModelOpt ``weight``
      uint8 + ``weight_scale_2``, renamed by ``formats.modelopt.to_compressed_tensors``):
      :func:`quantize.kernels.nvfp4.dequantize_nvfp4`.
    - FP8 block (``weight`` float8_e4m3fn + float ``weight_scale`` [ceil(N/128), ceil(K/128)],
      multiplier): :func:`quantize.kernels.fp8.dequantize_fp8_block`.
    - MXFP8 (``weight`` float8_e4m3fn + uint8 e8m0 ``weight_scale`` [N, K/32]):
      :func:`quantize.kernels.mxfp8.dequantize_mxfp8`.

    Dequantized weights are exact in float32, then cast to ``weight_dtype``; other tensors keep
    their stored dtype. Activation and KV-cache scales (``input_scale``, ``input_global_scale``,
    ``k_scale``, ``v_scale``) are dropped. Per-expert weights stay per expert (on-disk names).

    Raises:
        RuntimeError: no shards; an incomplete NVFP4 triple; an FP8 weight without its
            ``weight_scale`` or with a scale of the wrong shape (the tensor is named).
    """
    folder = Path(folder)
    raw = _read_shards(folder)
    if _quant_method(folder) == "modelopt" or str(_quant_method(folder)).startswith("modelopt"):
        from formats import modelopt

        raw = modelopt.to_compressed_tensors(raw)
    raw = {n: t for n, t in raw.items() if not n.endswith(_NOT_WEIGHTS)}
    fp8 = {n[: -len(".weight")] for n, t in raw.items()
           if n.endswith(".weight") and t.dtype == torch.float8_e4m3fn}
    rest = {n: t for n, t in raw.items() if n.rsplit(".", 1)[0] not in fp8
            or not n.endswith((".weight", ".weight_scale"))}
    state = _dequantize_nvfp4_state(rest, weight_dtype)
    for m in sorted(fp8):
        w, sc = raw[m + ".weight"], raw.get(m + ".weight_scale")
        if sc is None:
            raise RuntimeError(f"{m}.weight is float8_e4m3fn without {m}.weight_scale")
        n, k = w.shape
        if sc.dtype == torch.uint8:
            if tuple(sc.shape) != (n, k // 32):
                raise RuntimeError(f"{m}.weight_scale is {list(sc.shape)}, MXFP8 needs [{n}, {k // 32}]")
            state[m + ".weight"] = dequantize_mxfp8(w, sc).to(weight_dtype)
        else:
            if tuple(sc.shape) != (-(-n // 128), -(-k // 128)):
                raise RuntimeError(f"{m}.weight_scale is {list(sc.shape)}, FP8 block 128x128 needs "
                                   f"[{-(-n // 128)}, {-(-k // 128)}]")
            state[m + ".weight"] = dequantize_fp8_block(w, sc.to(torch.float32), (128, 128)).to(weight_dtype)
    return state


def load_dense_state(state: dict[str, torch.Tensor], config: dict, dtype: torch.dtype = torch.float32,
                     name: str = "state"):
    """Load a dense state with on-disk names into ``config``'s transformers causal LM, in
    memory, through transformers' own conversion mapping (``from_pretrained(None,
    state_dict=...)``): per-expert ``experts.<e>.{gate,up,down}_proj.weight`` become the fused
    ``experts.gate_up_proj`` [E, 2I, H] (gate rows then up rows) and ``experts.down_proj``
    [E, H, I] (``archs.FUSED_EXPERT_PARAMS``), GLM-5.3 KDA names are renamed.

    Skipped: MTP layers (``layers.{num_hidden_layers + k}.*``, transformers does not model
    them) and ``lm_head.weight`` when ``tie_word_embeddings``. The config is used without
    ``quantization_config``. Tensors are cast to ``dtype``.

    Returns:
        ``PreTrainedModel`` in eval mode on CPU.

    Raises:
        RuntimeError: parameters missing, unexpected tensors or shape mismatches, listed
            together (``N problem(s) loading <name> into <class>``).
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cfg = json.loads(json.dumps(config))
    cfg.pop("quantization_config", None)
    text = archs.text_config(cfg)
    text.pop("quantization_config", None)
    mtp = set(archs.mtp_layer_indices(cfg))
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    keep = {}
    for n, t in state.items():
        m = _ANY_LAYER.match(n)
        if (m and int(m.group(1)) in mtp) or (tied and n == "lm_head.weight"):
            continue
        keep[n] = t.to(dtype)
    hf_cfg = AutoConfig.for_model(**cfg)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_cfg)]  # the class from_config would build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = cls.from_pretrained(None, config=hf_cfg, state_dict=keep, dtype=dtype,
                                          output_loading_info=True)
    lines = ([f"missing (in model, not on disk): {n}" for n in sorted(info["missing_keys"])]
             + [f"unexpected (on disk, not in model): {n}" for n in sorted(info["unexpected_keys"])]
             + [f"shape mismatch {m}" for m in sorted(map(str, info["mismatched_keys"]))])
    if info.get("conversion_errors"):
        lines += [f"conversion error {k}: {v}" for k, v in sorted(info["conversion_errors"].items())]
    if lines:
        raise RuntimeError(f"{len(lines)} problem(s) loading {name} into {type(model).__name__}:\n  "
                           + "\n  ".join(lines))
    return model.eval()


def _quant_method(folder: Path) -> str | None:
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.get("quantization_config") or archs.text_config(cfg).get("quantization_config") or {}
    if not qc and (folder / "hf_quant_config.json").exists():
        return "modelopt"
    return qc.get("quant_method")


def load_modelopt_build(folder: str | Path, dtype: torch.dtype = torch.float32):
    """A ModelOpt NVFP4 build (``quant_method: modelopt`` / ``hf_quant_config.json``) on CPU.

    Each quantized Linear ``<m>`` stores ``<m>.weight`` (uint8 [N, K/2], packed e2m1),
    ``<m>.weight_scale`` (float8_e4m3fn [N, K/16]) and ``<m>.weight_scale_2`` (float32 scalar,
    dequant direction amax / 2688) (docs/formats.md §B.2.1); it is dequantized with
    :func:`quantize.kernels.nvfp4.dequantize_nvfp4` against global ``1 / weight_scale_2``.
    ``input_scale``, ``k_scale`` and ``v_scale`` are not weights and are skipped. The model is
    built from ``config.json`` minus ``quantization_config``.

    Raises:
        RuntimeError: a packed weight without its two scales, or tensors that do not fit the
            model (missing, unexpected, shape), listed together.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from formats import modelopt

    folder = Path(folder)
    cfg_dict = json.loads((folder / "config.json").read_text())
    if is_moe(cfg_dict):  # per-expert weights into the fused expert parameters
        return load_dense_state(dequantized_build_state(folder, dtype), cfg_dict, dtype, folder.name)
    cfg_dict.pop("quantization_config", None)
    archs.text_config(cfg_dict).pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg_dict), dtype=dtype).eval()
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        raw.update(load_file(str(shard)))
    packed = {n[: -len(".weight")] for n, t in raw.items() if n.endswith(".weight") and t.dtype == torch.uint8}
    whole = {m for m in packed if f"{m}.weight_scale" in raw and f"{m}.weight_scale_2" in raw}
    problems = [f"packed {m}.weight without {m}.weight_scale / .weight_scale_2"
                for m in sorted(packed - whole)]
    weights = {}
    for n, t in raw.items():
        if n.endswith((".input_scale", ".k_scale", ".v_scale")):
            continue  # activation and KV-cache scales are not weights
        if n.rsplit(".", 1)[0] in packed:
            if n.rsplit(".", 1)[0] in whole:  # the NVFP4 triple, dequantized below
                weights[n] = t
        elif not n.endswith((".weight_scale", ".weight_scale_2")):
            weights[n] = t
    state = {n: t.to(dtype) for n, t in _dequantize_nvfp4_state(
        modelopt.to_compressed_tensors(weights), dtype).items()}
    result = model.load_state_dict(state, strict=False)
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    problems += [f"missing (in model, not on disk): {k}" for k in missing]
    problems += [f"unexpected (on disk, not in model): {k}" for k in result.unexpected_keys]
    if problems:
        raise RuntimeError(f"{len(problems)} problem(s) loading ModelOpt build {folder.name}:\n  "
                           + "\n  ".join(problems))
    return model


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load a source or a build for evaluation, by its ``quantization_config.quant_method``:
    ``compressed-tensors`` -> :func:`load_build_model`, ``modelopt*`` (or an
    ``hf_quant_config.json``) -> :func:`load_modelopt_build`, anything else (block FP8,
    dense) -> :func:`load_source_model`. Returns the model in eval mode on ``device``."""
    method = _quant_method(Path(folder)) or ""
    if method == "compressed-tensors":
        return load_build_model(folder, dtype, device).eval()
    if method.startswith("modelopt"):
        return load_modelopt_build(folder, dtype).to(device).eval()
    return load_source_model(folder, dtype).to(device).eval()
