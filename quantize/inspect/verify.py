"""``quantize verify BUILD``: is a build exactly what its manifest says, and does it still
agree with its source?

Checks, all reported together:

1. manifest: present (its absence means the build never finished), no progress ledger or
   temp-file leftovers, every listed file present with its size and sha256, no unlisted files;
2. headers: every shard header re-read with the strict parser; the index equals the union of
   the headers and its ``total_size`` their tensor bytes (FC-21b);
3. layout: every tensor the manifest's ``targets`` lists is in the build under the names,
   dtypes and shapes its output format writes (``output_specs`` of the format's writer);
4. engine checks: ``quantize check`` with the manifest's engine and TP (:func:`_engine_checks`,
   the single call site), reading every scale tensor (``full``: not the converter's counts in
   the local ``.spark-quant-stats.json``, which verify neither requires nor lists);
5. samples: a few rows of every NVFP4, bf16 and kept tensor are read back; NVFP4 rows
   (compressed-tensors or ModelOpt) are dequantized and must be finite with no NaN scale
   bytes; when the source is available (``--src`` or the path in the manifest) and its shard
   headers match the manifest's digests, each sampled element must be within the NVFP4
   rounding bound of the source (one e2m1 step unit ``block_scale / global_scale``, which
   covers rounding and the FC-11b floor, plus ``|x| - 6 units`` where an element was clipped
   because its block scale was rounded down), bf16 rows must equal the source rounded
   to bf16 and kept rows its exact bits. FP8-block and MXFP8 targets are left to ``quantize
   check``.
"""

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from formats import get_writer
from formats.checkpoint import INDEX_NAME
from formats.manifest import (
    CHECK_STATS_NAME,
    EVAL_FOLDER,
    MANIFEST_NAME,
    fingerprint,
    has_ledger,
    is_ledger_name,
)
from formats.shards import (
    ShardReader,
    TensorInfo,
    is_temp_name,
    read_header,
    sha256_file,
)
from formats.sources import Source, inspect_source
from quantize.base.errors import Finding, SourceError, SparkQuantError, render_findings
from quantize.data.demo import find_recorded_source, source_places
from quantize.kernels.nvfp4 import dequantize_nvfp4

__all__ = ["VerifyReport", "verify"]

_NAN_E4M3 = (0x7F, 0xFF)


@dataclass
class VerifyReport:
    """Findings and counts of one verify run; ``ok`` when there is no error."""

    build: Path
    findings: list[Finding] = field(default_factory=list)
    files: int = 0
    bytes_hashed: int = 0
    headers: int = 0
    sampled: int = 0
    compared: int = 0
    source: str | None = None
    worst: float = 0.0  # max |error| / bound over compared NVFP4 elements

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    def add(self, level: str, kind: str, message: str, **names) -> None:
        self.findings.append(Finding(level, kind, message, **names))

    def render(self) -> str:
        errors = sum(f.level == "error" for f in self.findings)
        lines = [f"verify {self.build}: {'OK' if self.ok else f'{errors} error(s)'}",
                 f"  files: {self.files} hashed ({self.bytes_hashed / 2**20:.1f} MiB), "
                 f"{self.headers} shard headers re-read",
                 f"  samples: {self.sampled} tensors read back"
                 + (f", {self.compared} compared with {self.source} (worst NVFP4 error "
                    f"{self.worst:.3f} of its rounding bound)" if self.compared else
                    ", source not compared")]
        body = render_findings(self.findings)
        return "\n".join(lines) + ("\n" + body if body else "")


def _check_files(build: Path, manifest: dict, rep: VerifyReport) -> None:
    listed = manifest.get("files", {})
    for rel, entry in sorted(listed.items()):
        p = build / rel
        if not p.is_file():
            rep.add("error", "files", f"{rel} is listed in the manifest but missing", key=rel)
            continue
        size = p.stat().st_size
        if size != entry.get("bytes"):
            rep.add("error", "files", f"{rel} has {size} bytes, the manifest says "
                    f"{entry.get('bytes')}", key=rel)
            continue
        rep.files += 1
        rep.bytes_hashed += size
        if sha256_file(p) != entry.get("sha256"):
            rep.add("error", "files", f"{rel}: sha256 differs from the manifest (corrupted or "
                    "modified after the build)", key=rel)
    evals = 0
    for p in sorted(build.rglob("*")):
        rel = str(p.relative_to(build))
        if p.is_file() and p.relative_to(build).parts[0] == EVAL_FOLDER and rel not in listed:
            evals += 1  # quantize eval's report, written after the build
            continue
        if p.is_file() and rel not in (MANIFEST_NAME, CHECK_STATS_NAME) and rel not in listed:
            why = ("an unfinished run's progress ledger" if is_ledger_name(rel) else
                   "a leftover temp file" if is_temp_name(p.name) else "not in the manifest")
            rep.add("error", "files", f"{rel}: {why}", key=rel)
    if evals:
        rep.add("info", "files", f"{EVAL_FOLDER}/: {evals} file(s) of `quantize eval`'s report, "
                "written after the build, not hashed", key=EVAL_FOLDER)


def _check_headers(build: Path, rep: VerifyReport) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for p in sorted(build.glob("*.safetensors")):
        try:
            header = read_header(p)
        except SourceError as e:
            rep.findings.append(Finding.of(e, "header"))
            continue
        rep.headers += 1
        infos.update(header)
    try:
        index = json.loads((build / INDEX_NAME).read_text())
        wm, total = index["weight_map"], index["metadata"]["total_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        rep.add("error", "index", f"{INDEX_NAME} is missing or malformed: {e}", key=INDEX_NAME)
        return infos
    union = {n: i.shard for n, i in infos.items()}
    for name in sorted(set(wm) ^ set(union)):
        where = "the index but no shard header" if name in wm else "a shard but not the index"
        rep.add("error", "index", f"{name} is in {where}", tensor=name)
    for name in sorted(set(wm) & set(union)):
        if wm[name] != union[name]:
            rep.add("error", "index", f"index puts {name} in {wm[name]}, it is in "
                    f"{union[name]}", tensor=name)
    real = sum(i.nbytes for i in infos.values())
    if total != real:
        rep.add("error", "index", f"index total_size {total} differs from the {real} tensor "
                "bytes in the shards (FC-21b)", key="total_size")
    return infos


_SAMPLED = ("nvfp4", "bf16", "keep")


def _expected(writer, name: str, target: str, infos: dict[str, TensorInfo]) -> dict[str, tuple]:
    """Output tensor name -> (dtype, shape) the writer emits for ``name`` as ``target``; for a
    quantized target the shape is taken from the first tensor present (N, K are not stored
    elsewhere). Unquantized targets: just the name (dtype and shape as the source had them)."""
    if target in ("bf16", "keep"):
        return {name: None}
    module = name[: -len(".weight")]
    first = next(iter(writer.output_specs(module, target, (16, 32))))
    info = infos.get(first)
    if info is None or len(info.shape) != 2:
        return {n: None for n in writer.output_specs(module, target, (16, 32))}
    n, k = info.shape
    return writer.output_specs(module, target, (n, 2 * k if target == "nvfp4" else k))


def _check_layout(writer, manifest: dict, infos: dict[str, TensorInfo], rep: VerifyReport) -> None:
    for name, target in sorted(manifest.get("targets", {}).items()):
        want = _expected(writer, name, target, infos)
        lost = [n for n in want if n not in infos]
        if lost:
            rep.add("error", "layout", f"{name} ({target}) has no {', '.join(lost)} in the build",
                    tensor=name)
            continue
        bad = [f"{n} is {infos[n].dtype}{list(infos[n].shape)}, expected {d}{list(shp)}"
               for n, spec in want.items() if spec is not None
               for d, shp in [spec] if (infos[n].dtype, tuple(infos[n].shape)) != (d, tuple(shp))]
        if bad:
            rep.add("error", "layout", f"{name} ({target}): " + "; ".join(bad), tensor=name)


def _engine_checks(build: Path, manifest: dict) -> list[Finding]:
    """``quantize check`` on the build, with the engine and TP it was made for: the single
    call site in verify. Its findings keep their rule in the message."""
    from quantize.inspect.check import check_build

    opts = manifest.get("options", {})
    try:
        found = check_build(build, engine=opts.get("engine", "vllm"), tp=opts.get("tp", 1), full=True)
    except SparkQuantError as e:  # its own strict reads failed: the findings above say why
        return [Finding("error", "check", "quantize check could not run: "
                        + str(e).splitlines()[0])]
    return [Finding(f.level, "check", f"[{f.kind}] " + (f"{f.tensor}: " if f.tensor else "")
                    + f.message, tensor=f.tensor) for f in found]


def _open_matching_source(src: Path, manifest: dict, rep: VerifyReport) -> Source | None:
    if not src.is_dir():
        rep.add("info", "source", f"source {src} is not available: samples checked for finite "
                "values only")
        return None
    source, found = inspect_source(src)
    errors = [f for f in found if f.level == "error"]
    if source is None or errors:
        rep.add("error", "source", f"source {src} cannot be opened: "
                + (errors[0].message if errors else "no usable config or index"))
        return None
    headers = {n: [i.shard, i.dtype, list(i.shape)] for n, i in source.infos.items()}
    want = manifest.get("source", {}).get("shards", {})
    for s in sorted(set(want) | set(source.shards)):
        got = fingerprint({n: h for n, h in headers.items() if h[0] == s})
        if want.get(s) != got:
            rep.add("error", "source", f"source {src} is not the one this build was made from: "
                    f"shard {s} differs from the manifest's header digest", shard=s)
            source.close()
            return None
    rep.source = str(src)
    return source


def _rows_of(name: str, n: int, k: int) -> list[int]:
    """Up to ``k`` distinct row indices of ``name`` (deterministic in its name): first, last,
    and pseudo-random ones between."""
    if n <= k:
        return list(range(n))
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    middle = torch.randperm(n - 2, generator=g)[: max(0, k - 2)] + 1
    return sorted({0, n - 1, *middle.tolist()})


def _sample(build: Path, writer, manifest: dict, infos: dict[str, TensorInfo],
            source: Source | None, rows: int, rep: VerifyReport) -> None:
    reader = ShardReader(build, max_open=2)
    skipped = 0
    # GPTQ moves weights by design beyond one rounding step of the source: its NVFP4 tensors
    # are checked for NaN scales and a finite global scale only (docs/gptq.md)
    gptq = manifest.get("options", {}).get("method") == "gptq"
    if gptq and source is not None:
        rep.add("info", "sample", "GPTQ build: NVFP4 samples are not compared with the source's "
                "rounding bound (GPTQ moves weights to cut the output error, not the weight error)")
    try:
        for name, target in sorted(manifest.get("targets", {}).items()):
            names = list(_expected(writer, name, target, infos))
            if target not in _SAMPLED:
                skipped += 1
                continue
            if any(n not in infos for n in names):
                continue  # reported by _check_layout
            first = infos[names[0]]
            n_rows = first.shape[0] if first.shape else 1
            picks = _rows_of(name, n_rows, rows) if len(first.shape) >= 1 else [None]
            rep.sampled += 1
            compare = source is not None and name in source.tensors
            rep.compared += compare
            for r in picks:
                span = (r, r + 1) if r is not None else None
                if target == "nvfp4":
                    _sample_nvfp4(reader, writer, name, names, infos, r,
                                  source if compare and not gptq else None, rep)
                    continue
                got = reader.get(infos[name].shard, name, rows=span)
                if got.is_floating_point() and not torch.isfinite(got).all():
                    rep.add("error", "sample", f"{name} row {r}: NaN/Inf in the build", tensor=name)
                if compare:
                    ref = (source.read_rows(name, r, r + 1) if span else source.read(name))
                    ref = ref.to(torch.bfloat16) if target == "bf16" else ref
                    if ref.dtype != got.dtype or not torch.equal(
                            ref.view(-1).view(torch.uint8), got.view(-1).view(torch.uint8)):
                        rep.add("error", "sample", f"{name} row {r}: {target} bytes differ from "
                                "the source", tensor=name)
    finally:
        reader.close()
    if skipped:
        rep.add("info", "sample", f"{skipped} FP8-block / MXFP8 tensor(s) not sampled (left to "
                "quantize check)")


def _sample_nvfp4(reader: ShardReader, writer, name: str, names: list[str],
                  infos: dict[str, TensorInfo], r: int, source: Source | None,
                  rep: VerifyReport) -> None:
    packed_n, scale_n, scalar_n = names
    packed = reader.get(infos[packed_n].shard, packed_n, rows=(r, r + 1))
    scale = reader.get(infos[scale_n].shard, scale_n, rows=(r, r + 1))
    # compressed-tensors stores the quantize-direction global scale, ModelOpt its reciprocal
    glob = writer.nvfp4_global_scale(reader.get(infos[scalar_n].shard, scalar_n))
    nan_bytes = sum(int((scale.view(torch.uint8) == b).sum()) for b in _NAN_E4M3)
    g = glob.item()
    if nan_bytes or not (g > 0 and g < float("inf")):
        rep.add("error", "sample", f"{name} row {r}: {nan_bytes} NaN block scale byte(s), global "
                f"scale {g}", tensor=name)
        return
    deq = dequantize_nvfp4(packed, scale, glob)
    if source is None:
        return
    ref = source.read_rows(name, r, r + 1).to(torch.float32)
    unit = (scale.to(torch.float32) / glob).repeat_interleave(16, dim=1)
    # saturation: where RTN rounded an e4m3 block scale down (up to half the value in the
    # subnormal range, 2^-9 steps), elements above 6 units were clipped to 6 units
    clipped = (ref.abs() - 6 * unit).clamp(min=0)
    bound = unit * (1 + 1e-5) + clipped + 1e-30
    ratio = ((deq - ref).abs() / bound).max().item()
    rep.worst = max(rep.worst, ratio)
    if ratio > 1:
        col = int(((deq - ref).abs() / bound).argmax())
        rep.add("error", "sample", f"{name} row {r} column {col}: dequantized "
                f"{deq[0, col].item():.6g} vs source {ref[0, col].item():.6g}, beyond the NVFP4 "
                f"rounding bound {bound[0, col].item():.3g}", tensor=name)


def verify(build: str | Path, src: str | Path | None = None, rows: int = 4) -> VerifyReport:
    """Verify a build folder (see the module docstring for every check).

    Args:
        build: the build folder. src: the source folder to compare against; default the
            path recorded in the manifest (skipped with a note when it is not there).
        rows: rows sampled per tensor (first, last and pseudo-random ones).

    Returns:
        :class:`VerifyReport`; ``ok`` is False on any error. Nothing is raised for a bad
        build: every problem is a finding.
    """
    build = Path(build)
    rep = VerifyReport(build)
    try:
        manifest = json.loads((build / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        ledger = has_ledger(build)
        rep.add("error", "files", f"{build} has no {MANIFEST_NAME}: not a finished build"
                + (" (a progress ledger is there: the conversion was interrupted; rerun it with "
                   "--resume)" if ledger else ""), key=MANIFEST_NAME)
        return rep
    except (OSError, ValueError) as e:
        rep.add("error", "files", f"{MANIFEST_NAME} is unreadable: {e}", key=MANIFEST_NAME)
        return rep
    _check_files(build, manifest, rep)
    infos = _check_headers(build, rep)
    try:
        writer = get_writer(manifest.get("options", {}).get("format", "compressed-tensors"))
    except ValueError as e:
        rep.add("error", "layout", f"manifest options.format: {e}", key="options.format")
        return rep
    _check_layout(writer, manifest, infos, rep)
    rep.findings += _engine_checks(build, manifest)
    src = Path(src) if src else find_recorded_source(build, manifest)
    if src is None and (manifest.get("source") or {}).get("path"):
        rep.add("info", "source", f"source {manifest['source']['path']} (the manifest's) is not "
                f"{source_places(build)}: samples checked for finite "
                "values only (--src SRC compares them with it)")
    source = _open_matching_source(src, manifest, rep) if src is not None else None
    try:
        _sample(build, writer, manifest, infos, source, rows, rep)
    finally:
        if source is not None:
            source.close()
    return rep
