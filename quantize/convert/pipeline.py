"""``convert()``: stream a checkpoint shard by shard from FP8 (or dense) to NVFP4.

Steps: pre-flight (``quantize.inspect.preflight``: the source, a folder or a Hub repo whose shards
``quantize.hub.download`` fetches on first read and deletes after their last, checked whole with every
finding at once; every tensor decided by ``quantize.plan.tensors``, recipe, TP / engine alignment; the
output folder and its free disk) -> per source shard, read lazily, refuse NaN / Inf / absurd
amax, quantize (NVFP4 in the output format's arithmetic order, block FP8 passed through,
MXFP8), check the shard against the planned layout, write it atomically -> index, carried
files, config (+ hf_quant_config.json for ModelOpt) -> ``quantize check`` -> manifest (only
when the check has no error). Calibration statistics (``quantize calibrate``) add W4A4 input
scales and FP8 KV scales, and weight the block-scale search (``--scales``).
Reading, quantizing and writing overlap (``quantize.convert.overlap``: a reader thread, this thread, a
writer thread), NVFP4 goes through the fused kernels of ``quantize.kernels.fused`` (the
block-scale search through the reference arithmetic), and shards can be divided among
processes or torchrun ranks (``quantize.convert.parallel``). Large source tensors are read with
O_DIRECT and written shards leave the page cache once on disk (``formats.shards``): one pass
over the checkpoint gains nothing from the cache, and filling it was the largest CPU cost on
a small machine. Peak memory is a few output shards (being built, queued, being written, and
freed memory kept for the next ones) plus a few prepared tensors and one fused group,
whatever the model size.
"""

import json
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from formats import SCHEMES, get_writer
from formats.calib_stats import DEFAULT_MIN_TOKENS, STATS_FILE, CalibStats
from formats.checkpoint import INDEX_NAME, carry_files, write_index, write_json_atomic
from formats.manifest import (
    MANIFEST_NAME,
    PROGRESS_NAME,
    Ledger,
    fingerprint,
    remove_ledgers,
    write_manifest,
)
from formats.shards import (
    DTYPE_BYTES,
    discard,
    dtype_name,
    is_temp_name,
    write_shard_atomic,
)
from formats.sources import ShardFiles, Source, describe_dropped
from quantize import __version__, archs
from quantize.base.errors import CalibrationError, CheckFailed, OutputError, SourceError
from quantize.base.memory import (
    CONVERT_MMAP_THRESHOLD,
    bound_allocator,
    release_freed_memory,
)
from quantize.convert.overlap import Consumer, Producer, StageClock
from quantize.convert.parallel import World, assign_shards, current_world, spawn_local
from quantize.inspect.preflight import ABSURD_AMAX, MIN_AMAX, preflight
from quantize.kernels import SCALE_METHODS
from quantize.kernels.act_scales import (
    input_global_scale_from_amax,
    input_scale_from_amax,
)
from quantize.kernels.dtypes import count_bytes
from quantize.kernels.fp8 import quantize_fp8_block
from quantize.kernels.fused import Prepared, choose_backend, prepare_float, prepare_fp8
from quantize.kernels.mxfp8 import quantize_mxfp8
from quantize.kernels.nvfp4 import global_scale_from_amax, scale_2_from_amax
from quantize.kernels.scale_search import quantize_nvfp4_search
from quantize.plan.activations import (
    calibration_record,
    input_amax_plan,
    kv_scale_tensors,
)
from quantize.plan.recipe import Target, load_recipe
from quantize.plan.tensors import (
    Decision,
    dropped_tensors,
    fp8_passthrough,
    module_of,
    predict_outputs,
    tied_embeddings,
    unplaced_note,
)

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
    stage_seconds: dict[str, float] = field(default_factory=dict)  # quantize.convert.overlap.StageClock
    stage_cpu_seconds: dict[str, float] = field(default_factory=dict)

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
        from quantize.inspect.check import render_check

        lines += [f"  check: {render_check(f)}" for f in self.findings]
        return "\n".join(lines)


def _resolve_device(device: str, world: World) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device (cpu, cuda, cuda:N or auto)") from None
    if dev.type == "cuda" and dev.index is None and world.size > 1:
        local = int(os.environ.get("LOCAL_RANK", world.rank))
        dev = torch.device("cuda", local % torch.cuda.device_count())
    return dev


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
    """amax of a float tensor about to be written or quantized, after the value checks
    (:func:`_refuse_amax`); None for non-float tensors."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    amax = t.abs().amax().float().item()  # NaN and Inf propagate through amax
    _refuse_amax(name, amax, source, nvfp4, lambda: t)
    return amax


def _refuse_amax(name: str, amax: float, source: Source, nvfp4: bool, values) -> None:
    """Refuse a tensor by its ``amax`` (max |w|, as a fast kernel or the reference measured
    it); ``values()`` gives the tensor, read only to count the NaN / Inf in the message.

    Raises:
        SourceError: NaN / Inf values (never a silent NaN in a build; FP8 after
            dequantization); for an NVFP4 target, an amax above ``ABSURD_AMAX`` or a non-zero
            amax below ``MIN_AMAX``.
    """
    info = source.tensors[name]
    if amax != amax or amax == float("inf"):
        what = " after dequantization" if info.is_fp8 else ""
        bad = int((~torch.isfinite(values())).sum())
        raise SourceError(f"tensor {name} in shard {info.shard} has {bad} NaN/Inf values{what}; "
                          "refusing to write a silent NaN", tensor=name, shard=info.shard)
    if nvfp4 and (amax > ABSURD_AMAX or 0 < amax < MIN_AMAX):
        raise SourceError(
            f"tensor {name} in shard {info.shard} has amax {amax:.3g}, outside [{MIN_AMAX:.2g}, "
            f"{ABSURD_AMAX:g}] where an NVFP4 global scale 2688/amax is meaningful: a corrupt "
            f"weight. To carry it unquantized instead, add a recipe rule matching "
            f"{module_of(name)} with target bf16", tensor=name, shard=info.shard)


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


@dataclass
class _Job:
    """Everything decided before any tensor data is read; the same on every rank."""

    source: Source
    decisions: dict[str, Decision]
    predicted: dict[str, dict]
    skip: set[str]
    writer: object  # the output format's module (formats.get_writer)
    out_shards: list[str]  # output shards, in source order (shards with something to write)
    shard_bytes: dict[str, int]
    scales: str = "rtn"  # SCALE_METHODS
    channel_weight: dict[str, torch.Tensor] = field(default_factory=dict)  # mse-act, by module
    input_amax: dict[str, float] = field(default_factory=dict)  # W4A4, by module
    kv_tensors: dict[str, dict] = field(default_factory=dict)  # KV scales, by the tensor they follow
    clock: StageClock = field(default_factory=StageClock)


class _Searched(Prepared):
    """A float32 weight whose block scales come from the least-error search
    (``kernels.scale_search``, compressed-tensors order only); reference arithmetic."""

    def __init__(self, w: torch.Tensor, amax: float, channel_weight: torch.Tensor | None):
        self.w, self.channel_weight = w, channel_weight
        self.amax = torch.tensor(amax, dtype=torch.float32)

    def quantize(self, scalar):
        p, s = quantize_nvfp4_search(self.w, scalar, channel_weight=self.channel_weight)
        return p.cpu(), s.cpu()


_SKIPPED = object()  # a shard the ledger has as finished


class _Quantize(NamedTuple):
    """An NVFP4 weight ready for the kernel (run in the quantize stage)."""

    prep: Prepared
    global_scale: torch.Tensor
    scale_2: torch.Tensor


class _Ready(NamedTuple):
    """Tensors to write as they are; ``amax`` for the shard's data findings (2-D only)."""

    tensors: dict[str, torch.Tensor]
    amax: float | None


class _Reader:
    """Reads the tensors of the shards in hand, in order, and prepares each output: NVFP4
    weights up to the kernel call (bytes on the device, amax, the fused group's global scale),
    everything else ready to write. Runs in the background stage; the only reader of the
    source, so the Hub stream releases shards in the same order as a sequential run.

    NVFP4 uses the output format's arithmetic order (``writer.NVFP4_ORDER``): the
    compressed-tensors quantize-direction global scale, or ModelOpt's dequant-direction
    ``scale_2``; both scalars come from the same fused-group amax. ``known_amax`` holds the
    amax values an interrupted run already measured (from the resume ledger). ``job.scales``
    (:data:`SCALE_METHODS`) picks round-to-nearest block scales (fast kernels) or the
    least-error search (reference arithmetic), weighted per input channel by
    ``job.channel_weight[module]`` for ``mse-act``.
    """

    def __init__(self, job: _Job, ledger: Ledger, device: torch.device, kernel: str,
                 known_amax: dict[str, float]):
        self.job, self.ledger, self.device, self.kernel = job, ledger, device, kernel
        self.order = job.writer.NVFP4_ORDER
        self._amax = {n: torch.tensor(v, dtype=torch.float32) for n, v in known_amax.items()}

    def amaxes(self) -> dict[str, dict]:
        """Every amax seen so far, by source shard with that shard's identity (for the ledger)."""
        source = self.job.source
        out: dict[str, dict] = {}
        for n, a in self._amax.items():
            shard = source.tensors[n].shard
            if shard not in out:
                out[shard] = {"id": source.files.identity(shard), "values": {}}
            out[shard]["values"][n] = float(a)
        return out

    def prepare(self, name: str) -> Prepared:
        source, job = self.job.source, self.job
        if job.scales != "rtn":
            w = self._load(name, nvfp4=True)
            cw = job.channel_weight.get(module_of(name)) if job.scales == "mse-act" else None
            return _Searched(w.to(self.device), float(self._amax[name]), cw)
        backend = choose_backend(self.kernel, self.device, source.tensors[name].numel)
        with job.clock("read"):
            fp8 = source.read_fp8(name)
            w = source.read(name) if fp8 is None else None
        with job.clock("dequant + amax"):
            if fp8 is not None:
                prep = prepare_fp8(*fp8, backend=backend, device=self.device, order=self.order)
            else:
                prep = prepare_float(w, backend=backend, device=self.device, order=self.order)
            prep.amax = prep.amax.cpu()
        _refuse_amax(name, float(prep.amax), source, True,
                     lambda: source.read(name).to(torch.float32))
        self._amax[name] = prep.amax
        return prep

    def amax(self, name: str) -> torch.Tensor:
        if name not in self._amax:
            self.prepare(name)
        return self._amax[name]

    def _load(self, name: str, nvfp4: bool = False) -> torch.Tensor:
        with self.job.clock("read"):  # FP8 dequantized in the read here
            w = self.job.source.read(name).to(torch.float32)
        self._amax[name] = torch.tensor(_checked_amax(name, w, self.job.source, nvfp4) or 0.0)
        return w

    def fp8_block(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """128x128 block FP8: the source bytes and scale untouched when stored that way,
        else quantized from the fp32 read (DeepSeek convention, scale = block amax / 448)."""
        scale = fp8_passthrough(self.job.source, name)
        if scale is not None:
            with self.job.clock("read"):
                return self.job.source.read_raw(name), self.job.source.read_raw(scale.name)
        return quantize_fp8_block(self._load(name))

    def items(self, shards: list[str], written=None):
        """Yield, per shard of ``shards`` (in stream order): ``(shard, name, value)`` for each
        output tensor, value a :class:`_Quantize` for an NVFP4 weight, else a :class:`_Ready`;
        then ``(shard, None, (deps, amaxes))``; or only ``(shard, _SKIPPED, None)`` when an
        earlier run finished it.

        ``written(shard)``, when given, blocks until ``shard`` is on disk: the reader then
        moves on (and the stream releases or fetches source shards) only as a sequential run
        would, which a fetching (Hub) source needs for its disk budget.
        """
        job, source = self.job, self.job.source
        wanted = set(shards)
        order = [s for s in source.shards if s in wanted]  # the order source.stream yields
        for i, shard in enumerate(source.stream(shards)):
            for ahead in order[i : i + 2]:  # this shard and the next: the disk never idles
                source.prefetch(ahead)
            deps = _source_deps(source, job.decisions, shard)
            if self.ledger.is_done(shard, deps):
                yield shard, _SKIPPED, None
                continue
            done: set[str] = set()
            for t in source.tensors_in(shard):
                if t.name in job.skip or t.name in done:
                    continue
                d = job.decisions[t.name]
                mod = module_of(t.name)
                if d.target is Target.NVFP4:
                    group = [m + ".weight" for m in d.members] or [t.name]
                    here = [n for n in group if source.tensors[n].shard == shard]
                    preps = {n: self.prepare(n) for n in here}
                    amax = torch.stack([self.amax(n) for n in group]).amax()
                    for n in here:
                        done.add(n)
                        yield shard, n, _Quantize(preps.pop(n), global_scale_from_amax(amax),
                                                  scale_2_from_amax(amax))
                elif d.target is Target.FP8_BLOCK:
                    yield shard, t.name, _Ready(job.writer.emit_fp8_block(mod, *self.fp8_block(t.name)), None)
                elif d.target is Target.MXFP8:
                    yield shard, t.name, _Ready(job.writer.emit_mxfp8(mod, *quantize_mxfp8(self._load(t.name))), None)
                else:
                    with job.clock("read"):
                        x = source.read(t.name)
                    x = x.to(torch.bfloat16) if d.target is Target.BF16 else x
                    amax = _checked_amax(t.name, x, source, nvfp4=False)
                    yield shard, t.name, _Ready({t.name: x}, amax if x.ndim == 2 else None)
            yield shard, None, (deps, self.amaxes())
            if written is not None:
                written(shard)


@dataclass
class _Calibration:
    stats: "CalibStats | None"
    sha256: str | None
    min_tokens: int
    notes: list[str]


def _calibration(path, scheme: str, kv_cache: str | None, scales: str, order: str,
                 min_tokens: int | None) -> _Calibration:
    """Load and check the calibration options together, before any work."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} (valid: {', '.join(SCHEMES)})")
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
    cfg = archs.text_config(config)
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


def _convert_shards(job: _Job, shards: list[str], out: Path, ledger: Ledger,
                    device: torch.device, kernel: str, bar) -> tuple[int, int, int, dict, dict, tuple]:
    """Convert ``shards`` with reading, quantizing and writing overlapped (quantize/convert/overlap.py):
    at most 2 prepared tensors wait for the quantizer and 1 finished shard for the writer.

    Returns:
        (shards written, shards skipped because a ledger has them, elements quantized,
        {shard: sha256}, {shard: data findings} of these shards, ({stage: wall seconds},
        {stage: CPU seconds of the thread})).
    """
    source, writer, clock = job.source, job.writer, job.clock
    t_loop = time.perf_counter()
    counts = {"written": 0, "skipped": 0}
    on_disk, changed, cancel = set(), threading.Condition(), threading.Event()

    def write(item) -> None:
        shard, tensors, deps, amaxes, stats = item
        with clock("write + sha256"):
            digest = write_shard_atomic(tensors, out / shard, sha256=True)
        tensors.clear()
        release_freed_memory(keep=reuse)
        with clock("ledger"):
            ledger.mark(shard, deps, amaxes, stats, digest)
        counts["written"] += 1
        bar.update(job.shard_bytes[shard])
        with changed:
            on_disk.add(shard)
            changed.notify_all()

    def written(shard: str) -> None:
        with changed:
            while shard not in on_disk:
                if cancel.is_set() or saver.stop.is_set():
                    raise RuntimeError("the writer stopped")  # its own error is raised below
                changed.wait(0.1)

    # free memory kept for reuse (quantize.base.memory.release_freed_memory): what the stages
    # below allocate again shard after shard (the output shard being built, the one queued,
    # the one being written, and the reader's tensors: two queued, one in hand, the
    # quantizer's, each with a kernel buffer of its size), plus one output shard of slack
    # for the heap's fragmentation
    out_bytes, biggest, mine = Counter(), 0, set(shards)
    for t in source.tensors.values():
        if t.shard in mine:
            out_bytes[t.shard] += sum(DTYPE_BYTES[d] * math.prod(shape)
                                      for d, shape in job.predicted.get(t.name, {}).values())
            biggest = max(biggest, t.numel * DTYPE_BYTES[t.dtype])
    reuse = 4 * max(out_bytes.values(), default=0) + 8 * biggest
    known = ledger.known_amax(source.files.identity)
    fetching = type(source.files) is not ShardFiles  # e.g. a Hub stream with a disk budget
    reader = Producer(lambda: _Reader(job, ledger, device, kernel, known).items(
        shards, written if fetching else None), depth=2, name="read")
    saver = Consumer(write, depth=1, name="write")
    elements = 0
    try:
        tensors: dict[str, torch.Tensor] = {}
        stats: dict = {}
        items = iter(reader)
        while True:
            with clock("wait for read"):
                shard, name, value = next(items, (None, None, None))
            if shard is None:
                break
            if name is _SKIPPED:
                counts["skipped"] += 1
                bar.update(job.shard_bytes[shard])
                continue
            if name is None:
                members = [t.name for t in source.tensors_in(shard) if t.name not in job.skip]
                _assert_predicted(tensors, {k: v for n in members
                                            for k, v in job.predicted[n].items()}, shard)
                bar.set_postfix_str(shard)
                with clock("wait for write"):
                    saver.put((shard, tensors, *value, stats))
                tensors, stats = {}, {}
                continue
            if isinstance(value, _Quantize):  # NVFP4: the kernel runs here
                prep, g, s2 = value
                with clock("quantize"):
                    packed, scale = prep.quantize(s2 if writer.NVFP4_ORDER == "scale_2" else g)
                    _shard_stats(stats, name, float(prep.amax), scale)
                mod = module_of(name)
                a_in = job.input_amax.get(mod)
                tensors.update(writer.emit_nvfp4(
                    mod, packed, scale, g, s2,
                    input_global_scale=input_global_scale_from_amax(a_in) if a_in is not None else None,
                    input_scale=input_scale_from_amax(a_in) if a_in is not None else None))
                elements += source.tensors[name].numel
            else:
                tensors.update(value.tensors)
                _shard_stats(stats, name, value.amax)
                if job.decisions[name].target in (Target.FP8_BLOCK, Target.MXFP8):
                    elements += source.tensors[name].numel
            tensors.update(job.kv_tensors.get(name, {}))
        with clock("wait for write"):
            saver.finish()
    except BaseException:
        if saver.error is not None:  # the writer failed first: report its error
            raise saver.error from None
        raise
    finally:
        cancel.set()
        reader.close()
        saver.close()
    digests = {s: ledger.done[s]["sha256"] for s in shards if s in ledger.done}
    clock.add("shard loop (wall)", time.perf_counter() - t_loop)
    return (counts["written"], counts["skipped"], elements, digests,
            {s: ledger.stats(s) for s in shards}, (dict(clock.seconds), dict(clock.cpu_seconds)))


def _on_every_rank(world: World, fn):
    """``fn()`` on every rank; when it raises on some rank, every rank raises (the lowest
    rank's error), so no rank waits alone in a later collective call."""
    try:
        result, err = fn(), None
    except Exception as e:
        result, err = None, e
    for e in world.gather(err):
        if e is not None:
            raise e
    return result


def convert(src: str | Path | Source, out: str | Path, *, scheme: str = "w4a16",
            fmt: str = "compressed-tensors", recipe: str = "weight-only", device: str = "auto",
            resume: bool = False, progress: bool = True, source_info: dict | None = None,
            tp: int = 1, engine: str = "vllm", calibration: "str | Path | None" = None,
            kv_cache: str | None = None, scales: str = "rtn",
            min_expert_tokens: int | None = None, kernel: str = "auto",
            workers: int = 1) -> Summary:
    """Convert the checkpoint folder ``src`` into an NVFP4 build in ``out``.

    Args:
        src: folder with config.json and safetensors shards (block FP8, compressed-tensors
            FP8, or dense), or an opened ``Source`` (``quantize.hub.download`` streams one from the Hub).
        out: output folder; must be empty unless ``resume``.
        scheme: ``w4a16`` (weight-only NVFP4) or ``w4a4`` (NVFP4 activations too: needs
            ``calibration``; writes each module's input scale, shared in a fused group).
        fmt: output layout, see ``formats.OutputFormat``.
        recipe: preset name or TOML path (``quantize.plan.recipe``).
        device: ``cpu``, ``cuda`` or ``auto``; with several ranks on CUDA, rank r uses GPU
            ``LOCAL_RANK`` (else r) modulo the GPU count.
        tp: tensor-parallel size the build is for; tensors whose per-shard shape breaks the
            engine's alignment rules are kept in high precision and listed in the notes.
        engine: ``vllm``, ``sglang`` or ``trtllm``: whose rules the plan and the final
            ``quantize check`` apply.
        resume: skip output shards a ledger records as finished (sha256 checked); the
            final folder is byte-identical to an uninterrupted run, whatever the number of
            ranks before and now.
        source_info: extra provenance (repo id, commit, file hashes) recorded in the manifest
            and part of the resume fingerprint.
        calibration: a stats folder from ``quantize calibrate`` (``formats.calib_stats``).
        kv_cache: ``fp8`` declares an FP8 KV cache; with ``calibration`` the k/v scales
            (amax / 448) are written per attention block, else engines use 1.0.
        scales: one of :data:`SCALE_METHODS` (the searches need the compressed-tensors format,
            and run the reference arithmetic whatever ``kernel``).
        min_expert_tokens: routed experts with fewer calibration tokens take the layer's max
            over experts as input amax and are listed in the manifest (default 8).
        kernel: ``auto``, ``reference``, ``inductor`` (CPU) or ``triton`` (CUDA); see
            ``quantize.kernels.fused``. Every kernel writes the same bytes.
        workers: processes on this machine (``quantize.convert.parallel``); under torchrun (an
            initialized torch.distributed group) the ranks divide the shards instead. Several
            processes need a local source folder.

    Returns:
        Summary of the run (on every rank: the whole build's totals).

    Raises:
        SourceError, RecipeError, OutputError, CalibrationError, ValueError: with the tensor,
            shard or key named;
            OutputError also when the free disk cannot hold the rest of the build.
        CheckFailed: ``quantize check`` found errors in the written build (no manifest is
            written, so the folder is not a finished build).
    """
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if workers > 1 and current_world().size == 1:
        return spawn_local(workers, convert, dict(
            src=_local_folder(src), out=out, scheme=scheme, fmt=fmt, recipe=recipe,
            device=device, resume=resume, progress=progress, source_info=source_info, tp=tp,
            engine=engine, calibration=calibration, kv_cache=kv_cache, scales=scales,
            min_expert_tokens=min_expert_tokens, kernel=kernel))
    t0 = time.perf_counter()
    world = current_world()
    out = Path(out)
    rec = load_recipe(recipe)
    writer = get_writer(fmt)
    dev = _resolve_device(device, world)
    choose_backend(kernel, dev)  # refuse a kernel that cannot run here before any work
    if world.size > 1:
        _local_folder(src)

    def plan():  # on every rank; no rank writes before every rank has passed pre-flight
        pre = preflight(src, out, recipe=rec, resume=resume, fmt=fmt, tp=tp, engine=engine,
                        carry_skip=_CARRY_SKIP)
        pre.raise_if_errors(Path(src).name if not isinstance(src, Source) else src.folder.name)
        calib = _calibration(calibration, scheme, kv_cache, scales, writer.NVFP4_ORDER,
                             min_expert_tokens)
        return pre, calib

    t_plan = time.perf_counter()
    pre, calib = _on_every_rank(world, plan)
    t_plan = time.perf_counter() - t_plan
    source, decisions = pre.source, pre.decisions
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
        notes.append(describe_dropped(source.dropped))
    if (note := unplaced_note(decisions)) is not None:
        notes.append(note)
    for d in decisions.values():
        if not d.reason.startswith(("recipe ", "sensitive:", "not a Linear")):
            notes.append(f"{d.name} kept as {d.target.value}: {d.reason}")
    headers = {n: [i.shard, i.dtype, list(i.shape)] for n, i in source.infos.items()}
    options = {"scheme": scheme, "format": fmt, "recipe": rec.name, "recipe_sha256": rec.sha256,
               "tp": tp, "engine": engine}
    if calib.stats is not None or kv_cache or scales != "rtn":
        options.update(kv_cache=kv_cache, scales=scales, calibration_sha256=calib.sha256)
    job_id = fingerprint({"tool": __version__, "options": options, "headers": headers,
                          "decisions": {n: d.target.value for n, d in decisions.items()},
                          "source": source_info or {}})
    shard_bytes = {s: 0 for s in source.shards}
    for i in source.infos.values():
        shard_bytes[i.shard] += i.nbytes
    out_shards = [s for s in source.shards if any(t.name not in skip for t in source.tensors_in(s))]
    job = _Job(source, decisions, predicted, skip, writer, out_shards, shard_bytes, scales,
               calib.stats.channel_sq_mean if calib.stats else {}, input_amax, kv_tensors)
    bytes_in = sum(shard_bytes.values())
    counts = Counter(d.target.value for n, d in decisions.items() if n not in skip)

    err = None
    if world.rank == 0:
        try:
            _prepare_out(out, resume)
        except OutputError as e:
            err = e
    if (err := world.broadcast(err)) is not None:
        raise err
    mine = assign_shards({s: shard_bytes[s] for s in out_shards}, world.size)[world.rank]
    bar = tqdm(total=sum(shard_bytes[s] for s in mine), unit="B", unit_scale=True,
               desc="convert" if world.size == 1 else f"convert rank {world.rank}",
               disable=not progress, position=world.rank)

    def run_rank():
        bound_allocator(CONVERT_MMAP_THRESHOLD, one_arena=True)
        ledger = Ledger(out, job_id, resume, rank=world.rank if world.size > 1 else None)
        return _convert_shards(job, mine, out, ledger, dev, kernel, bar)

    if world.size == 1:
        results = [run_rank()]
    else:
        try:
            result = ("ok", run_rank())
        except BaseException as e:  # every rank learns of it below, then all raise
            result = ("err", e)
        gathered = world.gather(result)
        for status, value in gathered:
            if status == "err":
                raise value
        results = [v for _, v in gathered]
    bar.close()
    source.close()
    written, skipped, elements = (sum(x[i] for x in results) for i in range(3))
    digests = {k: v for x in results for k, v in x[3].items()}
    shard_stats = {k: v for x in results for k, v in x[4].items()}
    stages, stage_cpu = {"pre-flight": t_plan}, {}
    for x in results:
        for total, part in ((stages, x[5][0]), (stage_cpu, x[5][1])):
            for k, v in part.items():
                total[k] = total.get(k, 0.0) + v
    notes += _data_notes([shard_stats[s] for s in out_shards])

    summary = err = None
    if world.rank == 0:
        try:
            t_finish = time.perf_counter()
            summary = _finish(job, out, scheme, options, headers, counts, notes, tied, bytes_in,
                              source_info, tp, engine, digests, kv_cache,
                              calibration_record(calib.stats, calib.sha256, calib.min_tokens)
                              if calib.stats is not None else None)
            summary.elements_quantized, summary.shards_written = elements, written
            summary.shards_skipped, summary.seconds = skipped, time.perf_counter() - t0
            stages["finish (index, config, check, manifest)"] = time.perf_counter() - t_finish
            summary.stage_seconds, summary.stage_cpu_seconds = stages, stage_cpu
        except BaseException as e:
            err = e
    summary, err = world.broadcast((summary, err))
    if err is not None:
        raise err
    return summary


def _local_folder(src: str | Path | Source) -> Path:
    """The folder of a local source; several processes cannot share a streamed Hub source
    (each would download and delete shards on its own)."""
    if not isinstance(src, Source):
        return Path(src)
    if type(src.files) is not ShardFiles or not src.has_data:
        raise ValueError("several workers or ranks need a local source folder; download the "
                         "checkpoint first (keep_source) and pass its folder")
    return src.folder


def _finish(job: _Job, out: Path, scheme: str, options: dict, headers: dict, counts: Counter,
            notes: list[str], tied: bool, bytes_in: int, source_info: dict | None, tp: int,
            engine: str, digests: dict[str, str], kv_cache: str | None,
            calibration: dict | None) -> Summary:
    """After every shard is written (rank 0 only): index, carried files, config and extra
    files, ``quantize check``, manifest; then the ledgers go."""
    source, decisions, skip, writer = job.source, job.decisions, job.skip, job.writer
    src = source.folder
    index = write_index(out, job.out_shards)
    linear = {n: d for n, d in decisions.items()  # N-D weights (Conv): in ignore too
              if n not in skip and module_of(n) and len(source.tensors[n].shape) >= 2}
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
    from quantize.inspect.check import (  # the check reads only what was written
        check_build,
        render_check,
    )

    findings = check_build(out, engine=engine, tp=tp)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise CheckFailed(f"quantize check found {len(errors)} error(s) in {out} (no manifest "
                          "written):\n  " + "\n  ".join(render_check(f) for f in errors[:20]),
                          tensor=errors[0].tensor, key=errors[0].kind)
    summary = Summary(out, dict(counts), bytes_in, index["metadata"]["total_size"], 0, 0.0, 0, 0,
                      sorted(ignore), notes, findings)
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
        **({"calibration": calibration} if calibration is not None else {}),
    }, digests)
    remove_ledgers(out)
    return summary


def _shard_stats(stats: dict, name: str, amax: float | None,
                 block_scale: torch.Tensor | None = None) -> None:
    """Record data findings of one written tensor in its shard's ``stats``: an all-zero
    weight, and NVFP4 block scales at the e4m3 floor 2^-9 (byte 0x01, FC-11b)."""
    if amax == 0.0 and name.endswith(".weight"):
        stats.setdefault("zero", []).append(name)
    if block_scale is not None:
        floor = count_bytes(block_scale, 0x01)
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
