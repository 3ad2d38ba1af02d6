"""What calibration statistics contribute to a build: input global scales (W4A4), FP8 KV
scales, channel weights for the activation-weighted scale search, and the manifest record.

Pure planning over the decisions and a :class:`formats.calib_stats.CalibStats`; the numbers
come from ``quantize.kernels.act_scales``, the tensor names from the output writer.
"""

from types import ModuleType

import torch

from formats.calib_stats import CalibStats
from formats.sources import Source
from quantize import archs
from quantize.base.errors import CalibrationError
from quantize.kernels.act_scales import fp8_kv_scale_from_amax
from quantize.plan.recipe import Target
from quantize.plan.tensors import Decision, kv_scale_anchor, module_of

__all__ = ["input_amax_plan", "kv_scale_dtype", "kv_scale_tensors", "calibration_record"]


def input_amax_plan(decisions: dict[str, Decision], stats: CalibStats, min_tokens: int) -> dict[str, float]:
    """Input amax of every NVFP4 module, shared (max) across its fused group, with the
    expert fallback of :meth:`CalibStats.input_amax_for` for under-calibrated experts.

    Returns:
        module name -> amax (float >= 0).

    Raises:
        CalibrationError: listing every NVFP4 module without statistics (e.g. an MTP layer,
            which layer-streamed calibration does not run), with the fix.
    """
    own: dict[str, float | None] = {}
    for name, d in decisions.items():
        if d.target is Target.NVFP4:
            own[module_of(name)] = stats.input_amax_for(module_of(name), min_tokens)
    missing = sorted(m for m, a in own.items() if a is None)
    if missing:
        raise CalibrationError(
            f"W4A4 needs an input scale for every NVFP4 module; {len(missing)} have no calibration "
            f"statistics: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Recalibrate "
            "from this source, or keep those modules out of NVFP4 with a recipe rule "
            "(MTP layers are not calibrated: match them with target 'bf16').", tensor=missing[0] + ".weight")
    out = {}
    for name, d in decisions.items():
        if d.target is Target.NVFP4:
            mod = module_of(name)
            members = d.members or (mod,)
            out[mod] = max(own[m] for m in members if m in own)
    return out


def kv_scale_dtype(config: dict) -> torch.dtype:
    """dtype of the FP8 KV scales (compressed-tensors stores them in the attention module's
    dtype): the checkpoint's declared ``torch_dtype`` / ``dtype``, bfloat16 by default."""
    cfg = archs.text_config(config)
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return {"float32": torch.float32, "float16": torch.float16}.get(name, torch.bfloat16)


def kv_scale_tensors(source: Source, stats: CalibStats, writer: ModuleType,
                     dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    """FP8 KV scales keyed by the logical tensor whose output shard carries them
    (:func:`quantize.plan.tensors.kv_scale_anchor`, so ``predict_outputs`` names the same place):
    each attention block's ``k_scale`` / ``v_scale`` (amax / 448). For MLA layers both
    scales are the latent record's amax (vLLM MLAAttention quantizes the whole latent with
    ``k_scale``).

    Raises:
        CalibrationError: a calibrated attention block has no tensors in the source.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    modules = {module_of(n) for n in source.tensors}
    for attn, rec in sorted(stats.kv_amax.items()):
        anchor = kv_scale_anchor(source, attn)
        if anchor is None:
            raise CalibrationError(f"calibration stats name attention block {attn}, which the source "
                                   "does not have: stats from another model?", key=attn)
        k, v = float(rec["k"]), float(rec["v"])
        if rec.get("mla") or archs.is_mla_attention(attn, modules):
            k = v = max(k, v)
        out.setdefault(anchor, {}).update(
            writer.emit_kv_scales(attn, fp8_kv_scale_from_amax(k), fp8_kv_scale_from_amax(v), dtype))
    return out


def calibration_record(stats: CalibStats, stats_sha256: str, min_tokens: int) -> dict:
    """Manifest entry: where the statistics came from and every expert that got the
    fallback input scale (FC-13)."""
    meta = {k: v for k, v in stats.meta.items() if k != "row_ids"}
    return {"stats_sha256": stats_sha256, "meta": meta, "min_expert_tokens": min_tokens,
            "expert_fallback": "max input amax over the layer's calibrated experts, per projection",
            "uncalibrated_experts": [u.render() for u in stats.uncovered_experts(min_tokens)]}
