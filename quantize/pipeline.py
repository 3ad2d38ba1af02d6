"""``convert()``: stream a checkpoint shard by shard from FP8 (or dense) to NVFP4.

Steps: open and validate the source -> decide every tensor -> per source shard, read lazily,
quantize, write one output shard atomically -> index, config, carried files -> manifest.
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
from formats.shards import write_shard_atomic
from formats.sources import Source, open_source
from quantize import __version__
from quantize.act_plan import calibration_record, input_amax_plan, kv_scale_tensors
from quantize.errors import CalibrationError, OutputError, SourceError
from quantize.kernels.act_scales import input_global_scale_from_amax
from quantize.kernels.nvfp4 import global_scale_from_amax, quantize_nvfp4
from quantize.kernels.scale_search import quantize_nvfp4_search
from quantize.memory import bound_allocator, release_freed_memory
from quantize.manifest import MANIFEST_NAME, PROGRESS_NAME, Ledger, fingerprint, write_manifest
from quantize.plan import Decision, module_of, plan_tensors
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
        return "\n".join(lines)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(device)


def _tied(config: dict) -> bool:
    return bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False)))


def _prepare_out(out: Path, resume: bool) -> None:
    if out.exists() and any(out.iterdir()) and not resume:
        raise OutputError(f"output folder {out} is not empty; pass --resume to continue a build "
                          "or choose another --out", key=str(out))
    out.mkdir(parents=True, exist_ok=True)


SCALE_METHODS = ("rtn", "mse", "mse-act")
"""Block-scale choice: round-to-nearest, least-squares search (``kernels.scale_search``), or
the search weighted by calibration activations (needs ``calibration``)."""


class _Quantizer:
    """Quantizes one logical tensor, sharing the global scale across its fused group."""

    def __init__(self, source: Source, decisions: dict[str, Decision], device: torch.device,
                 scales: str = "rtn", channel_weight: dict[str, torch.Tensor] | None = None):
        self.source, self.decisions, self.device = source, decisions, device
        self.scales, self.channel_weight = scales, channel_weight or {}
        self._amax: dict[str, torch.Tensor] = {}

    def _load(self, name: str) -> torch.Tensor:
        w = self.source.read(name).to(torch.float32)
        if not torch.isfinite(w).all():
            t = self.source.tensors[name]
            bad = int((~torch.isfinite(w)).sum())
            raise SourceError(f"tensor {name} in shard {t.shard} has {bad} NaN/Inf values "
                              "after dequantization; refusing to write a silent NaN",
                              tensor=name, shard=t.shard)
        self._amax[name] = w.abs().amax()
        return w

    def amax(self, name: str) -> torch.Tensor:
        if name not in self._amax:
            self._load(name)
        return self._amax[name]

    def __call__(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.decisions[name]
        w = self._load(name)
        names = [m + ".weight" for m in d.members] or [name]
        g = global_scale_from_amax(torch.stack([self.amax(n) for n in names]).amax())
        if self.scales == "rtn":
            packed, scale = quantize_nvfp4(w.to(self.device), g)
        else:
            cw = self.channel_weight.get(module_of(name)) if self.scales == "mse-act" else None
            packed, scale = quantize_nvfp4_search(w.to(self.device), g, channel_weight=cw)
        return packed.cpu(), scale.cpu(), g


@dataclass
class _Calibration:
    stats: "CalibStats | None"
    sha256: str | None
    min_tokens: int
    notes: list[str]


def _calibration(path, scheme: str, kv_cache: str | None, scales: str,
                 min_tokens: int | None) -> _Calibration:
    """Load and check the calibration options together, before any work."""
    if scheme not in ("w4a16", "w4a4"):
        raise ValueError(f"unknown scheme {scheme!r} (valid: w4a16, w4a4)")
    if scales not in SCALE_METHODS:
        raise ValueError(f"unknown --scales {scales!r} (valid: {', '.join(SCALE_METHODS)})")
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


def convert(src: str | Path, out: str | Path, *, scheme: str = "w4a16",
            fmt: str = "compressed-tensors", recipe: str = "weight-only", device: str = "auto",
            resume: bool = False, progress: bool = True, source_info: dict | None = None,
            calibration: "str | Path | None" = None, kv_cache: str | None = None,
            scales: str = "rtn", min_expert_tokens: int | None = None) -> Summary:
    """Convert the checkpoint folder ``src`` into an NVFP4 build in ``out``.

    Args:
        src: folder with config.json and safetensors shards (block FP8, compressed-tensors
            FP8, or dense).
        out: output folder; must be empty unless ``resume``.
        scheme: ``w4a16`` (weight-only NVFP4) or ``w4a4`` (NVFP4 activations too: needs
            ``calibration``; writes each module's input global scale, shared in a fused group).
        fmt: output layout, see ``formats.OutputFormat``.
        recipe: preset name or TOML path (``quantize.recipe``).
        device: ``cpu``, ``cuda`` or ``auto``.
        resume: skip output shards the ledger records as finished (sha256 checked); the
            final folder is byte-identical to an uninterrupted run.
        source_info: extra provenance (repo id, revision) recorded in the manifest.
        calibration: a stats folder from ``quantize calibrate`` (``calibrate.stats``).
        kv_cache: ``fp8`` declares an FP8 KV cache; with ``calibration`` the k/v scales
            (amax / 448) are written per attention block, else engines use 1.0.
        scales: one of :data:`SCALE_METHODS`.
        min_expert_tokens: routed experts with fewer calibration tokens take the layer's max
            over experts as input amax and are listed in the manifest (default 8).

    Returns:
        Summary of the run.

    Raises:
        SourceError, RecipeError, OutputError, CalibrationError, ValueError: with the tensor,
            shard or key named.
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    source = open_source(src)
    rec = load_recipe(recipe)
    writer = get_writer(fmt)
    dev = _resolve_device(device)
    decisions = plan_tensors(source, rec)
    calib = _calibration(calibration, scheme, kv_cache, scales, min_expert_tokens)
    input_amax = input_amax_plan(decisions, calib.stats, calib.min_tokens) if scheme == "w4a4" else {}
    kv_tensors = (kv_scale_tensors(source, calib.stats, writer, _model_dtype(source.config))
                  if kv_cache and calib.stats else {})
    notes = list(calib.notes)
    skip = set()
    if _tied(source.config) and "lm_head.weight" in source.tensors:
        skip.add("lm_head.weight")
        notes.append("lm_head.weight dropped: tie_word_embeddings is true, the loader uses "
                     "embed_tokens (FC-23)")
    if source.dropped:
        notes.append(f"dropped {len(source.dropped)} FP8 activation/KV sidecars "
                     f"(e.g. {source.dropped[0]})")
    for d in decisions.values():
        if d.reason.startswith(("K=", "fused group")):
            notes.append(f"{d.name} kept as {d.target.value}: {d.reason}")
    headers = {n: [i.shard, i.dtype, list(i.shape)] for n, i in source.infos.items()}
    options = {"scheme": scheme, "format": fmt, "recipe": rec.name, "recipe_sha256": rec.sha256}
    if calib.stats is not None or kv_cache or scales != "rtn":
        options.update(kv_cache=kv_cache, scales=scales, calibration_sha256=calib.sha256)
    job = fingerprint({"tool": __version__, "options": options, "headers": headers,
                       "decisions": {n: d.target.value for n, d in decisions.items()}})
    _prepare_out(out, resume)
    bound_allocator()
    ledger = Ledger(out, job, resume)
    quant = _Quantizer(source, decisions, dev, scales,
                       calib.stats.channel_sq_mean if calib.stats else None)
    written, skipped, out_shards = 0, 0, []
    bytes_in = sum(i.nbytes for i in source.infos.values())
    counts = Counter(d.target.value for n, d in decisions.items() if n not in skip)
    elements = 0
    bar = tqdm(total=bytes_in, unit="B", unit_scale=True, desc="convert", disable=not progress)
    for shard in source.shards:
        members = [t for t in source.tensors_in(shard) if t.name not in skip]
        shard_bytes = sum(i.nbytes for i in source.infos.values() if i.shard == shard)
        if not members:
            bar.update(shard_bytes)
            continue
        out_shards.append(shard)
        if ledger.is_done(shard):
            skipped += 1
            bar.update(shard_bytes)
            continue
        bar.set_postfix_str(shard)
        tensors: dict[str, torch.Tensor] = {}
        for t in members:
            d = decisions[t.name]
            if d.target is Target.NVFP4:
                packed, scale, g = quant(t.name)
                mod = module_of(t.name)
                ig = input_global_scale_from_amax(input_amax[mod]) if input_amax else None
                tensors.update(writer.emit_nvfp4(mod, packed, scale, g, ig))
                elements += t.numel
            elif d.target is Target.BF16:
                tensors[t.name] = source.read(t.name).to(torch.bfloat16)
            else:
                tensors[t.name] = source.read(t.name)
        tensors.update(kv_tensors.get(shard, {}))
        write_shard_atomic(tensors, out / shard)
        del tensors
        release_freed_memory()
        ledger.mark(shard)
        written += 1
        bar.update(shard_bytes)
    bar.close()
    source.close()

    index = write_index(out, out_shards)
    ignore = sorted({module_of(n) for n, d in decisions.items()
                     if n not in skip and d.target is not Target.NVFP4 and module_of(n)})
    if _tied(source.config) and "lm_head" not in ignore:
        ignore.append("lm_head")  # the tied head is the unquantized embedding
    config = json.loads(json.dumps(source.config))
    (config.get("text_config") or {}).pop("quantization_config", None)
    config["quantization_config"] = writer.quantization_config(sorted(ignore), scheme, kv_cache)
    write_json_atomic(config, out / "config.json")
    carried = carry_files(src, out, skip={"config.json", MANIFEST_NAME, PROGRESS_NAME})
    summary = Summary(out, dict(counts), bytes_in, index["metadata"]["total_size"], elements,
                      time.perf_counter() - t0, written, skipped, sorted(ignore), notes)
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
