"""``quantize check``: will an engine load this build? Reads headers, configs and the scale
tensors only (never a weight).

Rules, each a finding with the tensor or module it is about (docs/formats.md §B.3.6):

- ``config``: the target ``quantization_config`` replaced the source's; compressed-tensors
  status / groups; ModelOpt ``hf_quant_config.json`` with the keys the engine requires,
  ``ignore`` == ``exclude_modules`` (FC-25); format supported by the engine.
- ``layout``: every quantized module has exactly its format's tensors with consistent
  shapes and dtypes; no ``*_scale_inv`` left over (FC-03); no 3-D fused expert tensor
  (``experts.gate_up_proj`` ...: engines load per-expert Linears, docs/faults.md).
- ``scale``: no scale tensor (``weight_scale``, ``input_scale``, ``input_global_scale``...)
  on a module whose weight is unquantized, no ``k_scale`` / ``v_scale`` in a build whose
  config declares no KV-cache quantization (a carried FP8-source sidecar; docs/faults.md).
- ``ignore``: every unquantized Linear weight is ignored / excluded and no quantized module
  is (FC-15; vLLM's substring and wildcard matching included); each quantized module is
  claimed by the config group of its own format.
- ``fused-group``: members share one format and, for NVFP4, one global scale (FC-06, FC-07)
  and, in a ModelOpt W4A4 build, one ``input_scale``;
  a routed-expert layer has one scheme (vLLM "All MoE projections need to have same
  quantization scheme").
- ``align``: per-TP-shard shapes meet the engine's alignment rows (``formats.engines``).
- ``model`` (vLLM): the config keys and tensor set vLLM 0.26's DeepSeek / GLM-5 code needs
  (``formats.engines`` VLLM_* rows): ``layer_types`` transformers 5.17 reads, router bias only
  with ``topk_method: noaux_tc`` (and on every router then), MLA head 576 and the SM90 prefill
  dims, DSA index dims and indexer parts (MTP layers too; ``wk`` BF16 or block FP8), MoE placement by
  ``first_k_dense_replace`` / ``moe_layer_freq``, no layers beyond the MTP layers, NVFP4 routed
  experts' hidden % 64.
- ``scale`` / ``config`` (vLLM, warnings): FP8 KV scales vLLM 0.26 does not load, so it runs the
  fp8 KV cache with scale 1.0: any on MLA attention (DeepSeek / GLM-5, both formats), and a
  ModelOpt build whose config.json lacks ``kv_cache_scheme`` (``formats.engines``
  VLLM_MLA_KV_SCALES_LOADED, VLLM_MODELOPT_KV_SCHEME; docs/formats.md §B.4).
- ``mtp``: each MTP layer (index from config) is present and complete, ``eh_proj`` unquantized.
- ``sensitive``: routers and other sensitive modules unquantized; model-specific loader rows.
- ``scale``: no NaN / Inf / non-positive scale value, no 0x7F / 0xFF e4m3 byte (FC-11)
  (:func:`scale_faults`). On a fresh build the counts come from the converter, which counted
  them in the tensors it wrote (``formats.manifest`` CHECK_STATS_NAME); the scales of a shard
  changed since the build, of a build without those statistics, and with ``full``, are read.
- ``calibration`` (compressed-tensors): W4A4 input scales present on every NVFP4 module and
  equal inside fused groups, none in a weight-only build, k/v scales paired and positive
  (``quantize.inspect.calib_check``).
"""

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from formats import FORMATS, compressed_tensors, get_writer, modelopt
from formats.checkpoint import INDEX_NAME, load_index, read_all_headers
from formats.engines import (
    ENGINES,
    FORMAT_SUPPORT,
    MODELOPT_REQUIRED_KEYS,
    MOE_ONE_SCHEME,
    VLLM_DSA_INDEX_HEAD_DIM,
    VLLM_DSA_INDEX_HEADS,
    VLLM_DSA_ROPE_DIM,
    VLLM_LAYER_TYPES_REJECTED,
    VLLM_MLA_HEAD_SIZES,
    VLLM_MLA_HEAD_SIZES_UNCONFIRMED,
    VLLM_MLA_KV_SCALES_LOADED,
    VLLM_MLA_MODEL_TYPES,
    VLLM_MLA_PREFILL_DIMS,
    VLLM_MODELOPT_KV_SCHEME,
    VLLM_MOE_HIDDEN_MULTIPLE,
    VLLM_NOAUX_TC,
    align_violations,
    mixed_moe_schemes,
    model_rules_broken,
)
from formats.manifest import CHECK_STATS_NAME, load_check_stats
from formats.shards import ShardReader, TensorInfo, read_header
from quantize import archs
from quantize.base.errors import Finding
from quantize.kernels.dtypes import count_bytes
from quantize.plan.recipe import Target

__all__ = ["SCALE_NAMES", "ScaleReads", "check_build", "render_check", "scale_faults"]

_QUANTIZED = tuple(t.value for t in Target if t.quantized)
_LOCAL_NAMES = frozenset(n.rsplit(".", 1)[1] for f in FORMATS for t in _QUANTIZED
                         for n in get_writer(f).output_specs("m", t, (128, 128), scheme="w4a4"))
"""Local names of every tensor a writer puts under a quantized module (both formats)."""
SCALE_NAMES = tuple(sorted(_LOCAL_NAMES - {"weight", "weight_packed"}))
"""Local names of the scale tensors the ``scale`` rule reads (both writers' ``output_specs``)."""


def scale_faults(t: torch.Tensor) -> int:
    """Values of one scale tensor (any shape, CPU) that the ``scale`` rule flags: for e4m3
    block scales the NaN bytes 0x7F / 0xFF (FC-11); for a float scale (F32 / BF16 global,
    input, 128x128 block FP8 scales) NaN, Inf or <= 0; for U8 (MXFP8 e8m0) none. The
    converter counts these as it writes (``formats.manifest.write_check_stats``)."""
    if t.dtype == torch.float8_e4m3fn:
        b = t.contiguous().view(torch.uint8).numpy()
        if b.size == 0 or b.max() < 0x7F:  # one vectorized pass: a good scale has no byte >= 0x7F
            return 0
        return count_bytes(t, 0x7F, 0x7F)
    if t.dtype == torch.uint8:
        return 0
    f = t.to(torch.float32)
    return int((~torch.isfinite(f) | (f <= 0)).sum())


@dataclass
class ScaleReads:
    """How :func:`check_build` got the scale rule's counts (filled in when passed).

    Attributes:
        recorded: shards whose counts came from the converter's statistics.
        read: shards whose scale tensors were read.
        problem: why shards with statistics were read anyway (changed since the build, or
            an unreadable statistics file); None when none were.
        tensors_read: scale tensors read from the files (the scale rule's reads).
        full: every scale tensor was to be read (``check_build(full=True)``).
    """

    recorded: list[str] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    problem: str | None = None
    tensors_read: int = 0
    full: bool = False

    def render(self) -> str:
        """One line saying what the check read: configs and every shard header always; the
        scale rule's scale tensors in full (``--full``, or shards without the converter's
        counts), or the counts the converter recorded. Weights are never read."""
        head = "read: the configs, every shard header, the one-element scales"
        tensors = f"{self.tensors_read} scale tensor(s) of {len(self.read)} shard(s)"
        if self.full:
            return (f"read: the configs, every shard header and every scale tensor ({tensors}, "
                    "--full); weights are not read (`quantize verify` samples them)")
        if not self.recorded:
            return (f"read: the configs, every shard header and every scale tensor ({tensors}: "
                    f"no converter counts in {CHECK_STATS_NAME})")
        counted = (f"the scale rule's counts of {len(self.recorded)} shard(s) as the converter "
                   f"recorded them ({CHECK_STATS_NAME}; --full reads every scale tensor)")
        if self.read:
            return f"{head} and {tensors}; {counted}"
        return f"{head}; {counted}"


def render_check(f: Finding) -> str:
    """One ``quantize check`` line: ``ERROR [rule] tensor: message`` (``kind`` is the rule)."""
    where = f" {f.tensor}:" if f.tensor else ""
    return f"{f.level.upper()} [{f.kind}]{where} {f.message}"


@dataclass
class _Module:
    name: str
    kind: str  # nvfp4 | fp8-block | mxfp8 | unquantized | broken
    shape: tuple[int, int] | None  # logical [N, K]
    tensors: dict[str, TensorInfo]


def _nvfp4_problems(t: dict[str, TensorInfo], w: TensorInfo, shape: tuple[int, int], fmt: str) -> list[str]:
    """How an NVFP4 module's tensors differ from what the ``fmt`` writer writes
    (``output_specs``): the packed weight's name, then each scale's dtype and shape."""
    writer = get_writer(fmt)
    specs = [(n.rsplit(".", 1)[1], spec) for n, spec in writer.output_specs("m", "nvfp4", shape).items()]
    problems = []
    packed_name = specs[0][0]
    if t.get(packed_name) is not w:
        problems.append(f"packed NVFP4 weight named {w.name.rsplit('.', 1)[-1]} in a {fmt} build "
                        f"(expected {packed_name})")
    for local, (dtype, want) in specs[1:]:
        g = t.get(local)
        if g is None or g.dtype != dtype or g.shape != want:
            problems.append(f"needs {local} {dtype} {list(want)}, has {(g.dtype, list(g.shape)) if g else None}")
    return problems


def _classify(name: str, t: dict[str, TensorInfo], fmt: str) -> tuple[_Module, list[str]]:
    """Kind and logical shape of a module from its tensors (by local name); problems found."""
    w = t.get("weight_packed") or t.get("weight")
    s = t.get("weight_scale")
    problems = []
    if w is None:
        return _Module(name, "broken", None, t), [f"has {sorted(t)} but no weight"]
    if w.dtype == "U8":
        n, half = w.shape
        shape = (n, half * 2)
        return _Module(name, "nvfp4", shape, t), _nvfp4_problems(t, w, shape, fmt)
    if w.dtype == "F8_E4M3":
        shape = tuple(w.shape)
        if len(shape) != 2:
            return _Module(name, "broken", None, t), [f"FP8 weight is {len(shape)}-D"]
        n, k = shape
        writer = get_writer(fmt)
        if s is not None and s.dtype == "U8":
            if s.shape != writer.output_specs("m", "mxfp8", shape)["m.weight_scale"][1] or k % 32:
                problems.append(f"MXFP8 weight_scale {list(s.shape)} does not fit weight {n}x{k}")
            return _Module(name, "mxfp8", shape, t), problems
        block = writer.output_specs("m", "fp8-block", shape)["m.weight_scale"]
        if s is not None and s.dtype in ("F32", "BF16") and s.shape == block[1]:
            return _Module(name, "fp8-block", shape, t), problems
        return _Module(name, "broken", shape, t), [
            f"FP8 weight without a 128x128 block weight_scale or e8m0 scale (has {sorted(t)})"]
    if len(w.shape) == 2:
        return _Module(name, "unquantized", tuple(w.shape), t), problems
    return _Module(name, "other", tuple(w.shape), t), problems


def _modules(infos: dict[str, TensorInfo], fmt: str, out: list) -> dict[str, _Module]:
    grouped: dict[str, dict[str, TensorInfo]] = {}
    for name, info in infos.items():
        if name.endswith("_scale_inv"):
            out.append(Finding("error", "layout", "source scale sidecar left in the build (FC-03)", name))
            continue
        if "." not in name:
            continue
        mod, local = name.rsplit(".", 1)
        if local in _LOCAL_NAMES:
            grouped.setdefault(mod, {})[local] = info
    mods = {}
    for mod, t in grouped.items():
        m, problems = _classify(mod, t, fmt)
        mods[mod] = m
        for p in problems:
            out.append(Finding("error", "layout", p, mod))
        scales = sorted(k for k in t if k not in ("weight", "weight_packed"))
        if m.kind == "unquantized" and scales:
            out.append(Finding("error", "scale", f"{', '.join(scales)} attached to a module the "
                               f"config leaves unquantized (weight {t['weight'].dtype}): engines "
                               "never read it (a carried FP8-source sidecar?)", mod))
    for name, info in infos.items():
        if len(info.shape) > 2 and ".experts." in name:
            out.append(Finding("error", "layout", f"{len(info.shape)}-D fused expert tensor "
                               f"{list(info.shape)} in {info.shard}: engines load per-expert "
                               "Linears (experts.<e>.gate_proj / up_proj / down_proj), so it "
                               "would be loaded unquantized or not at all", name))
    return mods


def _kv_scale_findings(config: dict, folder: Path, fmt: str, infos: dict[str, TensorInfo],
                       out: list) -> None:
    """k/v scales need the config's KV-cache quantization (``kv_cache_scheme`` or ModelOpt
    ``kv_cache_quant_algo``); without it they are a carried sidecar in an unknown convention."""
    kv = [n for n in infos if n.endswith((".k_scale", ".v_scale"))]
    if not kv:
        return
    qc = config.get("quantization_config") or {}
    if fmt == "compressed-tensors":
        declared = bool(qc.get("kv_cache_scheme"))
    else:
        path = folder / "hf_quant_config.json"
        q = json.loads(path.read_text()).get("quantization") or {} if path.is_file() else {}
        declared = bool(q.get("kv_cache_quant_algo") or qc.get("kv_cache_quant_algo")
                        or qc.get("kv_cache_scheme"))
    if not declared:
        out.append(Finding("error", "scale", f"{len(kv)} k_scale / v_scale tensor(s) (e.g. "
                           f"{sorted(kv)[0]}) in a build whose config declares no KV-cache "
                           "quantization: engines ignore them or read them in the wrong "
                           "convention", sorted(kv)[0]))


_KV_SCALE_1 = "vLLM will run the fp8 KV cache with scale 1.0, not the calibrated scales"


def _check_vllm_kv_scales(config: dict, folder: Path, fmt: str, infos: dict[str, TensorInfo],
                          out: list) -> None:
    """FP8 KV scales vLLM 0.26 does not load (warnings: scale 1.0 is vLLM's default, the build
    still runs): any on MLA attention (``formats.engines.VLLM_MLA_KV_SCALES_LOADED``), and a
    ModelOpt build whose config.json lacks ``kv_cache_scheme`` (``VLLM_MODELOPT_KV_SCHEME``;
    docs/formats.md §B.4)."""
    kv = sorted(n for n in infos if n.endswith((".k_scale", ".v_scale")))
    qc = config.get("quantization_config") or {}
    cfg = {**config, **archs.text_config(config)}
    modules = {n.rsplit(".", 1)[0] for n in infos}
    local = get_writer(fmt).KV_NAMES
    blocks = {}
    for n in kv:
        suffix = next((s for s in local.values() if n.endswith("." + s)), n.rsplit(".", 1)[1])
        blocks[n] = n[: -len(suffix) - 1]
    mla = [n for n in kv if archs.is_mla_attention(blocks[n], modules)]
    if mla and not VLLM_MLA_KV_SCALES_LOADED and (config.get("model_type") in VLLM_MLA_MODEL_TYPES
                                                  or cfg.get("model_type") in VLLM_MLA_MODEL_TYPES):
        out.append(Finding("warning", "scale", f"{len(mla)} k_scale / v_scale tensor(s) on MLA attention "
                           f"(e.g. {mla[0]}): vLLM 0.26 loads no KV scale of MLA attention under any name "
                           "(it looks for layers.L.self_attn.attn.attn.k_scale, the parameter is "
                           f"self_attn.mla_attn.mla_attn.k_scale): {_KV_SCALE_1}", mla[0]))
    path = folder / modelopt.HF_QUANT_CONFIG
    if fmt != "modelopt" or not path.is_file():
        return
    hf_kv = (json.loads(path.read_text()).get("quantization") or {}).get("kv_cache_quant_algo")
    scheme = qc.get("kv_cache_scheme")
    if hf_kv and not (isinstance(scheme, dict)
                      and all(scheme.get(k) == v for k, v in VLLM_MODELOPT_KV_SCHEME.items())):
        mixed = qc.get("quant_algo") == "MIXED_PRECISION"
        out.append(Finding("warning", "config", f"kv_cache_quant_algo {hf_kv} only in hf_quant_config.json; "
                           f"config.json quantization_config.kv_cache_scheme is {json.dumps(scheme)}, not "
                           f"{json.dumps(VLLM_MODELOPT_KV_SCHEME)}: vLLM 0.26 reads the KV-cache setting "
                           "from config.json, so --kv-cache-dtype auto keeps a bf16 KV cache"
                           + (f", and with --kv-cache-dtype fp8 {_KV_SCALE_1} (MIXED_PRECISION attaches "
                              "no KV method)" if mixed and kv else ""), "config.json"))


# ---- target matching (engine semantics) --------------------------------------------------
def _ct_match(target: str, module: str) -> bool:
    """compressed-tensors / vLLM target: exact name, ``re:`` (re.match), or the class
    ``Linear`` (any module with a 2-D weight here)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or target == "Linear"


def _mo_excluded(module: str, excludes: list[str]) -> bool:
    """vLLM ModelOpt ``is_layer_excluded``: exact, legacy substring, fnmatch wildcards."""
    stripped = module.replace("language_model.", "", 1)
    for e in excludes:
        if e == module or e in module or e in stripped or fnmatch.fnmatch(module, e):
            return True
    return False


_WEIGHT_ARGS = ("num_bits", "type", "strategy", "group_size", "block_structure", "symmetric")
"""The ``weights`` quantization arguments of a config group that decide how an engine
reads its tensors."""


def _ct_group_args(groups: dict, fmt: str | None) -> list[Finding]:
    """Each config group's ``weights`` arguments against what the writer states for its
    format (:func:`formats.compressed_tensors.quantization_config`, the one statement of the
    layout): an ``nvfp4-pack-quantized`` group with 8 bits or group size 32 would be misread."""
    by_format = {f: k for k, f in compressed_tensors.GROUP_FORMATS.items()}
    out = []
    for name, g in sorted(groups.items()):
        kind = by_format.get(g.get("format") or fmt)
        if kind is None or not isinstance(g.get("weights"), dict):
            continue
        ref = compressed_tensors.quantization_config({"m": kind}, [])["config_groups"]["group_0"]["weights"]
        bad = [f"{k} {g['weights'].get(k)!r} (the {kind} layout has {ref.get(k)!r})"
               for k in _WEIGHT_ARGS if g["weights"].get(k) != ref.get(k)]
        if bad:
            out.append(Finding("error", "config", f"config_groups.{name}.weights: " + "; ".join(bad),
                               "config.json"))
    return out


def _check_ct(qc: dict, mods: dict[str, _Module], engine: str, out: list) -> set[str]:
    if qc.get("quantization_status") != "compressed":
        out.append(Finding("error", "config", f"quantization_status is {qc.get('quantization_status')!r}, "
                           "expected 'compressed'", "config.json"))
    groups = qc.get("config_groups") or {}
    ignore = qc.get("ignore") or []
    kinds = {m.kind for m in mods.values() if m.kind in _QUANTIZED}
    fmt = qc.get("format")
    want_fmt = compressed_tensors.GROUP_FORMATS
    expect = "mixed-precision" if len(kinds) > 1 else want_fmt[kinds.pop()] if kinds else fmt
    if fmt != expect:
        out.append(Finding("error", "config", f"format {fmt!r} but the tensors need {expect!r}", "config.json"))
    _support(engine, "compressed-tensors", fmt, out)
    out += _ct_group_args(groups, fmt)
    if engine == "trtllm" and fmt == "mixed-precision" and any(
            not t.startswith("re:") and "." not in t for g in groups.values() for t in g.get("targets", [])):
        out.append(Finding("error", "config", "TRT-LLM rejects class-name targets in mixed configs",
                           "config.json"))
    ignored = set()
    for m in mods.values():
        if m.kind in ("other", "broken"):
            continue
        is_ignored = any(_ct_match(e, m.name) for e in ignore if e != "Linear")
        if is_ignored:
            ignored.add(m.name)
        if m.kind == "unquantized":
            if not is_ignored:
                out.append(Finding("error", "ignore", "unquantized Linear weight not in ignore; the engine "
                                   "would expect packed tensors (FC-15)", m.name))
            continue
        if is_ignored:
            out.append(Finding("error", "ignore", f"{m.kind} module listed in ignore", m.name))
            continue
        claimed = [g for g in groups.values() if any(_ct_match(t, m.name) for t in g.get("targets", []))]
        exact = [g for g in claimed if any(t == m.name or t.startswith("re:") for t in g.get("targets", []))]
        claimed = exact or claimed
        fmts = {g.get("format") or fmt for g in claimed}
        if fmts != {want_fmt[m.kind]}:
            out.append(Finding("error", "ignore", f"{m.kind} module claimed by config groups with formats "
                               f"{sorted(map(str, fmts))}", m.name))
    return ignored


def _support(engine: str, fmt: str, algo: str, out: list) -> None:
    rows = [r for r in FORMAT_SUPPORT if r.engine == engine and r.fmt == fmt and r.algo == algo]
    if not rows:
        out.append(Finding("error", "config", f"{engine} has no loader for {fmt} {algo}", "config.json"))
    elif rows[0].level != "ok":
        out.append(Finding(rows[0].level, "config", f"{engine} and {fmt} {algo}: {rows[0].source}",
                           "config.json"))


def mixed_support_findings(engine: str, layer_algos: set[str]) -> list[Finding]:
    """Findings for the ``quant_algo`` values inside a ModelOpt ``MIXED_PRECISION`` build that
    ``engine`` cannot load (``FORMAT_SUPPORT`` rows ``MIXED_PRECISION:<algo>``; an algo without
    a row is not judged). Pre-flight applies it to the plan, ``quantize check`` to the build."""
    out: list[Finding] = []
    for layer_algo in sorted(layer_algos):
        key = f"MIXED_PRECISION:{layer_algo}"
        if any(r.engine == engine and r.fmt == "modelopt" and r.algo == key for r in FORMAT_SUPPORT):
            _support(engine, "modelopt", key, out)
    return out


def _check_modelopt(folder: Path, qc: dict, mods: dict[str, _Module], engine: str, out: list) -> set[str]:
    path = folder / "hf_quant_config.json"
    if not path.is_file():
        out.append(Finding("error", "config", "ModelOpt build without hf_quant_config.json", path.name))
        return set()
    q = json.loads(path.read_text()).get("quantization") or {}
    for key in MODELOPT_REQUIRED_KEYS[engine]:
        if key not in q:
            out.append(Finding("error", "config", f"{engine} requires quantization.{key}", path.name))
    if not str(qc.get("quant_method", "")).startswith("modelopt"):
        out.append(Finding("error", "config", "config.json quantization_config.quant_method is not "
                           "modelopt", "config.json"))
    if "ignore" not in qc:
        out.append(Finding("error", "config", "config.json quantization_config has no 'ignore' (the key "
                           "engines read; FC-25)", "config.json"))
    elif set(qc["ignore"]) != set(q.get("exclude_modules") or []):
        out.append(Finding("error", "config", "config.json ignore differs from hf_quant_config "
                           "exclude_modules (FC-25)", "config.json"))
    algo = q.get("quant_algo")
    if qc.get("quant_algo") != algo:
        out.append(Finding("error", "config", f"quant_algo {qc.get('quant_algo')!r} in config.json vs "
                           f"{algo!r} in hf_quant_config.json", "config.json"))
    _support(engine, "modelopt", algo, out)
    excludes = q.get("exclude_modules") or []
    layers = q.get("quantized_layers") or {}
    if algo == "MIXED_PRECISION":
        out += mixed_support_findings(engine, {str(v.get("quant_algo")) for v in layers.values()
                                               if isinstance(v, dict)})
    algo_kind = modelopt.ALGO_TARGETS
    ignored = set()
    for m in mods.values():
        if m.kind in ("other", "broken"):
            continue
        ex = _mo_excluded(m.name, excludes)
        if ex:
            ignored.add(m.name)
        if m.kind == "unquantized":
            if not ex:
                out.append(Finding("error", "ignore", "unquantized Linear weight not in exclude_modules "
                                   "(FC-15)", m.name))
            if m.name in layers:
                out.append(Finding("error", "ignore", "unquantized module listed in quantized_layers", m.name))
            continue
        if ex:
            out.append(Finding("error", "ignore", f"{m.kind} module matched by exclude_modules (vLLM exact / "
                               "substring / wildcard matching)", m.name))
        got = algo_kind.get(layers[m.name]["quant_algo"]) if algo == "MIXED_PRECISION" and m.name in layers \
            else algo_kind.get(algo)
        if got != m.kind:
            out.append(Finding("error", "ignore", f"{m.kind} tensors but the config says "
                               f"{layers.get(m.name, {}).get('quant_algo', algo)}", m.name))
        if m.kind == "nvfp4" and algo == "NVFP4" and modelopt.NVFP4_NAMES["input_scalar"] not in m.tensors:
            out.append(Finding("error", "layout", "quant_algo NVFP4 (W4A4) needs input_scale", m.name))
    if algo in ("NVFP4", "W4A16_NVFP4") and q.get("group_size") != 16:
        out.append(Finding("error", "config", f"group_size {q.get('group_size')!r}, NVFP4 needs 16", path.name))
    return ignored


# ---- structure ---------------------------------------------------------------------------
def _scalar(reader: ShardReader, info: TensorInfo) -> float:
    return float(reader.get(info.shard, info.name).to(torch.float32).reshape(-1)[0])


def _check_groups(mods: dict[str, _Module], reader: ShardReader, fmt: str, out: list) -> None:
    names = {m for m in mods if mods[m].kind not in ("other", "broken")}
    seen = set()
    for mod in sorted(names):
        grp = archs.fused_group_of(mod, names)
        if grp is None or grp[0] in seen:
            continue
        gid, members = grp
        seen.add(gid)
        kinds = {m: mods[m].kind for m in members}
        if len(set(kinds.values())) > 1:
            out.append(Finding("error", "fused-group", "members differ: " + ", ".join(
                f"{m.rsplit('.', 1)[-1]}={k}" for m, k in kinds.items()), gid))
            continue
        if set(kinds.values()) == {"nvfp4"}:
            nvfp4 = get_writer(fmt).NVFP4_NAMES
            # compressed-tensors input_global_scale: quantize.inspect.calib_check (calibration rule)
            keys = [nvfp4["scalar"]] + ([nvfp4["input_scalar"]] if fmt == "modelopt" else [])
            for key in keys:
                have = [m for m in members if key in mods[m].tensors]
                if key == nvfp4["input_scalar"] and not have:
                    continue  # weight-only ModelOpt build
                if len(have) != len(members):
                    out.append(Finding("error", "fused-group", f"{key} on " + ", ".join(
                        m.rsplit('.', 1)[-1] for m in have) + " but not on " + ", ".join(
                        m.rsplit('.', 1)[-1] for m in members if m not in have), gid))
                    continue
                vals = {m: _scalar(reader, mods[m].tensors[key]) for m in members}
                if len(set(vals.values())) > 1:
                    out.append(Finding("error", "fused-group", f"{key} differs across members " + ", ".join(
                        f"{m.rsplit('.', 1)[-1]}={v:.9g}" for m, v in vals.items())
                        + " (engines take one; FC-06/FC-07)", gid))
    for prefix, kinds in mixed_moe_schemes({m: mods[m].kind for m in names}).items():
        out.append(Finding("error", "fused-group", f"routed experts mix {kinds}; {MOE_ONE_SCHEME}",
                           prefix))


def _check_mtp(config: dict, infos: dict[str, TensorInfo], mods: dict[str, _Module], out: list) -> None:
    for idx in archs.mtp_layer_indices(config):
        pat = re.compile(rf"(^|\.)layers\.{idx}\.")
        names = [n for n in infos if pat.search(n)]
        if not names:
            out.append(Finding("error", "mtp", f"MTP layer {idx} (num_hidden_layers + k from config) is "
                               "missing (FC-18)", f"layers.{idx}"))
            continue
        prefix = names[0][: pat.search(names[0]).end()]
        missing = [x for x in archs.MTP_REQUIRED_PARTS if prefix + x not in infos]
        if not any(n.startswith(prefix + "self_attn.") for n in names):
            missing.append("self_attn.*")
        if not any(n.startswith(prefix + "mlp.") for n in names):
            missing.append("mlp.*")
        if missing:
            out.append(Finding("error", "mtp", f"MTP layer incomplete, missing {missing} (FC-18)", prefix[:-1]))
        eh = mods.get(prefix + "eh_proj")
        if eh is not None and eh.kind != "unquantized":
            out.append(Finding("error", "mtp", "eh_proj must stay unquantized (engines build it as a plain "
                               "nn.Linear)", eh.name))


def _check_sensitive(config: dict, mods: dict[str, _Module], infos: dict, engine: str, out: list) -> None:
    names = set(infos)
    modules = {m.name for m in mods.values() if m.kind not in ("other", "broken")}
    model_type = config.get("model_type", "")
    hits: dict = {}
    for m in mods.values():
        if m.kind in ("unquantized", "other", "broken") or m.shape is None:
            continue
        role = archs.sensitive_role(m.name, m.shape, config, names)
        if role in ("router", "mtp_eh_proj", "embedding"):
            out.append(Finding("error", "sensitive", f"{role} is quantized; engines build it unquantized", m.name))
        roles = archs.module_roles(m.name, modules, config)
        for r in model_rules_broken(engine, model_type, roles):
            hits.setdefault(r, []).append(m.name)
    for r, names_hit in hits.items():
        out.append(Finding(r.level, "sensitive", f"{len(names_hit)} {r.role} Linear(s) quantized: "
                           f"{r.source}", names_hit[0]))


def _check_align(mods: dict[str, _Module], engine: str, tp: int, out: list) -> None:
    modules = {m.name for m in mods.values()}
    for m in mods.values():
        if m.kind not in _QUANTIZED:
            continue
        moe = "routed_expert" in archs.module_roles(m.name, modules)
        for why in align_violations(engine, m.kind, m.shape, archs.tp_split(m.name), tp, moe):
            out.append(Finding("error", "align", why, m.name))


_ANY_LAYER = re.compile(r"^(?P<pre>(?:.*\.)?layers\.)(?P<i>\d+)\.")
_INDEXER_PARTS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
"""Indexer tensors vLLM builds for every DSA layer and MTP layer (``deepseek_v2.py`` Indexer;
``k_norm`` is a LayerNorm with weight and bias)."""


def _check_vllm_model(config: dict, infos: dict[str, TensorInfo], mods: dict[str, _Module],
                      out: list) -> None:
    """vLLM 0.26's model-level needs (``formats.engines`` VLLM_* rows): config keys its
    config classes and attention backends accept, router bias vs ``topk_method``, DSA indexer
    dims and parts, MoE placement, no layers it has no parameters for, NVFP4 expert K."""
    cfg = {**config, **archs.text_config(config)}  # text keys win; top-level ones still seen
    where = "config.json"
    types = cfg.get("layer_types")
    bad = sorted({t for t in types if t in VLLM_LAYER_TYPES_REJECTED}) if isinstance(types, list) else []
    if bad:
        out.append(Finding("error", "model", f"layer_types has {bad}: transformers 5.17 (vLLM 0.26) "
                           "rejects it; 'deepseek_sparse_attention' is read by transformers 5.17 and 5.24",
                           where))
    if config.get("model_type") not in VLLM_MLA_MODEL_TYPES and cfg.get("model_type") not in VLLM_MLA_MODEL_TYPES:
        return  # vLLM's DeepSeek / GLM-5 code only
    biases = sorted(n for n in infos if n.endswith(".e_score_correction_bias"))
    topk = cfg.get("topk_method")
    if biases and topk != VLLM_NOAUX_TC:
        out.append(Finding("error", "model", f"{len(biases)} e_score_correction_bias tensor(s) but "
                           f"config.json topk_method is {topk!r}: vLLM creates the bias only with "
                           f"topk_method '{VLLM_NOAUX_TC}' (unknown parameter at load)", biases[0]))
    if topk == VLLM_NOAUX_TC:
        routers = sorted(n[: -len(".weight")] for n in infos if n.endswith(".mlp.gate.weight"))
        lacking = [r for r in routers if f"{r}.e_score_correction_bias" not in infos]
        if lacking:
            out.append(Finding("error", "model", f"topk_method '{VLLM_NOAUX_TC}' but {len(lacking)} "
                               "router(s) lack e_score_correction_bias: vLLM would route with an "
                               "uninitialised bias", f"{lacking[0]}.e_score_correction_bias"))
        if "scoring_func" not in cfg:
            out.append(Finding("warning", "model", f"topk_method '{VLLM_NOAUX_TC}' without scoring_func: "
                               "vLLM defaults to softmax; DeepSeek-V3 and GLM-5 route with 'sigmoid'", where))
    rope = cfg.get("qk_rope_head_dim") or 0
    dsa = "index_topk" in cfg
    if cfg.get("kv_lora_rank"):
        head = int(cfg["kv_lora_rank"]) + int(rope)
        if head not in VLLM_MLA_HEAD_SIZES:
            level = "warning" if head in VLLM_MLA_HEAD_SIZES_UNCONFIRMED else "error"
            out.append(Finding(level, "model", f"kv_lora_rank {cfg['kv_lora_rank']} + qk_rope_head_dim "
                               f"{rope} = {head}: vLLM's MLA backends take 576 (kv_lora_rank 512 + "
                               "qk_rope_head_dim 64)", where))
        dims = (cfg.get("qk_nope_head_dim"), rope, cfg.get("v_head_dim"))
        if dims not in VLLM_MLA_PREFILL_DIMS:
            out.append(Finding("warning" if dsa else "error", "model",
                               f"(qk_nope_head_dim, qk_rope_head_dim, v_head_dim) = {dims}: vLLM's SM90 "
                               f"MLA prefill (FLASH_ATTN) takes {', '.join(map(str, VLLM_MLA_PREFILL_DIMS))}"
                               + ("; DSA falls back to its top-k MQA path" if dsa else ""), where))
    if dsa:
        if cfg.get("index_head_dim") != VLLM_DSA_INDEX_HEAD_DIM:
            out.append(Finding("error", "model", f"index_head_dim {cfg.get('index_head_dim')}: vLLM's DSA "
                               f"indexer needs {VLLM_DSA_INDEX_HEAD_DIM} (quant block 128, DeepGEMM head_dim)",
                               where))
        if cfg.get("index_n_heads") not in VLLM_DSA_INDEX_HEADS:
            out.append(Finding("error", "model", f"index_n_heads {cfg.get('index_n_heads')}: DeepGEMM's "
                               f"MQA logits take {', '.join(map(str, VLLM_DSA_INDEX_HEADS))}", where))
        if rope != VLLM_DSA_ROPE_DIM:
            out.append(Finding("error", "model", f"qk_rope_head_dim {rope}: vLLM's DSA indexer needs "
                               f"{VLLM_DSA_ROPE_DIM}", where))
    layers: dict[int, set[str]] = {}
    prefix = "model.layers."
    for name in infos:
        m = _ANY_LAYER.match(name)
        if m and not name.startswith(("model.visual.", "visual.")):
            layers.setdefault(int(m["i"]), set()).add(name[m.end():])
            prefix = m["pre"]
    n = cfg.get("num_hidden_layers")
    k = cfg.get("num_nextn_predict_layers") or 0
    if isinstance(n, int):
        beyond = sorted(i for i in layers if i >= n + k)
        if beyond:
            out.append(Finding("error", "model", f"layer(s) {', '.join(map(str, beyond))} beyond "
                               f"num_hidden_layers {n} + num_nextn_predict_layers {k}: vLLM has no "
                               "parameters for them (KeyError at load)", f"{prefix}{beyond[0]}"))
        first, freq = cfg.get("first_k_dense_replace"), cfg.get("moe_layer_freq", 1) or 1
        if archs.num_routed_experts(config) and isinstance(first, int):
            want = {i for i in range(n) if i >= first and i % freq == 0}
            have = {i for i in range(n) if any(".experts." in p for p in layers.get(i, ()))}
            if want != have:
                out.append(Finding("error", "model", f"vLLM places MoE by first_k_dense_replace {first} / "
                                   f"moe_layer_freq {freq} on layers {sorted(want)}; the build has routed "
                                   f"experts on layers {sorted(have)}", where))
        if dsa:
            for i in sorted(layers):
                if i >= n + k:
                    continue
                att = "self_attn.indexer."
                lacking = [p for p in _INDEXER_PARTS if att + p not in layers[i]
                           and not (p.endswith(".weight") and f"{att}{p}_packed" in layers[i])]
                if lacking:
                    kind = "mtp" if i >= n else "model"
                    out.append(Finding("error", kind, f"layer {i}: vLLM builds a DSA indexer here but "
                                       f"the build lacks {', '.join(att + p for p in lacking)}",
                                       f"{prefix}{i}.{att}{lacking[0]}"))
        if archs.num_routed_experts(config):
            for i in range(n, n + k):
                parts = layers.get(i)
                if parts and "mlp.gate.weight" not in parts:
                    out.append(Finding("error", "mtp", f"MTP layer {i}: vLLM builds an MoE block here but "
                                       "the build lacks mlp.gate.weight", f"{prefix}{i}.mlp.gate.weight"))
                elif parts and not any(p.startswith("mlp.experts.") for p in parts):
                    out.append(Finding("error", "mtp", f"MTP layer {i}: vLLM builds an MoE block here but "
                                       "the build has no routed experts", f"{prefix}{i}.mlp.experts"))
    for m in mods.values():
        if m.name.endswith(".indexer.wk") and m.kind in ("nvfp4", "mxfp8"):
            out.append(Finding("error", "model", f"indexer wk is {m.kind}: vLLM builds wk_weights_proj "
                               "unquantized and loads wk only as BF16 or 128x128 block FP8", m.name))
    blocks = set()
    for m in mods.values():
        e = archs.expert_of(m.name)
        if m.kind != "nvfp4" or e is None or e[2] not in ("gate_proj", "up_proj", "w1", "w3") or m.shape is None:
            continue
        if m.shape[1] % VLLM_MOE_HIDDEN_MULTIPLE and e[0] not in blocks:
            blocks.add(e[0])
            out.append(Finding("error", "align", f"K={m.shape[1]}: vLLM's Marlin NVFP4 MoE needs hidden_size "
                               f"% {VLLM_MOE_HIDDEN_MULTIPLE} (prepare_nvfp4_moe_layer_for_marlin)", m.name))


def _check_scales(mods: dict[str, _Module], reader: ShardReader, recorded: dict[str, dict],
                  out: list, reads: ScaleReads) -> None:
    """The ``scale`` rule (:func:`scale_faults`) on every scale tensor of a quantized module:
    counted by the converter for the shards in ``recorded`` (shard -> record of
    ``formats.manifest.load_check_stats``), read from the file for the others (counted in
    ``reads.tensors_read``)."""
    for m in mods.values():
        for local in SCALE_NAMES:
            info = m.tensors.get(local)
            if info is None or m.kind == "unquantized":
                continue
            rec = recorded.get(info.shard)
            if rec is None:
                reads.tensors_read += 1
            bad = rec["faults"].get(info.name, 0) if rec is not None else \
                scale_faults(reader.get(info.shard, info.name))
            if bad and info.dtype == "F8_E4M3":
                out.append(Finding("error", "scale", f"{bad} NaN e4m3 byte(s) (0x7F/0xFF) (FC-11)", info.name))
            elif bad:
                out.append(Finding("error", "scale", f"{bad} NaN, Inf or non-positive value(s)", info.name))


def _recorded_scales(folder: Path, infos: dict[str, TensorInfo], full: bool,
                     reads: ScaleReads) -> dict[str, dict]:
    """Shard -> the converter's scale counts, for the shards unchanged since the build whose
    recorded number of scale tensors matches their header; none with ``full``."""
    shards = sorted({i.shard for i in infos.values()})
    kept, problem = ({}, None) if full else load_check_stats(folder)
    kept = {s: r for s, r in (kept or {}).items() if s in shards}
    in_header: dict[str, int] = {}
    for n, i in infos.items():
        if n.rsplit(".", 1)[-1] in SCALE_NAMES:
            in_header[i.shard] = in_header.get(i.shard, 0) + 1
    mismatched = [s for s in kept if kept[s]["scales"] != in_header.get(s, 0)]
    for s in mismatched:
        del kept[s]
    if mismatched:
        problem = ((problem + "; ") if problem else "") + (
            f"{len(mismatched)} shard(s) hold other scale tensors than were counted "
            f"({', '.join(mismatched[:3])}{' ...' if len(mismatched) > 3 else ''})")
    reads.recorded = [s for s in shards if s in kept]
    reads.read = [s for s in shards if s not in kept]
    reads.problem = problem
    reads.full = full
    return {s: kept[s] for s in reads.recorded}


def check_build(folder: str | Path, engine: str = "vllm", tp: int = 1, scan_scales: bool = True,
                full: bool = False, reads: ScaleReads | None = None) -> list[Finding]:
    """Findings for the build in ``folder`` as ``engine`` would load it with ``tp`` ranks.

    Reads config.json, hf_quant_config.json, the index, every shard header, the one-element
    scales (global, input and k/v scales: fused-group and calibration rules) and, with
    ``scan_scales``, the scale rule's counts: from the converter's statistics for the shards
    unchanged since the build, else (and for every shard with ``full``) by reading every
    scale tensor. Never a weight. ``reads``, when given, is filled in with which shards'
    scales were read and why.

    Returns:
        findings, errors first; an empty list means the build is clean.

    Raises:
        ValueError: unknown engine or tp < 1.
        SourceError: unreadable index, missing shard or malformed header.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} (valid: {', '.join(ENGINES)})")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    folder = Path(folder)
    out: list[Finding] = []
    config = json.loads((folder / "config.json").read_text())
    weight_map = load_index(folder)
    headers: dict[str, dict[str, TensorInfo]] = {}  # each header read once here
    infos = read_all_headers(folder, weight_map,
                             lambda s: headers.setdefault(s, read_header(folder / s)))
    for shard in sorted(set(weight_map.values())):
        for name in headers[shard]:
            if weight_map.get(name) != shard:
                out.append(Finding("error", "layout", f"in shard {shard} but not in {INDEX_NAME} (FC-21)", name))
    qc = config.get("quantization_config") or {}
    if isinstance(config.get("text_config"), dict) and "quantization_config" in config["text_config"]:
        out.append(Finding("error", "config", "text_config still carries the source quantization_config",
                           "config.json"))
    method = qc.get("quant_method")
    fmt = "compressed-tensors" if method == "compressed-tensors" else \
        "modelopt" if str(method).startswith("modelopt") else None
    if fmt is None:
        out.append(Finding("error", "config", f"quantization_config.quant_method is {method!r}: not an "
                           "NVFP4 build (the source FP8 config must be replaced)", "config.json"))
        return out
    mods = _modules(infos, fmt, out)
    _kv_scale_findings(config, folder, fmt, infos, out)
    reader = ShardReader(folder, max_open=2)
    try:
        if fmt == "compressed-tensors":
            _check_ct(qc, mods, engine, out)
        else:
            _check_modelopt(folder, qc, mods, engine, out)
        _check_groups(mods, reader, fmt, out)
        _check_mtp(config, infos, mods, out)
        _check_sensitive(config, mods, infos, engine, out)
        if (unknown := archs.unknown_arch(config)) is not None:
            out.append(Finding("warning", "config", f"{unknown}: checked from tensor names alone "
                               f"({archs.NAME_ONLY_RULES})", "config.json"))
        _check_align(mods, engine, tp, out)
        if engine == "vllm":
            _check_vllm_model(config, infos, mods, out)
            _check_vllm_kv_scales(config, folder, fmt, infos, out)
        if scan_scales:
            reads = reads if reads is not None else ScaleReads()
            _check_scales(mods, reader, _recorded_scales(folder, infos, full, reads), out, reads)
    finally:
        reader.close()
    if fmt == "compressed-tensors" and scan_scales:
        from quantize.inspect.calib_check import check_activation_scales

        for msg in check_activation_scales(folder):
            where, _, what = msg.partition(": ")
            out.append(Finding("error", "calibration", what or msg, where if what else None))
    return sorted(out, key=lambda f: (f.level != "error", f.kind, f.tensor or ""))
