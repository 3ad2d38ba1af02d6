"""Build check for calibrated scales: W4A4 input scales and FP8 KV scales.

Rules (a compressed-tensors build; each finding names the module or tensor):
- W4A4 (an NVFP4 config group with ``input_activations``): every module with ``weight_packed`` has
  an ``input_global_scale`` - a routed expert without one would make the engine's MoE
  kernel read garbage for that expert (vLLM loads ``w13_input_global_scale`` [E, 2] for
  every expert) - and the members of a fused group (``archs.fused_group_of``) have equal
  input scales (vLLM takes the max and warns, which mis-scales the others).
- A weight-only build carries no ``input_global_scale``.
- ``kv_cache_scheme`` set: ``k_scale`` and ``v_scale`` come in pairs.
- Every KV scale is finite and > 0 (weight and input scales: ``quantize.inspect.check`` rule ``scale``).

Reads shard headers and the few scalar scale tensors only. ``quantize.inspect.check.check_build``
runs these rules (rule ``calibration``) on every compressed-tensors build; ModelOpt W4A4
builds get the ``input_scale`` presence rule there.
"""

import json
from pathlib import Path

import torch

from formats.checkpoint import load_index
from formats.compressed_tensors import FORMAT_NAME
from formats.shards import ShardReader, read_header
from quantize import archs

__all__ = ["check_activation_scales"]

_SCALARS = (".input_global_scale", ".k_scale", ".v_scale")


def check_activation_scales(build: str | Path) -> list[str]:
    """Findings (empty when the build passes) for the rules in the module docstring.

    Raises:
        SourceError: unreadable index, shard or config (from ``formats``).
        ValueError: the build has no compressed-tensors ``quantization_config``.
    """
    build = Path(build)
    config = json.loads((build / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{build}: not a compressed-tensors build (quant_method "
                         f"{qc.get('quant_method')!r}); ModelOpt builds are not checked here yet")
    # W4A4 = an NVFP4 group with input activations (an FP8_BLOCK group of a mixed build
    # quantizes its activations dynamically and stores no input scale)
    w4a4 = any((g or {}).get("input_activations") and (g.get("format") or qc.get("format")) == FORMAT_NAME
               for g in (qc.get("config_groups") or {}).values())
    weight_map = load_index(build)
    names: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        names.update({n: shard for n in read_header(build / shard)})
    packed = {n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed")}
    inputs = {n[: -len(".input_global_scale")] for n in names if n.endswith(".input_global_scale")}
    findings = []
    if w4a4:
        findings += [f"{m}: W4A4 build without {m}.input_global_scale" for m in sorted(packed - inputs)]
    elif inputs:
        findings.append(f"weight-only build carries {len(inputs)} input_global_scale tensor(s), "
                        f"e.g. {sorted(inputs)[0]}")
    reader = ShardReader(build, max_open=2)
    values = {}
    try:
        for n in sorted(names):
            if n.endswith(_SCALARS):
                v = reader.get(names[n], n).to(torch.float32).flatten()
                values[n] = v
                if n.endswith((".k_scale", ".v_scale")) and not (torch.isfinite(v).all() and (v > 0).all()):
                    findings.append(f"{n}: scale {v.tolist()} is not finite and positive")
    finally:
        reader.close()
    if w4a4:
        seen = set()
        for m in sorted(inputs & packed):
            grp = archs.fused_group_of(m, packed)
            if grp is None or grp[0] in seen:
                continue
            seen.add(grp[0])
            vals = {x: float(values[f"{x}.input_global_scale"][0]) for x in grp[1]
                    if f"{x}.input_global_scale" in values}
            if len(set(vals.values())) > 1:
                findings.append(f"fused group {grp[0]}: input_global_scale differs across members {vals}")
    if qc.get("kv_cache_scheme"):
        k = {n[: -len(".k_scale")] for n in names if n.endswith(".k_scale")}
        v = {n[: -len(".v_scale")] for n in names if n.endswith(".v_scale")}
        findings += [f"{a}: k_scale without v_scale" for a in sorted(k - v)]
        findings += [f"{a}: v_scale without k_scale" for a in sorted(v - k)]
    return findings
