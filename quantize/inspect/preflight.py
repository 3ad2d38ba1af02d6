"""Pre-flight: every check that can stop a conversion, run before the first byte is written.

One pass over the source and the output folder, reporting every finding of every kind at
once (a user with a 300 GiB download wants the whole list, not one error per hour):

- structure (``formats.sources.inspect_source``): config.json, index entries inside the
  folder, missing / empty shards, every shard header, index vs headers, FP8 weight/scale
  pairs, scale dtypes and shapes;
- scale values: every FP8 scale tensor is read (they are ~1/16000 of the weights for
  128x128 blocks): NaN / Inf and negative scales are errors, zero scales a warning, a scale
  that lets |w| exceed :data:`ABSURD_AMAX` an error; under ``scale_fmt: ue8m0`` scales that
  are not powers of two are a warning per shard (the stored values are used as they are);
- layout (``quantize.archs.check_layout``): config.json and the index agree on layers, MTP
  layers and experts;
- hostile input: custom code is reported (copied as a file, never executed), links leading
  out of the folder are not carried;
- output: not the source or inside it, empty unless resuming a spark-quant build, writable,
  and enough free disk for the predicted build (``quantize.inspect.budget``, which also counts the
  shards a Hub source still has to download).

Checks that need the weights themselves (NaN / Inf weights, all-zero tensors, absurd amax of
dense weights) run during conversion, on each tensor as it is read (``quantize.convert.pipeline``).
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from formats import modelopt
from formats.checkpoint import carry_plan
from formats.manifest import MANIFEST_NAME, PROGRESS_NAME, already_complete, has_ledger
from formats.shards import DTYPE_BYTES, ShardReader, dtype_name, is_temp_name
from formats.sources import Source, inspect_source
from quantize import archs
from quantize.base.errors import (
    Finding,
    OutputError,
    SourceError,
    raise_findings,
    render_findings,
)
from quantize.inspect.budget import check_free_disk, predicted_output_bytes
from quantize.inspect.check import mixed_support_findings
from quantize.kernels.dtypes import E4M3_MAX, NVFP4_GLOBAL_NUMERATOR
from quantize.plan.activations import kv_scale_dtype
from quantize.plan.recipe import Recipe
from quantize.plan.tensors import (
    Decision,
    arch_assumption,
    module_of,
    plan_tensors,
    predict_outputs,
)

__all__ = ["ABSURD_AMAX", "MIN_AMAX", "Preflight", "preflight", "scan_scales", "check_output"]

ABSURD_AMAX = 65504.0
"""Largest |w| accepted in a weight that becomes NVFP4: the float16 range. No trained Linear
weight comes near it; a larger value means a corrupt weight or scale, and its NVFP4 global
scale would crush every other block of the tensor (or its fused group) to zero."""

MIN_AMAX = NVFP4_GLOBAL_NUMERATOR / torch.finfo(torch.float32).max
"""Smallest non-zero amax with a finite global scale ``2688 / amax`` (about 7.9e-36);
below it compressed-tensors' ``generate_gparam`` falls back to 1.0 and the tensor
quantizes to zeros."""

@dataclass
class Preflight:
    """What pre-flight found. ``source`` / ``decisions`` are None when the source is unusable."""

    source: Source | None
    findings: list[Finding]
    decisions: dict[str, Decision] | None = None
    predicted: dict[str, dict] | None = None  # quantize.plan.tensors.predict_outputs

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    def render(self) -> str:
        head = (f"pre-flight: {len(self.errors)} error(s), {len(self.warnings)} warning(s)")
        if self.source is not None:
            head += (f"; {len(self.source.tensors)} tensors in {len(self.source.shards)} shards, "
                     f"layout {self.source.kind.value}")
        if self.predicted is not None:
            size = predicted_output_bytes(self.source, self.predicted)
            head += f"; predicted build {size / 2**20:.1f} MiB"
        body = render_findings(self.findings)
        return head + ("\n" + body if body else "")

    def raise_if_errors(self, what: str) -> None:
        """Raise one SourceError / OutputError listing every error (see ``raise_findings``)."""
        raise_findings(self.findings, what)


def scan_scales(source: Source) -> list[Finding]:
    """Read every FP8 scale tensor in a readable local shard and check its values (kind
    ``scale``), whether or not its weight could be paired (a scale's own damage is reported
    either way). Shards a Hub source has not downloaded yet are left to the conversion.

    Errors: NaN / Inf values, negative values, a maximum that lets |w| reach beyond
    :data:`ABSURD_AMAX` (e4m3 holds at most 448, so ``448 * max(scale)`` bounds |w|).
    Warning: zero scales (those blocks dequantize to 0).
    """
    if source.layout is None or not source.has_data:
        return []
    suffix = ".weight" + source.layout.scale_suffix
    remote = set(source.files.to_fetch())
    out: list[Finding] = []
    if remote:
        out.append(Finding("info", "scale", f"scales in {len(remote)} shard(s) still to download "
                           "are checked while converting"))
    scales = sorted((i for i in source.infos.values()
                     if i.name.endswith(suffix) and i.shard not in remote),
                    key=lambda i: (i.shard, i.name))
    # Its own reader on the files in the folder: the source's reader would make the shard
    # "in use" for the Hub streaming (fetch / release order) before conversion starts.
    reader = ShardReader(source.folder, max_open=1)
    ue8m0 = source.layout.scale_fmt == "ue8m0"
    not_pow2: dict[str, list] = {}  # shard -> [(scale name, first offending value, count)]
    try:
        for info in scales:
            try:
                s = reader.get(info.shard, info.name).to(torch.float32).reshape(-1)
            except SourceError as e:  # not local after all: the conversion reads it
                out.append(Finding("info", "scale", f"{info.name} not checked up front: {e}"))
                continue
            out += _scale_findings(info, s, info.name[: -len(source.layout.scale_suffix)])
            if ue8m0 and info.dtype != "F8_E8M0":
                pos = s[torch.isfinite(s) & (s > 0)]
                odd = pos[torch.frexp(pos).mantissa != 0.5]
                if odd.numel():
                    not_pow2.setdefault(info.shard, []).append((info.name, float(odd[0]), odd.numel()))
    finally:
        reader.close()
    for shard, hits in sorted(not_pow2.items()):
        name, value, _ = hits[0]
        out.append(Finding("warning", "scale", f"shard {shard}: quantization_config declares "
                           f"scale_fmt 'ue8m0' but {len(hits)} scale tensor(s) hold "
                           f"{sum(h[2] for h in hits)} value(s) that are not powers of two (first "
                           f"{name} = {value:.9g}); they are used as stored", tensor=name,
                           shard=shard))
    return out


def _scale_findings(info, s: torch.Tensor, weight: str) -> list[Finding]:
    found = []
    bad = ~torch.isfinite(s)
    if bad.any():
        found.append(("error", f"has {int(bad.sum())} NaN/Inf value(s) (first at flat index "
                               f"{int(bad.nonzero()[0])}); {weight} cannot be dequantized"))
        s = s[~bad]
    if (s < 0).any():
        found.append(("error", f"has {int((s < 0).sum())} negative value(s) (min "
                               f"{s.min().item():.3g}); FP8 scales are magnitudes"))
    bound = s.max().item() * E4M3_MAX if s.numel() else 0.0
    if bound > ABSURD_AMAX:
        found.append(("error", f"has max {bound / E4M3_MAX:.3g}, so |{weight}| may reach "
                               f"{bound:.3g}, beyond {ABSURD_AMAX:g} (the float16 range, which "
                               "no trained weight exceeds): a corrupt scale"))
    zeros = int((s == 0).sum())
    if zeros:
        found.append(("warning", f"has {zeros} of {info.nbytes // DTYPE_BYTES[info.dtype]} "
                                 f"value(s) equal to 0: those blocks of {weight} dequantize to 0"))
    return [Finding(level, "scale", f"scale {info.name} in {info.shard} {msg}", tensor=info.name,
                    shard=info.shard) for level, msg in found]


def _config_findings(config: dict, modules: set[str], allow_unknown_arch: bool = False) -> list[Finding]:
    """Config values of the wrong type (each names its key), a ``model_type`` the
    architecture map does not know, or none in a model's config (``archs.unknown_arch``; an error unless
    ``allow_unknown_arch``), and one it does not know for modules whose treatment depends on it
    (the DSA indexer ``weights_proj``, high precision only for ``archs.DSA_MODEL_TYPES``; an
    error whatever the flag)."""
    out = []
    if archs.unknown_arch(config) is not None and not allow_unknown_arch:
        out.append(Finding("error", "config", archs.unknown_arch_message(archs.unknown_model_type(config)),
                           key="model_type"))
    for key, message in archs.config_type_errors(config):
        out.append(Finding("error", "config", message, key=key))
    mt = config.get("model_type")
    dsa = sorted(m for m in modules if m.endswith(".indexer.weights_proj"))
    if dsa and mt not in archs.DSA_MODEL_TYPES and archs.text_config(config).get("model_type") \
            not in archs.DSA_MODEL_TYPES:
        out.append(Finding("error", "config", f"config.json model_type {mt!r} is not one the "
                           f"architecture map knows for a DSA indexer ({', '.join(archs.DSA_MODEL_TYPES)}), "
                           f"but {dsa[0]} is a DSA indexer weights_proj: it would be planned as a plain "
                           "Linear instead of staying high precision; set model_type to the architecture "
                           "the checkpoint is", key="model_type"))
    return out


def _layout_findings(source: Source) -> list[Finding]:
    shapes = {n: i.shape for n, i in source.infos.items() if n not in source.split}
    shapes.update({n: source.tensors[n].shape for names in source.split.values() for n in names})
    shapes.update({n: None for n in source.unreadable})
    return [Finding(level, "layout", msg, tensor=t)
            for level, msg, t in archs.check_layout(source.config, shapes)]


def _custom_code_findings(src: Path, config: dict, copied: list[str],
                          refused: list[str]) -> list[Finding]:
    out = [Finding("warning", "hostile", msg) for msg in refused]
    code = [c for c in copied if c.endswith(".py")]
    auto_map = config.get("auto_map") or (config.get("text_config") or {}).get("auto_map")
    if code or auto_map:
        out.append(Finding("info", "hostile", f"custom code ({', '.join(code) or 'auto_map'}) is "
                           "copied as files and never executed; nothing here imports it unless "
                           "--trust-remote-code is passed to a command that loads the model"))
    return out


def _existing_ancestor(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output(out: Path, src: Path, resume: bool, source: Source | None = None,
                 predicted: dict[str, dict] | None = None) -> list[Finding]:
    """Output-folder findings (kind ``output``): the source folder or inside it, not a folder,
    not empty without ``--resume`` (a finished build is said to be complete,
    ``formats.manifest.already_complete``; with ``--resume`` that is an info finding),
    ``--resume`` into a folder that holds no spark-quant build, not writable, or (with
    ``source`` and ``predicted``) too little free disk for the output shards not yet on disk
    (``quantize.inspect.budget.check_free_disk``)."""
    out, src = Path(out), Path(src)
    f: list[Finding] = []

    def err(msg):
        f.append(Finding("error", "output", msg, key=str(out)))

    o, s = out.resolve(), src.resolve()
    if o == s or o.is_relative_to(s):
        err(f"--out {out} is the source folder or inside it; choose a folder outside the source")
        return f
    if out.exists() and not out.is_dir():
        err(f"--out {out} exists and is not a folder")
        return f
    entries = list(out.iterdir()) if out.is_dir() else []
    if entries and (out / MANIFEST_NAME).is_file():  # a finished build: nothing to resume
        if resume:
            f.append(Finding("info", "output", already_complete(out), key=str(out)))
        else:
            err(f"output folder {out} is not empty: {already_complete(out)}")
        return f
    if entries:
        ours = has_ledger(out) or (out / MANIFEST_NAME).exists()
        leftovers = all(is_temp_name(p.name) for p in entries)  # killed before its first rename
        if not resume:
            err(f"output folder {out} is not empty; "
                + ("pass --resume to continue that build" if ours or leftovers
                   else "choose another --out"))
        elif not (ours or leftovers):
            err(f"--resume: {out} holds no spark-quant build (no {PROGRESS_NAME} or "
                f"{MANIFEST_NAME}); refusing to write into it")
    base = _existing_ancestor(out)
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        err(f"output folder {out} is not writable ({base}: {e.strerror or e})")
        return f
    if source is not None and predicted is not None:
        done = {s for s in source.shards if (out / s).is_file()}
        # the non-weight files carried into the build (tokenizer.json alone can be tens of MiB)
        carried = (sum((src / rel).stat().st_size for rel in carry_plan(src, set())[0])
                   if Path(src).is_dir() else 0)
        try:
            check_free_disk(out, predicted_output_bytes(source, predicted, done) + carried,
                            source.files)
        except OutputError as e:
            err(str(e))
    return f


def _format_support(decisions, fmt: str, scheme: str, engine: str) -> list[Finding]:
    """The final check's engine-support rule for a ModelOpt ``MIXED_PRECISION`` build
    (:func:`quantize.inspect.check.mixed_support_findings`), applied to the plan so such a
    build is refused before its first byte is written."""
    if fmt != modelopt.FORMAT_NAME:
        return []
    targets = {d.name: d.target.value for d in decisions.values() if d.target.quantized}
    if modelopt.quant_algo_of(targets, scheme) != "MIXED_PRECISION":
        return []
    algos = {modelopt.quant_algo_of({"m": t}, scheme) for t in set(targets.values())}
    return mixed_support_findings(engine, algos)


def preflight(src: str | Path | Source, out: str | Path | None = None, *,
              recipe: Recipe | None = None, resume: bool = False, fmt: str = "compressed-tensors",
              tp: int = 1, engine: str = "vllm", carry_skip: frozenset[str] = frozenset(),
              scheme: str = "w4a16", kv_attention: tuple[str, ...] = (),
              allow_unknown_arch: bool = False) -> Preflight:
    """Run every pre-flight check on ``src`` (and ``out`` when given); raises nothing.

    Args:
        src: source folder or descriptor, or an opened Source (a Hub source, whose structure
            ``open_source`` has already checked).
        out: output folder, or None to check the source only.
        recipe: decides targets (with ``fmt``, ``tp``, ``engine``) for the size prediction;
            None skips planning.
        resume: an existing non-empty ``out`` holding a spark-quant build is allowed.
        carry_skip: relative paths the converter writes itself (not carried).
        scheme, kv_attention: what the prediction adds to the planned tensors: ``w4a4``
            input scales, FP8 KV scales of these attention blocks (in the model's dtype,
            ``quantize.plan.activations.kv_scale_dtype``); ``predicted`` is then exactly what
            the converter writes.
        allow_unknown_arch: a ``model_type`` the architecture map does not know is planned from
            tensor names alone (else an error); the plan's assumption is an ``info`` finding
            (``quantize.plan.tensors.arch_assumption``).

    Returns:
        :class:`Preflight` with every finding; call ``raise_if_errors`` to stop on errors.
    """
    if isinstance(src, Source):
        source, findings = src, list(src.findings)
    else:
        source, findings = inspect_source(src)
    folder = source.folder if source is not None else Path(src)
    pre = Preflight(source, findings)
    if source is not None:
        findings += _config_findings(source.config, {m for n in source.tensors
                                                     if (m := module_of(n)) is not None},
                                     allow_unknown_arch)
        findings += scan_scales(source)
        findings += _layout_findings(source)
        if folder.is_dir():
            copied, refused = carry_plan(folder, set(carry_skip))
            findings += _custom_code_findings(folder, source.config, copied, refused)
        if recipe is not None and not any(f.level == "error" for f in findings):
            pre.decisions = plan_tensors(source, recipe, tp=tp, engine=engine,
                                         allow_unknown_arch=allow_unknown_arch)
            if (assumed := arch_assumption(source.config, pre.decisions)) is not None:
                findings.append(Finding("info", "config", assumed, key="model_type"))
            kv_dtype = dtype_name(kv_scale_dtype(source.config))
            pre.predicted = predict_outputs(source, pre.decisions, fmt, scheme=scheme,
                                            kv_scales={a: kv_dtype for a in kv_attention})
            findings += _format_support(pre.decisions, fmt, scheme, engine)
    if out is not None:
        findings += check_output(Path(out), folder, resume, source, pre.predicted)
    return pre
