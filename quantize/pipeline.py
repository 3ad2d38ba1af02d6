"""``convert()``: stream a checkpoint shard by shard from FP8 (or dense) to NVFP4.

Steps: pre-flight (``quantize.preflight``: the source, a folder or a Hub repo whose shards
``quantize.hub`` fetches on first read and deletes after their last, checked whole with every
finding at once; every tensor decided by ``quantize.plan``, recipe, TP / engine alignment; the
output folder and its free disk) -> per source shard, read lazily, refuse NaN / Inf / absurd
amax, quantize (NVFP4 in the output format's arithmetic order, block FP8 passed through,
MXFP8), check the shard against the planned layout, write it atomically -> index, carried
files, config (+ hf_quant_config.json for ModelOpt) -> ``quantize check`` -> manifest (only
when the check has no error). Calibration statistics (``quantize calibrate``) add W4A4 input
scales and FP8 KV scales, and weight the block-scale search (``--scales``).
Peak memory is one output shard plus the tensors of one fused group, whatever the model size.
"""

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from calibrate.stats import DEFAULT_MIN_TOKENS, STATS_FILE, CalibStats
from formats import get_writer
from formats.checkpoint import INDEX_NAME, carry_files, write_index, write_json_atomic
from formats.shards import discard, dtype_name, is_temp_name, write_shard_atomic
from formats.sources import Source
from quantize import __version__
from quantize.act_plan import calibration_record, input_amax_plan, kv_scale_tensors
from quantize.errors import CalibrationError, CheckFailed, OutputError, SourceError
from quantize.kernels.act_scales import input_global_scale_from_amax, input_scale_from_amax
from quantize.kernels.fp8 import quantize_fp8_block
from quantize.kernels.mxfp8 import quantize_mxfp8
from quantize.kernels.nvfp4 import (global_scale_from_amax, quantize_nvfp4, quantize_nvfp4_scale2,
                                    scale_2_from_amax)
from quantize.kernels.scale_search import quantize_nvfp4_search
from quantize.memory import bound_allocator, release_freed_memory
from quantize.manifest import MANIFEST_NAME, PROGRESS_NAME, Ledger, fingerprint, write_manifest
from quantize.plan import (Decision, dropped_tensors, fp8_passthrough, module_of, predict_outputs,
                           tied_embeddings)
from quantize.preflight import ABSURD_AMAX, MIN_AMAX, preflight
from quantize.recipe import Target, load_recipe

__all__ = ["Summary", "convert"]

@dataclass
class Summary:
    """What a conversion did. Bytes are tensor bytes; seconds wall time of this run."""

    out: Path
    tensors_by_target: dict[str, int]
    bytes_in: int
    bytes_out: int
    elements_quantized: int
    seconds: float
    shards_written: int
    shards_skipped: int
    ignore: list[str]
    notes: list[str] = field(default_factory=list)
    findings: list = field(default_factory=list)

    @property
    def gelem_per_s(self) -> float:
        return self.elements_quantized / max(self.seconds, 1e-9) / 1e9

    def render(self) -> str:
        by = ", ".join(f"{k} {v}" for k, v in sorted(self.tensors_by_target.items()))
        lines = [f"wrote {self.out}",
                 f"  tensors: {by}",
                 f"  bytes: {self.bytes_in / 2**20:.1f} MiB in -> {self.bytes_out / 2**20:.1f} MiB out",
                 f"  shards: {self.shards_written} written, {self.shards_skipped} resumed",
                 f"  time: {self.seconds:.1f} s, {self.gelem_per_s:.3f} G elements/s quantized",
                 f"  ignore: {len(self.ignore)} modules left unquantized"]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  check: {f.render()}" for f in self.findings]
        return "\n".join(lines)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device (cpu, cuda, cuda:N or auto)") from None


_CARRY_SKIP = frozenset({"config.json", MANIFEST_NAME, PROGRESS_NAME, "hf_quant_config.json"})


def _prepare_out(out: Path, resume: bool) -> None:
    """Create ``out`` (pre-flight has checked it); on resume, before any shard is touched,
    remove the files that mark a build complete and the temp files a killed run left (never
    complete files: every write goes through a temp name and a rename)."""
    if resume and out.is_dir():
        for name in (MANIFEST_NAME, INDEX_NAME, "config.json"):
            (out / name).unlink(missing_ok=True)
        for p in out.rglob("*"):
            if p.is_file() and is_temp_name(p.name):
                discard(p)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create --out {out}: {e}", key=str(out)) from None


def _checked_amax(name: str, t: torch.Tensor, source: Source, nvfp4: bool) -> float | None:
    """amax of a float tensor about to be written or quantized, after the value checks;
    None for non-float tensors.

    Raises:
        SourceError: NaN / Inf values (never a silent NaN in a build; FP8 after
            dequantization); for an NVFP4 target, an amax above ``ABSURD_AMAX`` or a non-zero
            amax below ``MIN_AMAX``.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return None
    info = source.tensors[name]
    amax = t.abs().amax().float().item()  # NaN and Inf propagate through amax
    if amax != amax or amax == float("inf"):
        what = " after dequantization" if info.is_fp8 else ""
        bad = int((~torch.isfinite(t)).sum())
        raise SourceError(f"tensor {name} in shard {info.shard} has {bad} NaN/Inf values{what}; "
                          "refusing to write a silent NaN", tensor=name, shard=info.shard)
    if nvfp4 and (amax > ABSURD_AMAX or 0 < amax < MIN_AMAX):
        raise SourceError(
            f"tensor {name} in shard {info.shard} has amax {amax:.3g}, outside [{MIN_AMAX:.2g}, "
            f"{ABSURD_AMAX:g}] where an NVFP4 global scale 2688/amax is meaningful: a corrupt "
            f"weight. To carry it unquantized instead, add a recipe rule matching "
            f"{module_of(name)} with target bf16", tensor=name, shard=info.shard)
    return amax


def _set_tie(config: dict, value: bool) -> None:
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict) and "tie_word_embeddings" in cfg:
            cfg["tie_word_embeddings"] = value


def _source_deps(source: Source, decisions: dict[str, Decision], shard: str) -> dict[str, list]:
    """Identity (``ShardFiles.identity``: size and mtime_ns, or size and sha256 for a Hub
    source) of every source shard the output ``shard`` is computed from: its own tensors, their
    FP8 scales and their fused-group partners."""
    files = {shard}
    for t in source.tensors_in(shard):
        names = [m + ".weight" for m in decisions[t.name].members] or [t.name]
        for n in names:
            lt = source.tensors.get(n)
            if lt is not None:
                files.add(lt.shard)
                if lt.scale is not None:
                    files.add(lt.scale.shard)
    return {f: source.files.identity(f) for f in sorted(files)}


SCALE_METHODS = ("rtn", "mse", "mse-act")
"""Block-scale choice: round-to-nearest, least-squares search (``kernels.scale_search``), or
the search weighted by calibration activations (needs ``calibration``)."""


def _check_scale_method(scales: str, order: str) -> None:
    """The block-scale search runs in compressed-tensors' arithmetic order only.

    Raises:
        ValueError: unknown method, or a search asked for a ModelOpt (``scale_2``) build.
    """
    if scales not in SCALE_METHODS:
        raise ValueError(f"unknown --scales {scales!r} (valid: {', '.join(SCALE_METHODS)})")
    if scales != "rtn" and order != "global":
        raise ValueError(f"--scales {scales} searches block scales in compressed-tensors' arithmetic "
                         f"order (quantize-direction global scale); the {order!r} order of this output "
                         "format (ModelOpt) is not supported by the search yet: use --scales rtn or "
                         "--format compressed-tensors")


class _Quantizer:
    """Quantizes one logical tensor, sharing the global scale across its fused group.

    NVFP4 uses the output format's arithmetic order (``writer.NVFP4_ORDER``): the
    compressed-tensors quantize-direction global scale, or ModelOpt's dequant-direction
    ``scale_2``; both scalars come from the same fused-group amax. ``known_amax`` holds the
    amax values an interrupted run already measured (from the resume ledger). ``scales``
    (:data:`SCALE_METHODS`) picks round-to-nearest block scales or the least-error search,
    weighted per input channel by ``channel_weight[module]`` for ``mse-act``.

    Raises:
        ValueError: from :func:`_check_scale_method`.
    """

    def __init__(self, source: Source, decisions: dict[str, Decision], device: torch.device,
                 order: str = "global", known_amax: dict[str, float] | None = None,
                 scales: str = "rtn", channel_weight: dict[str, torch.Tensor] | None = None):
        _check_scale_method(scales, order)
        self.source, self.decisions, self.device, self.order = source, decisions, device, order
        self.scales, self.channel_weight = scales, channel_weight or {}
        self._amax = {n: torch.tensor(v, dtype=torch.float32) for n, v in (known_amax or {}).items()}

    def amaxes(self) -> dict[str, dict]:
        """Every amax seen so far, by source shard with that shard's identity (for the ledger)."""
        out: dict[str, dict] = {}
        for n, a in self._amax.items():
            shard = self.source.tensors[n].shard
            if shard not in out:
                out[shard] = {"id": self.source.files.identity(shard), "values": {}}
            out[shard]["values"][n] = float(a)
        return out

    def _load(self, name: str, nvfp4: bool = False) -> torch.Tensor:
        w = self.source.read(name).to(torch.float32)
        self._amax[name] = torch.tensor(_checked_amax(name, w, self.source, nvfp4) or 0.0)
        return w

    def amax(self, name: str) -> torch.Tensor:
        if name not in self._amax:
            self._load(name, nvfp4=True)
        return self._amax[name]

    def __call__(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.decisions[name]
        w = self._load(name, nvfp4=True)
        names = [m + ".weight" for m in d.members] or [name]
        amax = torch.stack([self.amax(n) for n in names]).amax()
        g, s2 = global_scale_from_amax(amax), scale_2_from_amax(amax)
        if self.order == "scale_2":
            packed, scale = quantize_nvfp4_scale2(w.to(self.device), s2)
        elif self.scales == "rtn":
            packed, scale = quantize_nvfp4(w.to(self.device), g)
        else:
            cw = self.channel_weight.get(module_of(name)) if self.scales == "mse-act" else None
            packed, scale = quantize_nvfp4_search(w.to(self.device), g, channel_weight=cw)
        return packed.cpu(), scale.cpu(), g, s2

    def fp8_block(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """128x128 block FP8: the source bytes and scale untouched when stored that way,
        else quantized from the fp32 read (DeepSeek convention, scale = block amax / 448)."""
        scale = fp8_passthrough(self.source, name)
        if scale is not None:
            return self.source.read_raw(name), self.source.read_raw(scale.name)
        return quantize_fp8_block(self._load(name))

    def mxfp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_mxfp8(self._load(name))


@dataclass
class _Calibration:
    stats: "CalibStats | None"
    sha256: str | None
    min_tokens: int
    notes: list[str]


def _calibration(path, scheme: str, kv_cache: str | None, scales: str, order: str,
                 min_tokens: int | None) -> _Calibration:
    """Load and check the calibration options together, before any work."""
    if scheme not in ("w4a16", "w4a4"):
        raise ValueError(f"unknown scheme {scheme!r} (valid: w4a16, w4a4)")
    _check_scale_method(scales, order)
    if kv_cache not in (None, "fp8"):
        raise ValueError(f"unknown --kv-cache {kv_cache!r} (valid: fp8)")
    need = [why for why, on in (("--scheme w4a4", scheme == "w4a4"), ("--scales mse-act", scales == "mse-act"))
            if on]
    min_tokens = DEFAULT_MIN_TOKENS if min_tokens is None else min_tokens
    if path is None:
        if need:
            raise CalibrationError(f"{need[0]} needs --calibration STATS (run `quantize calibrate` first)")
        notes = ["FP8 KV cache declared without calibration: engines use k/v scales of 1.0"] if kv_cache else []
        return _Calibration(None, None, min_tokens, notes)
    stats = CalibStats.load(path)
    if scales == "mse-act" and not stats.channel_sq_mean:
        raise CalibrationError(f"--scales mse-act needs channel statistics; {path} has none "
                               "(recalibrate without --no-channels)")
    p = Path(path)
    digest = fingerprint({"json": (p / STATS_FILE if p.is_dir() else p).read_text()})
    notes = []
    bad = stats.uncovered_experts(min_tokens)
    if bad and scheme == "w4a4":
        notes.append(f"{len(bad)} routed expert(s) saw fewer than {min_tokens} calibration tokens and use "
                     "the layer's max input amax over experts (listed in the manifest)")
    return _Calibration(stats, digest, min_tokens, notes)


def _model_dtype(config: dict) -> torch.dtype:
    """The checkpoint's declared dtype (``torch_dtype`` / ``dtype``), bfloat16 by default."""
    cfg = config.get("text_config") or config
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return {"float32": torch.float32, "float16": torch.float16}.get(name, torch.bfloat16)


def _assert_predicted(tensors: dict[str, torch.Tensor], predicted: dict[str, tuple], shard: str) -> None:
    """What is about to be written equals the plan's prediction (names, dtypes, shapes), so
    ``recipe show`` / fit planning sizes are exact by construction."""
    got = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
    want = {n: (d, tuple(s)) for n, (d, s) in predicted.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:5]
        raise OutputError(f"internal: shard {shard} does not match the planned layout: {diff}", shard=shard)


def convert(src: str | Path | Source, out: str | Path, *, scheme: str = "w4a16",
            fmt: str = "compressed-tensors", recipe: str = "weight-only", device: str = "auto",
            resume: bool = False, progress: bool = True, source_info: dict | None = None,
            tp: int = 1, engine: str = "vllm", calibration: "str | Path | None" = None,
            kv_cache: str | None = None, scales: str = "rtn",
            min_expert_tokens: int | None = None) -> Summary:
    """Convert the checkpoint folder ``src`` into an NVFP4 build in ``out``.

    Args:
        src: folder with config.json and safetensors shards (block FP8, compressed-tensors
            FP8, or dense), or an opened ``Source`` (``quantize.hub`` streams one from the Hub).
        out: output folder; must be empty unless ``resume``.
        scheme: ``w4a16`` (weight-only NVFP4) or ``w4a4`` (NVFP4 activations too: needs
            ``calibration``; writes each module's input scale, shared in a fused group).
        fmt: output layout, see ``formats.OutputFormat``.
        recipe: preset name or TOML path (``quantize.recipe``).
        device: ``cpu``, ``cuda`` or ``auto``.
        tp: tensor-parallel size the build is for; tensors whose per-shard shape breaks the
            engine's alignment rules are kept in high precision and listed in the notes.
        engine: ``vllm``, ``sglang`` or ``trtllm``: whose rules the plan and the final
            ``quantize check`` apply.
        resume: skip output shards the ledger records as finished (sha256 checked); the
            final folder is byte-identical to an uninterrupted run.
        source_info: extra provenance (repo id, commit, file hashes) recorded in the manifest
            and part of the resume fingerprint.
        calibration: a stats folder from ``quantize calibrate`` (``calibrate.stats``).
        kv_cache: ``fp8`` declares an FP8 KV cache; with ``calibration`` the k/v scales
            (amax / 448) are written per attention block, else engines use 1.0.
        scales: one of :data:`SCALE_METHODS` (the searches need the compressed-tensors format).
        min_expert_tokens: routed experts with fewer calibration tokens take the layer's max
            over experts as input amax and are listed in the manifest (default 8).

    Returns:
        Summary of the run.

    Raises:
        SourceError, RecipeError, OutputError, CalibrationError, ValueError: with the tensor,
            shard or key named;
            OutputError also when the free disk cannot hold the rest of the build.
        CheckFailed: ``quantize check`` found errors in the written build (no manifest is
            written, so the folder is not a finished build).
    """
    t0 = time.perf_counter()
    out = Path(out)
    rec = load_recipe(recipe)
    writer = get_writer(fmt)
    dev = _resolve_device(device)
    pre = preflight(src, out, recipe=rec, resume=resume, fmt=fmt, tp=tp, engine=engine,
                    carry_skip=_CARRY_SKIP)
    pre.raise_if_errors(Path(src).name if not isinstance(src, Source) else src.folder.name)
    source, decisions = pre.source, pre.decisions
    src = source.folder
    calib = _calibration(calibration, scheme, kv_cache, scales, writer.NVFP4_ORDER, min_expert_tokens)
    input_amax = input_amax_plan(decisions, calib.stats, calib.min_tokens) if scheme == "w4a4" else {}
    kv_dtype = _model_dtype(source.config)
    kv_tensors = kv_scale_tensors(source, calib.stats, writer, kv_dtype) if kv_cache and calib.stats else {}
    predicted = predict_outputs(source, decisions, fmt, scheme=scheme, kv_scales={
        attn: dtype_name(kv_dtype) for attn in (calib.stats.kv_amax if kv_tensors else {})})
    notes = [f"{f.level}: {f.message}" for f in pre.findings] + list(calib.notes)
    skip = dropped_tensors(source)
    tied = tied_embeddings(source.config)
    if skip:
        notes.append("lm_head.weight dropped: tie_word_embeddings is true and it equals "
                     "embed_tokens bit for bit (FC-23)")
    elif tied and "lm_head.weight" in source.tensors:
        tied = False
        notes.append("lm_head.weight differs from embed_tokens although tie_word_embeddings "
                     "is true: kept, and the flag set false (FC-23)")
    if source.dropped:
        notes.append(f"dropped {len(source.dropped)} FP8 activation/KV sidecars "
                     f"(e.g. {source.dropped[0]})")
    for d in decisions.values():
        if not d.reason.startswith(("recipe ", "sensitive:", "not a Linear")):
            notes.append(f"{d.name} kept as {d.target.value}: {d.reason}")
    headers = {n: [i.shard, i.dtype, list(i.shape)] for n, i in source.infos.items()}
    options = {"scheme": scheme, "format": fmt, "recipe": rec.name, "recipe_sha256": rec.sha256,
               "tp": tp, "engine": engine}
    if calib.stats is not None or kv_cache or scales != "rtn":
        options.update(kv_cache=kv_cache, scales=scales, calibration_sha256=calib.sha256)
    job = fingerprint({"tool": __version__, "options": options, "headers": headers,
                       "decisions": {n: d.target.value for n, d in decisions.items()},
                       "source": source_info or {}})
    _prepare_out(out, resume)
    bound_allocator()
    ledger = Ledger(out, job, resume)
    quant = _Quantizer(source, decisions, dev, writer.NVFP4_ORDER,
                       ledger.known_amax(source.files.identity), scales,
                       calib.stats.channel_sq_mean if calib.stats else None)
    written, skipped, out_shards = 0, 0, []
    bytes_in = sum(i.nbytes for i in source.infos.values())
    counts = Counter(d.target.value for n, d in decisions.items() if n not in skip)
    elements = 0
    bar = tqdm(total=bytes_in, unit="B", unit_scale=True, desc="convert", disable=not progress)
    for shard in source.stream():
        members = [t for t in source.tensors_in(shard) if t.name not in skip]
        shard_bytes = sum(i.nbytes for i in source.infos.values() if i.shard == shard)
        if not members:
            bar.update(shard_bytes)
            continue
        out_shards.append(shard)
        deps = _source_deps(source, decisions, shard)
        if ledger.is_done(shard, deps):
            skipped += 1
            bar.update(shard_bytes)
            continue
        bar.set_postfix_str(shard)
        tensors: dict[str, torch.Tensor] = {}
        stats: dict = {}
        for t in members:
            d = decisions[t.name]
            if d.target is Target.NVFP4:
                packed, scale, g, s2 = quant(t.name)
                mod = module_of(t.name)
                a_in = input_amax.get(mod)
                tensors.update(writer.emit_nvfp4(
                    mod, packed, scale, g, s2,
                    input_global_scale=input_global_scale_from_amax(a_in) if a_in is not None else None,
                    input_scale=input_scale_from_amax(a_in) if a_in is not None else None))
                _shard_stats(stats, t.name, quant.amax(t.name).item(), scale)
                elements += t.numel
            elif d.target is Target.FP8_BLOCK:
                tensors.update(writer.emit_fp8_block(module_of(t.name), *quant.fp8_block(t.name)))
                elements += t.numel
            elif d.target is Target.MXFP8:
                tensors.update(writer.emit_mxfp8(module_of(t.name), *quant.mxfp8(t.name)))
                elements += t.numel
            else:
                x = source.read(t.name)
                x = x.to(torch.bfloat16) if d.target is Target.BF16 else x
                amax = _checked_amax(t.name, x, source, nvfp4=False)
                _shard_stats(stats, t.name, amax if x.ndim == 2 else None)
                tensors[t.name] = x
            tensors.update(kv_tensors.get(t.name, {}))
        _assert_predicted(tensors, {k: v for t in members for k, v in predicted[t.name].items()}, shard)
        write_shard_atomic(tensors, out / shard)
        del tensors
        release_freed_memory()
        ledger.mark(shard, deps, quant.amaxes(), stats)
        written += 1
        bar.update(shard_bytes)
    bar.close()
    source.close()

    notes += _data_notes([ledger.stats(s) for s in out_shards])
    index = write_index(out, out_shards)
    linear = {n: d for n, d in decisions.items()
              if n not in skip and module_of(n) and len(source.tensors[n].shape) == 2}
    targets = {module_of(n): d.target.value for n, d in linear.items() if d.target.quantized}
    ignore = sorted({module_of(n) for n, d in linear.items() if not d.target.quantized})
    if tied and "lm_head" not in ignore:
        ignore.append("lm_head")  # the tied head is the unquantized embedding
    config = json.loads(json.dumps(source.config))
    if tied_embeddings(source.config) and not tied:
        _set_tie(config, False)
    (config.get("text_config") or {}).pop("quantization_config", None)
    producer = {"name": "spark-quant", "version": __version__}
    config["quantization_config"] = writer.quantization_config(targets, sorted(ignore), scheme, producer,
                                                               kv_cache)
    # config.json after the carried files: weights + config without the tokenizer never look
    # like a loadable folder.
    carried = carry_files(src, out, skip=set(_CARRY_SKIP))
    for fname, obj in writer.extra_files(targets, sorted(ignore), scheme, producer, kv_cache).items():
        write_json_atomic(obj, out / fname)
    write_json_atomic(config, out / "config.json")
    from quantize.check import check_build  # the check reads only what was written

    findings = check_build(out, engine=engine, tp=tp)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise CheckFailed(f"quantize check found {len(errors)} error(s) in {out} (no manifest "
                          "written):\n  " + "\n  ".join(f.render() for f in errors[:20]),
                          tensor=errors[0].tensor, key=errors[0].rule)
    summary = Summary(out, dict(counts), bytes_in, index["metadata"]["total_size"], elements,
                      time.perf_counter() - t0, written, skipped, sorted(ignore), notes, findings)
    write_manifest(out, {
        "tool": "spark-quant", "version": __version__,
        "source": {"path": str(src.resolve()), "layout": source.kind.value,
                   "shards": {s: fingerprint({n: h for n, h in headers.items() if h[0] == s})
                              for s in source.shards}, **(source_info or {})},
        "options": options,
        "targets": {n: d.target.value for n, d in sorted(decisions.items()) if n not in skip},
        "summary": {"tensors_by_target": dict(sorted(counts.items())), "bytes_in": bytes_in,
                    "bytes_out": summary.bytes_out, "ignore": sorted(ignore), "notes": notes,
                    "carried_files": carried},
        **({"calibration": calibration_record(calib.stats, calib.sha256, calib.min_tokens)}
           if calib.stats is not None else {}),
    })
    ledger.finish()
    return summary


def _shard_stats(stats: dict, name: str, amax: float | None,
                 block_scale: torch.Tensor | None = None) -> None:
    """Record data findings of one written tensor in its shard's ``stats``: an all-zero
    weight, and NVFP4 block scales at the e4m3 floor 2^-9 (byte 0x01, FC-11b)."""
    if amax == 0.0 and name.endswith(".weight"):
        stats.setdefault("zero", []).append(name)
    if block_scale is not None:
        floor = int((block_scale.view(torch.uint8) == 1).sum())
        if floor:
            stats["floor_blocks"] = stats.get("floor_blocks", 0) + floor
            stats["floor_tensors"] = stats.get("floor_tensors", 0) + 1


def _data_notes(stats: list[dict]) -> list[str]:
    """Summary notes from the per-shard stats of every output shard (finished in this run or
    an earlier one), so a resumed build reports what an uninterrupted one does."""
    zero = [n for s in stats for n in s.get("zero", [])]
    blocks = sum(s.get("floor_blocks", 0) for s in stats)
    tensors = sum(s.get("floor_tensors", 0) for s in stats)
    notes = []
    if zero:
        notes.append(f"{len(zero)} all-zero weight(s) written as exact zeros (NVFP4: all codes 0, "
                     f"block scales 0.125; global scale 1.0 unless shared with a fused group): "
                     f"{', '.join(zero[:5])}{' ...' if len(zero) > 5 else ''}")
    if blocks:
        notes.append(f"{blocks} NVFP4 block scale(s) in {tensors} tensor(s) at the e4m3 floor "
                     "2^-9 (blocks far below their tensor's amax; kept non-zero, FC-11b)")
    return notes
