"""Pre-flight: every check that can stop a conversion, run before the first byte is written.

One pass over the source and the output folder, reporting every finding of every kind at
once (a user with a 300 GiB download wants the whole list, not one error per hour):

- structure (``formats.sources.inspect_source``): config.json, index entries inside the
  folder, missing / empty shards, every shard header, index vs headers, FP8 weight/scale
  pairs, scale dtypes and shapes;
- scale values: every FP8 scale tensor is read (they are ~1/16000 of the weights for
  128x128 blocks): NaN / Inf and negative scales are errors, zero scales a warning, a scale
  that lets |w| exceed :data:`ABSURD_AMAX` an error;
- layout (``quantize.archs.check_layout``): config.json and the index agree on layers, MTP
  layers and experts;
- hostile input: custom code is reported (copied as a file, never executed), links leading
  out of the folder are not carried;
- output: not the source or inside it, empty unless resuming a spark-quant build, writable,
  and enough free space for the predicted build.

Checks that need the weights themselves (NaN / Inf weights, all-zero tensors, absurd amax of
dense weights) run during conversion, on each tensor as it is read (``quantize.pipeline``).
"""

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from formats.checkpoint import carry_plan
from formats.shards import DTYPE_BYTES, is_temp_name
from formats.sources import Source, inspect_source
from quantize import archs
from quantize.errors import Finding, raise_findings, render_findings
from quantize.kernels.dtypes import E4M3_MAX, NVFP4_GLOBAL_NUMERATOR, NVFP4_GROUP_SIZE
from quantize.manifest import MANIFEST_NAME, PROGRESS_NAME
from quantize.plan import Decision, plan_tensors
from quantize.recipe import Recipe, Target

__all__ = ["ABSURD_AMAX", "MIN_AMAX", "Preflight", "preflight", "scan_scales",
           "predict_output_bytes", "check_output", "human_bytes"]

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
    predicted_bytes: dict[str, int] = field(default_factory=dict)

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
        if self.predicted_bytes:
            head += f"; predicted build {human_bytes(sum(self.predicted_bytes.values()))}"
        body = render_findings(self.findings)
        return head + ("\n" + body if body else "")

    def raise_if_errors(self, what: str) -> None:
        """Raise one SourceError / OutputError listing every error (see ``raise_findings``)."""
        raise_findings(self.findings, what)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def scan_scales(source: Source) -> list[Finding]:
    """Read every FP8 scale tensor in a readable shard and check its values (kind ``scale``),
    whether or not its weight could be paired (a scale's own damage is reported either way).

    Errors: NaN / Inf values, negative values, a maximum that lets |w| reach beyond
    :data:`ABSURD_AMAX` (e4m3 holds at most 448, so ``448 * max(scale)`` bounds |w|).
    Warning: zero scales (those blocks dequantize to 0).
    """
    if source.layout is None:
        return []
    suffix = ".weight" + source.layout.scale_suffix
    out: list[Finding] = []
    scales = sorted((i for i in source.infos.values() if i.name.endswith(suffix)),
                    key=lambda i: (i.shard, i.name))
    for info in scales:
        sname, shard = info.name, info.shard
        weight = sname[: -len(source.layout.scale_suffix)]
        s = source.read_raw(sname).to(torch.float32).reshape(-1)
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
                                     f"value(s) equal to 0: those blocks of {weight} dequantize "
                                     "to 0"))
        out += [Finding(level, "scale", f"scale {sname} in {shard} {msg}", tensor=sname,
                        shard=shard) for level, msg in found]
    return out


def _layout_findings(source: Source) -> list[Finding]:
    shapes = {n: i.shape for n, i in source.infos.items()}
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


def _entry_bytes(name: str) -> int:
    """Room one output tensor takes in its shard header and in the index JSON."""
    return 2 * len(name) + 160


def predict_output_bytes(source: Source, decisions: dict[str, Decision]) -> dict[str, int]:
    """Predicted bytes of each output shard (named like its source shard), and under the key
    ``""`` the index, config and manifest: NVFP4 weights ``N*K/2 + N*K/16 + 4`` (three
    tensors), bf16 ``2 * numel``, kept tensors as stored, plus header and index room."""
    out: dict[str, int] = {"": 1 << 16}
    for name, t in source.tensors.items():
        d = decisions.get(name)
        if d is None:
            continue
        if d.target is Target.NVFP4:
            n, k = t.shape
            size = n * k // 2 + n * k // NVFP4_GROUP_SIZE + 4 + 3 * _entry_bytes(name)
        elif d.target is Target.BF16:
            size = 2 * t.numel + _entry_bytes(name)
        else:
            size = source.infos[name].nbytes + _entry_bytes(name)
        out[t.shard] = out.get(t.shard, 0) + size
        out[""] += len(name) + 32  # the manifest's targets
    return out


def _existing_ancestor(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output(out: Path, src: Path, resume: bool, predicted: dict[str, int] | None = None,
                 extra_bytes: int = 0) -> list[Finding]:
    """Output-folder findings (kind ``output``): the source folder or inside it, not a folder,
    not empty without ``--resume``, ``--resume`` into a folder that holds no spark-quant
    build, not writable, or short of free space for the predicted shards not yet on disk plus
    ``extra_bytes`` (carried files)."""
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
    if entries:
        ours = (out / PROGRESS_NAME).exists() or (out / MANIFEST_NAME).exists()
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
    if predicted:
        need = extra_bytes + sum(b for s, b in predicted.items() if not s or not (out / s).is_file())
        free = shutil.disk_usage(base).free
        if need > free:
            err(f"output needs about {human_bytes(need)} more on the filesystem of {base}, "
                f"{human_bytes(free)} is free; free space or choose another --out")
    return f


def preflight(src: str | Path, out: str | Path | None = None, *, recipe: Recipe | None = None,
              resume: bool = False, carry_skip: frozenset[str] = frozenset()) -> Preflight:
    """Run every pre-flight check on ``src`` (and ``out`` when given); raises nothing.

    Args:
        src: source folder. out: output folder, or None to check the source only.
        recipe: decides targets (for the size prediction); None skips planning.
        resume: an existing non-empty ``out`` is allowed.
        carry_skip: relative paths the converter writes itself (not carried).

    Returns:
        :class:`Preflight` with every finding; call ``raise_if_errors`` to stop on errors.
    """
    src = Path(src)
    source, findings = inspect_source(src)
    pre = Preflight(source, findings)
    copied: list[str] = []
    if source is not None:
        findings += scan_scales(source)
        findings += _layout_findings(source)
        copied, refused = carry_plan(src, set(carry_skip))
        findings += _custom_code_findings(src, source.config, copied, refused)
        if recipe is not None:
            pre.decisions = plan_tensors(source, recipe)
            pre.predicted_bytes = predict_output_bytes(source, pre.decisions)
    if out is not None:
        extra = sum((src / c).stat().st_size for c in copied)
        findings += check_output(Path(out), src, resume, pre.predicted_bytes, extra)
    return pre
