"""KV cache held in bf16, fp8 e4m3 or NVFP4, the way serving engines store it.

The cache of :func:`kv_cache_factory` is a transformers ``DynamicCache`` whose ``update`` rounds every
new K/V entry through the storage format before keeping it, and returns the stored
(dequantized) history, so attention reads exactly what an engine would read back from its
KV pool. transformers 5.24 calls ``cache.update(k, v, layer)`` with post-RoPE keys for
MHA/GQA models, and with the MLA latent record itself for DeepSeek-V3 / GLM-5 style models
(``k`` = normalized ``kv_lora_rank`` latent, ``v`` = RoPE key), so MLA is quantized at the
latent, as engines store it, never at the expanded heads.

Formats (per layer, per token; ``s`` = the layer's per-tensor k or v scale, a dequant
multiplier; from the build's ``k_scale`` / ``v_scale`` when it has them, else 1.0 as vLLM
and SGLang default, or calibrated with :func:`calibrate_scales`):

- ``bf16``: round to bfloat16.
- ``fp8``: ``fp8_e4m3(clamp(x / s, +-448)) * s`` (vLLM ``quant_utils.cuh`` scale convention,
  saturating). MLA: latent and RoPE key share the k scale (vLLM's 576-byte fp8 record).
- ``nvfp4``: e2m1 codes, one e4m3 block scale per 16 values of a head vector, fp32 global
  ``1 / s`` (vLLM NVFP4 KV: ``global_scale = 1 / k_scale``), through
  :func:`quantize.kernels.nvfp4.quantize_nvfp4` / ``dequantize_nvfp4``. MLA: the latent in
  NVFP4 and the RoPE key in bf16 (no published NVFP4 MLA layout; FlashMLA's fp8 record keeps
  RoPE in bf16 the same way).
"""

import functools
import json
import math
from pathlib import Path

import torch

from quantize.archs import KV_DTYPES, kv_record_dims
from quantize.kernels.dtypes import E2M1_MAX, E4M3_MAX
from quantize.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4

__all__ = ["KV_DTYPES", "fp8_roundtrip", "nvfp4_roundtrip", "bf16_roundtrip", "kv_bytes_per_token",
           "scales_from_build", "calibrate_scales", "kv_cache_factory", "kl_by_length"]



def bf16_roundtrip(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x`` rounded to bfloat16 (``scale`` unused), in ``x``'s dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def fp8_roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-tensor fp8 e4m3 store and load: ``fp8(clamp(x / scale, -448, 448)) * scale``.

    Args:
        x: any shape, float. scale: positive dequant multiplier (vLLM ``k_scale``).

    Returns:
        tensor like ``x`` (same dtype) holding the values an engine reads back.
    """
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def nvfp4_roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """NVFP4 store and load along the last dim (a head vector or the MLA latent).

    Args:
        x: [..., D] with D a multiple of 16. scale: dequant multiplier ``s``; the
            quantize-direction global scale is ``1 / s``.

    Returns:
        tensor like ``x`` (same dtype): ``e2m1(code) * e4m3(block scale) * s`` per value.

    Raises:
        ValueError: D is not a multiple of 16 (from ``quantize_nvfp4``).
    """
    flat = x.float().reshape(-1, x.shape[-1])
    g = torch.tensor([1.0 / scale], dtype=torch.float32, device=x.device)
    packed, block = quantize_nvfp4(flat, g)
    return dequantize_nvfp4(packed, block, g).reshape(x.shape).to(x.dtype)


_ROUNDTRIP = {"bf16": bf16_roundtrip, "fp8": fp8_roundtrip, "nvfp4": nvfp4_roundtrip}


def kv_bytes_per_token(config: dict, dtype: str) -> dict:
    """Bytes one token occupies in the KV pool for ``dtype`` (scales per layer not counted).

    MHA/GQA per layer: bf16 ``2 H D 2``, fp8 ``2 H D``, nvfp4 ``2 H (D/2 + D/16)``.
    MLA per layer (latent L, RoPE R): bf16 ``2 (L + R)``, fp8 ``L + R``,
    nvfp4 ``L/2 + L/16 + 2 R`` (docs/eval.md §4.5, §6.2).

    Returns:
        ``{"per_layer": int, "layers": int, "total": int, "record": <kv_record_dims>}``.
    """
    rec = kv_record_dims(config)
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {dtype!r}; choose from {', '.join(KV_DTYPES)}")

    if rec["kind"] == "mla":
        # vLLM's record (per-tensor fp8 latent + RoPE under one scale), not FlashMLA's tiled
        # one that quantize.archs.kvcache.mla_record plans for; NVFP4 keeps the RoPE key in bf16
        L, R = rec["latent"], rec["rope"]
        per = {"bf16": 2 * (L + R), "fp8": L + R, "nvfp4": L // 2 + L // 16 + 2 * R}[dtype]
    else:
        from quantize.archs.kvcache import KVDtype, gqa_record

        per = int(gqa_record(rec["kv_heads"], rec["head_dim"], KVDtype(dtype)).nbytes)
    return {"per_layer": per, "layers": rec["layers"], "total": per * rec["layers"], "record": rec}


def scales_from_build(folder: str | Path) -> dict[int, tuple[float, float]]:
    """Per-layer ``(k_scale, v_scale)`` dequant multipliers stored in a build; {} if none.

    Names are read through the architecture map (:func:`quantize.archs.kv_scale_of`), so every
    layout and prefix counts: compressed-tensors ``<attn>.k_scale`` (``kv_cache_scheme``),
    ModelOpt ``<attn>.k_proj.k_scale``, under ``model.layers.N``, ``model.language_model.layers.N``
    (multimodal builds) or any other prefix. A layer with only one of the two takes 1.0 for the
    other (the engines' default).

    Raises:
        ValueError: a scale that is not one finite value > 0 (0 or NaN collapses the cache), or
            two tensors giving one layer's k (or v) scale different values (both named).
    """
    from safetensors import safe_open

    from quantize.archs import kv_scale_of

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    names = (json.loads(index.read_text())["weight_map"] if index.exists()
             else {n: f.name for f in sorted(folder.glob("*.safetensors"))
                   for n in safe_open(str(f), "pt").keys()})
    found: dict[int, dict[str, tuple[float, str]]] = {}
    for name, shard in sorted(names.items()):
        kv = kv_scale_of(name)
        if kv is None:
            continue
        with safe_open(str(folder / shard), "pt") as f:
            t = f.get_tensor(name).float().reshape(-1)
        if t.numel() != 1 or not (math.isfinite(float(t[0])) and float(t[0]) > 0):
            raise ValueError(f"{name} ({shard}): a KV-cache scale must be one finite value > 0, got "
                             f"{t.tolist()[:4]}{' ...' if t.numel() > 4 else ''}")
        value, key = float(t[0]), f"{kv.kv}_scale"
        prev = found.setdefault(kv.layer, {}).get(key)
        if prev is not None and prev[0] != value:
            raise ValueError(f"layer {kv.layer} has two {key}s: {prev[1]} = {prev[0]} and {name} = {value}")
        found[kv.layer][key] = (value, name)
    return {i: (d["k_scale"][0] if "k_scale" in d else 1.0, d["v_scale"][0] if "v_scale" in d else 1.0)
            for i, d in sorted(found.items())}


@functools.cache
def _cache_class():
    """The cache class, built on first use so that importing this module does not import
    transformers."""
    from transformers import DynamicCache

    class _QuantizedKVCache(DynamicCache):
        """DynamicCache storing each new K/V entry through ``k_fn`` / ``v_fn(x, layer)``."""

        def __init__(self, config, k_fn, v_fn):
            super().__init__(config=config)
            self._k_fn, self._v_fn = k_fn, v_fn

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(self._k_fn(key_states, layer_idx),
                                  self._v_fn(value_states, layer_idx), layer_idx, *args, **kwargs)

    return _QuantizedKVCache


def kv_cache_factory(model_config, dtype: str, scales: dict[int, tuple[float, float]] | None = None):
    """Zero-argument callable returning a fresh cache that stores K/V in ``dtype``.

    Args:
        model_config: the transformers ``PretrainedConfig`` of the model.
        dtype: one of :data:`KV_DTYPES`.
        scales: per-layer ``(k_scale, v_scale)`` dequant multipliers; layers not listed use
            1.0 (the engines' default when a checkpoint has none).

    Returns:
        ``() -> DynamicCache`` subclass instance, for ``model(..., cache=c, use_cache=True)``
        or ``model.generate(..., cache=c)``.

    Raises:
        ValueError: unknown dtype.
    """
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {dtype!r}; choose from {', '.join(KV_DTYPES)}")
    rec = kv_record_dims(model_config.to_dict())
    scales = dict(scales or {})
    store = _ROUNDTRIP[dtype]
    # MLA: "k" is the latent, "v" the RoPE key; both use the layer's k scale (one record).
    rope_store = bf16_roundtrip if (rec["kind"] == "mla" and dtype == "nvfp4") else store
    v_index = 0 if rec["kind"] == "mla" else 1

    def k_fn(x, layer):
        return store(x, scales.get(layer, (1.0, 1.0))[0])

    def v_fn(x, layer):
        return (rope_store if rec["kind"] == "mla" else store)(x, scales.get(layer, (1.0, 1.0))[v_index])

    cls = _cache_class()
    return lambda: cls(model_config, k_fn, v_fn)


@torch.no_grad()
def calibrate_scales(model, batches: list[torch.Tensor], dtype: str) -> dict[int, tuple[float, float]]:
    """Per-layer scales from the amax of K and V over ``batches`` of input ids.

    fp8: ``amax / 448`` (ModelOpt ``amax_to_fp8_scaling_factor``); nvfp4: ``amax / (6 * 448)``
    (ModelOpt NVFP4 ``amax / 2688``); bf16: 1.0. MLA layers take the amax of the whole record.

    Args:
        model: causal LM. batches: int64 [1, L] tensors (e.g. :func:`eval.kl.token_windows`).

    Returns:
        ``{layer: (k_scale, v_scale)}``.
    """
    amax: dict[int, list[float]] = {}

    def record(i):
        def fn(x, layer):
            a = amax.setdefault(layer, [0.0, 0.0])
            a[i] = max(a[i], float(x.detach().abs().amax()))
            return x
        return fn

    cls = _cache_class()
    device = next(model.parameters()).device
    for ids in batches:
        model(input_ids=ids.to(device), cache=cls(model.config, record(0), record(1)), use_cache=True)
    div = {"fp8": E4M3_MAX, "nvfp4": E4M3_MAX * E2M1_MAX, "bf16": None}[dtype]
    mla = kv_record_dims(model.config.to_dict())["kind"] == "mla"
    out = {}
    for layer, (ka, va) in amax.items():
        if div is None:
            out[layer] = (1.0, 1.0)
        elif mla:
            s = max(ka, va if dtype == "fp8" else 0.0) / div or 1.0
            out[layer] = (s, s)
        else:
            out[layer] = (ka / div or 1.0, va / div or 1.0)
    return out


@torch.no_grad()
def kl_by_length(model, tokenizer, texts: list[str], lengths: list[int], ref_cache, test_cache,
                 chunk: int = 1024) -> list[dict]:
    """KL(ref cache || test cache) of one model, per context length (docs/eval.md §7).

    One window of the first ``max(lengths) + 1`` ids of the text stream (joined with ``"\\n\\n"``,
    no special tokens, as :func:`eval.kl.token_windows`) runs through the model twice, with a
    fresh cache from each factory. The next-token prediction at position p has p + 1 tokens of
    context; the bucket of length ``L`` holds the predictions whose context is longer than the
    previous length and at most ``L`` (the first bucket starts at one token), ``L - previous``
    predictions. So each length
    is scored on its own tokens and a loss that grows with context cannot average away.

    Args:
        model: causal LM in eval mode. tokenizer: ``encode(text, add_special_tokens=False)``.
        texts: evaluation texts. lengths: context lengths in tokens, each >= 2.
        ref_cache, test_cache: zero-argument cache factories (:func:`kv_cache_factory`).
        chunk: positions per float64 log-softmax (bounds host memory at long context).

    Returns:
        ``[{"length": L, "from": first context length in the bucket, "mean_kl": nats/token,
        "top1_agree": 0..1, "tokens": predictions scored}]`` in ascending ``length``.

    Raises:
        ValueError: a length < 2, or the texts give at most ``max(lengths)`` tokens.
    """
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < 2:
        raise ValueError(f"KV-parity KL lengths must be token counts >= 2, got {lengths}")
    ids = list(tokenizer.encode("\n\n".join(texts), add_special_tokens=False))[:lengths[-1] + 1]
    if len(ids) <= lengths[-1]:
        raise ValueError(f"the KL texts give {len(ids)} tokens; KV parity at {lengths[-1]} tokens of "
                         f"context needs {lengths[-1] + 1}")
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    ref = model(input_ids=x, cache=ref_cache(), use_cache=True).logits[0, :-1]
    test = model(input_ids=x, cache=test_cache(), use_cache=True).logits[0, :-1]
    kl = torch.empty(ref.shape[0], dtype=torch.float64)
    agree = torch.empty(ref.shape[0], dtype=torch.bool)
    for a in range(0, ref.shape[0], chunk):
        lr = torch.log_softmax(ref[a:a + chunk].to(torch.float64), dim=-1)
        lt = torch.log_softmax(test[a:a + chunk].to(torch.float64), dim=-1)
        kl[a:a + chunk] = (lr.exp() * (lr - lt)).sum(-1).cpu()
        agree[a:a + chunk] = (lr.argmax(-1) == lt.argmax(-1)).cpu()
    out, prev = [], 0
    for n in lengths:  # prediction p has p + 1 tokens of context: (prev, n] is p in [prev, n)
        out.append({"length": n, "from": prev + 1, "mean_kl": float(kl[prev:n].mean()),
                    "top1_agree": float(agree[prev:n].double().mean()), "tokens": n - prev})
        prev = n
    return out
