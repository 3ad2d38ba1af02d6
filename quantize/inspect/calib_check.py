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
from formats.compressed_tensors import FORMAT_NAME, KV_NAMES, NVFP4_NAMES
from formats.shards import ShardReader, read_header
from quantize import archs

__all__ = ["check_activation_scales"]

_PACKED = "." + NVFP4_NAMES["packed"]  # .weight_packed
_INPUT = "." + NVFP4_NAMES["input_scalar"]  # .input_global_scale
_K, _V = "." + KV_NAMES["k"], "." + KV_NAMES["v"]  # .k_scale, .v_scale
_SCALARS = (_INPUT, _K, _V)


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
    packed = {n[: -len(_PACKED)] for n in names if n.endswith(_PACKED)}
    inputs = {n[: -len(_INPUT)] for n in names if n.endswith(_INPUT)}
    findings = []
    if w4a4:
        findings += [f"{m}: W4A4 build without {m}{_INPUT}" for m in sorted(packed - inputs)]
    elif inputs:
        findings.append(f"weight-only build carries {len(inputs)} {_INPUT[1:]} tensor(s), "
                        f"e.g. {sorted(inputs)[0]}")
    reader = ShardReader(build, max_open=2)
    values = {}
    try:
        for n in sorted(names):
            if n.endswith(_SCALARS):
                v = reader.get(names[n], n).to(torch.float32).flatten()
                values[n] = v
                if n.endswith((_K, _V)) and not (torch.isfinite(v).all() and (v > 0).all()):
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
            vals = {x: float(values[x + _INPUT][0]) for x in grp[1] if x + _INPUT in values}
            if len(set(vals.values())) > 1:
                findings.append(f"fused group {grp[0]}: {_INPUT[1:]} differs across members {vals}")
    if qc.get("kv_cache_scheme"):
        k = {n[: -len(_K)] for n in names if n.endswith(_K)}
        v = {n[: -len(_V)] for n in names if n.endswith(_V)}
        findings += [f"{a}: {_K[1:]} without {_V[1:]}" for a in sorted(k - v)]
        findings += [f"{a}: {_V[1:]} without {_K[1:]}" for a in sorted(v - k)]
    return findings
