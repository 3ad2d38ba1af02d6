"""``convert()``: stream a checkpoint shard by shard from FP8 (or dense) to NVFP4.

Steps: pre-flight (``quantize.inspect.preflight``: the source, a folder or a Hub repo whose shards
``quantize.hub.download`` fetches on first read and deletes after their last, checked whole with every
finding at once; every tensor decided by ``quantize.plan.tensors``, recipe, TP / engine alignment; the
output folder and its free disk) -> per source shard, read lazily, refuse NaN / Inf / absurd
amax, quantize (NVFP4 in the output format's arithmetic order, block FP8 passed through,
MXFP8), check the shard against the planned layout, write it atomically -> index, carried
files, config (+ hf_quant_config.json for ModelOpt) -> ``quantize check`` (its scale rule from
the counts each shard's writer made) -> manifest (only when the check has no error).
Calibration statistics (``quantize calibrate``) add W4A4 input scales and FP8 KV scales, and
weight the block-scale search (``--scales``).
Reading, quantizing and writing overlap (``quantize.convert.overlap``: a reader thread, this thread, a
writer thread), NVFP4 goes through the fused kernels of ``quantize.kernels.fused`` (the
block-scale search too, in both arithmetic orders), and shards can be divided among
processes or torchrun ranks (``quantize.convert.parallel``). Large source tensors are read with
O_DIRECT and written shards leave the page cache once on disk (``formats.shards``): one pass
over the checkpoint gains nothing from the cache, and filling it was the largest CPU cost on
a small machine. Peak memory is a few output shards (being built, queued, being written, and
freed memory kept for the next ones) plus a few prepared tensors and one fused group,
whatever the model size.
"""

import functools
import json
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from formats import SCHEMES, get_writer
from formats.calib_stats import DEFAULT_MIN_TOKENS, STATS_FILE, CalibStats
from formats.checkpoint import (
    INDEX_NAME,
    carry_files,
    load_index,
    scan_headers,
    write_index,
    write_json_atomic,
)
from formats.gptq_results import GPTQResults
from formats.manifest import (
    CHECK_STATS_NAME,
    MANIFEST_NAME,
    PROGRESS_NAME,
    Ledger,
    file_identity,
    fingerprint,
    remove_ledgers,
    source_path,
    write_check_stats,
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
from quantize import __version__
from quantize.base.errors import CalibrationError, CheckFailed, OutputError, SourceError
from quantize.base.memory import (
    CONVERT_MMAP_THRESHOLD,
    bound_allocator,
    release_freed_memory,
)
from quantize.convert.overlap import Consumer, Producer, StageClock
from quantize.convert.parallel import World, assign_shards, current_world, spawn_local
from quantize.inspect.check import SCALE_NAMES, check_build, render_check, scale_faults
from quantize.inspect.preflight import ABSURD_AMAX, MIN_AMAX, preflight
from quantize.kernels import SCALE_METHODS, resolve_scales
from quantize.kernels.dtypes import count_bytes
from quantize.kernels.fp8 import quantize_fp8_block
from quantize.kernels.fused import (
    MIN_COMPILED_ELEMENTS,
    Prepared,
    choose_backend,
    compiled_graphs,
    prepare_float,
    prepare_fp8,
    warm_up,
)
from quantize.kernels.mxfp8 import quantize_mxfp8
from quantize.kernels.scale_search import METHOD_CANDIDATES
from quantize.plan.activations import (
    calibration_record,
    input_amax_plan,
    kv_scale_dtype,
    kv_scale_tensors,
)
from quantize.plan.recipe import Target, load_recipe
from quantize.plan.tensors import (
    Decision,
    dropped_tensors,
    fp8_passthrough,
    module_of,
    tied_embeddings,
    unplaced_note,
)

__all__ = ["ConvertOptions", "Summary", "convert"]

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
    graphs_compiled: list[int] = field(default_factory=list)
    """Per rank, in rank order: graphs torch.compile traced during its shard loop
    (quantize.kernels.fused.compiled_graphs; 0 where the warm-up compiled them all)."""

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
        for name in (MANIFEST_NAME, INDEX_NAME, "config.json", CHECK_STATS_NAME):
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


def _fused_group(decision: Decision, name: str) -> list[str]:
    """The weights whose amax sets the NVFP4 global scale of ``name``: its fused group's
    members (the architecture map's, through the plan) or ``name`` alone."""
    return [m + ".weight" for m in decision.members] or [name]


def _source_deps(source: Source, decisions: dict[str, Decision], shard: str) -> dict[str, list]:
    """Identity (``ShardFiles.identity``: size and mtime_ns, or size and sha256 for a Hub
    source) of every source shard the output ``shard`` is computed from: its own tensors, their
    FP8 scales and their fused-group partners."""
    files = {shard}
    for t in source.tensors_in(shard):
        for n in _fused_group(decisions[t.name], t.name):
            lt = source.tensors.get(n)
            if lt is not None:
                files.add(lt.shard)
                if lt.scale is not None:
                    files.add(lt.scale.shard)
    return {f: source.files.identity(f) for f in sorted(files)}


def _partner_reads(source: Source, decisions: dict[str, Decision], shards: list[str],
                   known: set[str] | dict = frozenset()) -> dict[str, set[str]]:
    """Source shards a stream of ``shards`` (one rank's share) reads besides
    ``Source.reads_of``: for each NVFP4 weight of a shard, the data and scale shards of the
    fused-group partners that live in a shard outside ``shards`` (another rank converts it)
    and whose amax is not ``known`` (from the resume ledger). The converter reads such a
    partner to take its amax (``_Reader.amax``); stating it lets a Hub source keep the shard
    until this rank is done with it (``Source.read_order``, ``Source.stream``,
    ``HubShards.will_read``) instead of fetching it again after its other reader deleted it.

    Returns:
        shard of ``shards`` -> set of other source shard names (shards with none left out).
    """
    mine = set(shards)
    out: dict[str, set[str]] = {}
    for shard in shards:
        extra: set[str] = set()
        for t in source.tensors_in(shard):
            d = decisions[t.name]
            if d.target is not Target.NVFP4:
                continue
            for n in _fused_group(d, t.name):
                lt = source.tensors.get(n)
                if lt is None or lt.shard in mine or n in known:
                    continue
                extra.add(lt.shard)
                if lt.scale is not None:
                    extra.add(lt.scale.shard)
        if extra:
            out[shard] = extra
    return out


"""Block-scale choice: round-to-nearest, least-squares search (``kernels.scale_search``), or
the search weighted by calibration activations (needs ``calibration``)."""


def _check_scale_method(scales: str) -> None:
    """Raises:
        ValueError: ``scales`` is not one of :data:`SCALE_METHODS`.
    """
    if scales not in SCALE_METHODS:
        raise ValueError(f"unknown --scales {scales!r} (valid: {', '.join(SCALE_METHODS)})")


@dataclass(frozen=True)
class ConvertOptions:
    """The options of one conversion, the same on every rank; :func:`convert` takes them as
    keywords (the ``quantize convert`` flags of the same names).

    Attributes:
        scheme: ``w4a16`` (weight-only NVFP4) or ``w4a4`` (NVFP4 activations too: needs
            ``calibration``; writes each module's input scale, shared in a fused group).
        fmt: output layout, see ``formats.OutputFormat``.
        recipe: preset name or TOML path (``quantize.plan.recipe``).
        device: ``cpu``, ``cuda`` or ``auto``; with several ranks on CUDA, rank r uses GPU
            ``LOCAL_RANK`` (else r) modulo the GPU count.
        resume: skip output shards a ledger records as finished (sha256 checked); the
            final folder is byte-identical to an uninterrupted run, whatever the number of
            ranks before and now.
        progress: show a progress bar per rank.
        source_info: extra provenance (repo id, commit, file hashes) recorded in the manifest
            and part of the resume fingerprint.
        tp: tensor-parallel size the build is for; tensors whose per-shard shape breaks the
            engine's alignment rules are kept in high precision and listed in the notes.
        engine: ``vllm``, ``sglang`` or ``trtllm``: whose rules the plan and the final
            ``quantize check`` apply.
        calibration: a stats folder from ``quantize calibrate`` (``formats.calib_stats``).
        kv_cache: ``fp8`` declares an FP8 KV cache; with ``calibration`` the k/v scales
            (amax / 448) are written per attention block, else engines use 1.0.
        scales: ``auto`` (default: ``mse`` on CUDA, ``rtn`` on CPU,
            :data:`quantize.kernels.SCALES_BY_DEVICE`) or one of :data:`SCALE_METHODS`; every
            method runs in the output format's arithmetic order and in every ``kernel`` with
            the same bytes, so only ``auto`` differs between devices. The manifest records the
            method that ran.
        min_expert_tokens: routed experts with fewer calibration tokens take the layer's max
            over experts as input amax and are listed in the manifest (default 8).
        kernel: ``auto``, ``reference``, ``inductor`` (CPU) or ``triton`` (CUDA); see
            ``quantize.kernels.fused``. Every kernel writes the same bytes.
        workers: processes on this machine (``quantize.convert.parallel``); under torchrun (an
            initialized torch.distributed group) the ranks divide the shards instead. Several
            processes need a local source folder.
        allow_unknown_arch: convert a ``model_type`` the architecture map does not know,
            planned from tensor names alone (pre-flight refuses it otherwise; the assumption is
            a note of the summary and the manifest).
        gptq: a GPTQ work folder (``formats.gptq_results``, written by ``calibrate.gptq``):
            its NVFP4 tensors are written for those modules instead of quantizing, after
            checking that each one's scalar equals what its fused group gets from the source;
            every other tensor is converted as always.
    """

    scheme: str = "w4a16"
    fmt: str = "compressed-tensors"
    recipe: str = "weight-only"
    device: str = "auto"
    resume: bool = False
    progress: bool = True
    source_info: dict | None = None
    tp: int = 1
    engine: str = "vllm"
    calibration: "str | Path | None" = None
    kv_cache: str | None = None
    scales: str = "auto"  # SCALES_AUTO or SCALE_METHODS; auto resolved per device (resolve_scales)
    min_expert_tokens: int | None = None
    kernel: str = "auto"
    workers: int = 1
    allow_unknown_arch: bool = False
    gptq: "str | Path | None" = None


@dataclass
class _Job:
    """What the ranks need to convert their shards, decided before any tensor data is read;
    the same on every rank."""

    source: Source
    decisions: dict[str, Decision]
    modules: dict[str, str | None]  # logical tensor -> module_of(name), once per tensor
    predicted: dict[str, dict]  # quantize.plan.tensors.predict_outputs, from pre-flight
    skip: set[str]
    writer: ModuleType  # the output format's module (formats.get_writer)
    out_shards: list[str]  # output shards, in source order (shards with something to write)
    shard_bytes: dict[str, int]
    scales: str = "rtn"  # SCALE_METHODS
    channel_weight: dict[str, torch.Tensor] = field(default_factory=dict)  # mse-act, by module
    input_amax: dict[str, float] = field(default_factory=dict)  # W4A4, by module
    kv_tensors: dict[str, dict] = field(default_factory=dict)  # KV scales, by the tensor they follow
    clock: StageClock = field(default_factory=StageClock)
    gptq: GPTQResults | None = None  # results taken instead of quantizing, by module


@dataclass
class _Plan:
    """The job and what the manifest and summary record of it; the same on every rank."""

    job: _Job
    headers: dict[str, list]  # logical tensor -> [shard, dtype, shape] of the source
    options: dict  # the manifest's "options" (part of the resume fingerprint)
    job_id: str  # resume fingerprint (formats.manifest.fingerprint)
    counts: Counter  # target -> tensors written with it
    notes: list[str]
    tied: bool  # the output ties lm_head to the embedding
    calibration: dict | None  # the manifest's "calibration" record
    seconds: float  # pre-flight and planning, wall

    @property
    def bytes_in(self) -> int:
        return sum(self.job.shard_bytes.values())


class _RankResult(NamedTuple):
    """What one rank's shard loop did (or, merged, every rank's)."""

    written: int  # shards written
    skipped: int  # shards a ledger has as finished
    elements: int  # elements quantized
    digests: dict[str, str]  # shard -> sha256
    stats: dict[str, dict]  # shard -> data findings (``_shard_stats``)
    seconds: dict[str, float]  # stage -> wall seconds (quantize.convert.overlap.StageClock)
    cpu_seconds: dict[str, float]  # stage -> CPU seconds of its thread
    compiled: tuple[int, ...]  # per rank: graphs compiled in its shard loop

    @classmethod
    def merge(cls, results: list["_RankResult"], first: dict[str, float]) -> "_RankResult":
        """Sum of the ranks' results; ``first`` (stages before the shard loop) leads the
        wall-time stages."""
        seconds, cpu = dict(first), {}
        for r in results:
            for total, part in ((seconds, r.seconds), (cpu, r.cpu_seconds)):
                for k, v in part.items():
                    total[k] = total.get(k, 0.0) + v
        return cls(sum(r.written for r in results), sum(r.skipped for r in results),
                   sum(r.elements for r in results), {k: v for r in results for k, v in r.digests.items()},
                   {k: v for r in results for k, v in r.stats.items()}, seconds, cpu,
                   tuple(n for r in results for n in r.compiled))


class _FromGPTQ(Prepared):
    """NVFP4 tensors of one module from a GPTQ work folder; ``quantize(scalar)`` returns them
    after checking that ``scalar`` (the fused group's, from the source) is the one they were
    made with."""

    def __init__(self, name: str, amax: torch.Tensor, results: GPTQResults, module: str):
        self.name, self.amax, self.results, self.module = name, amax, results, module

    def quantize(self, scalar):
        packed, block_scale, stored = self.results.get(self.module)
        same = stored.shape == scalar.shape and torch.equal(stored.view(torch.int32),
                                                            scalar.to(torch.float32).view(torch.int32))
        if not same:
            raise CalibrationError(
                f"GPTQ result of {self.name} was made with NVFP4 scalar {stored.flatten().tolist()}, "
                f"but its tensor / fused group gets {scalar.flatten().tolist()} from the source: the "
                "work folder is of another source or fused-group rule", tensor=self.name)
        return packed, block_scale


_SKIPPED = object()  # a shard the ledger has as finished


class _Quantize(NamedTuple):
    """An NVFP4 weight ready for the kernel (run in the quantize stage)."""

    prep: Prepared
    module: str
    scalar: torch.Tensor  # writer.nvfp4_weight_scalar of the fused group's amax


class _Ready(NamedTuple):
    """Tensors to write as they are; ``amax`` for the shard's data findings (2-D only)."""

    tensors: dict[str, torch.Tensor]
    amax: float | None


class _Reader:
    """Reads the tensors of the shards in hand, in order, and prepares each output: NVFP4
    weights up to the kernel call (bytes on the device, amax, the fused group's global scale),
    everything else ready to write. Runs in the background stage; the only reader of the
    source, so the Hub stream releases shards in the same order as a sequential run.

    NVFP4 runs in the output format's arithmetic order (``writer.NVFP4_ORDER``) against the
    one scalar the writer stores (``writer.nvfp4_weight_scalar`` of the fused-group amax: the
    compressed-tensors quantize-direction global scale, or ModelOpt's dequant-direction
    ``scale_2``). ``known_amax`` holds the
    amax values an interrupted run already measured (from the resume ledger). ``job.scales``
    (:data:`SCALE_METHODS`) picks round-to-nearest block scales or the least-error search
    (``kernels.scale_search.METHOD_CANDIDATES``, in the same fast kernels), weighted per input
    channel by ``job.channel_weight[module]`` for ``mse-act``.
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
        gptq = job.gptq is not None and job.modules[name] in job.gptq.modules  # only its amax is needed
        method = "rtn" if gptq else job.scales
        search = {"candidates": METHOD_CANDIDATES[method],
                  "channel_weight": job.channel_weight.get(job.modules[name])
                  if method == "mse-act" else None}
        backend = choose_backend(self.kernel, self.device, source.tensors[name].numel)
        with job.clock("read"):
            fp8 = source.read_fp8(name)
            w = source.read(name) if fp8 is None else None
        with job.clock("dequant + amax"):
            if fp8 is not None:
                prep = prepare_fp8(*fp8, backend=backend, device=self.device, order=self.order, **search)
            else:
                prep = prepare_float(w, backend=backend, device=self.device, order=self.order, **search)
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
        partners = _partner_reads(source, job.decisions, shards, known=self._amax)
        for i, shard in enumerate(source.stream(shards, partners)):
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
                mod = job.modules[t.name]
                if d.target is Target.NVFP4:
                    group = _fused_group(d, t.name)
                    here = [n for n in group if source.tensors[n].shard == shard]
                    preps = {n: self.prepare(n) for n in here}
                    if job.gptq is not None:
                        preps = {n: _FromGPTQ(n, p.amax, job.gptq, job.modules[n])
                                 if job.modules[n] in job.gptq.modules else p for n, p in preps.items()}
                    amax = torch.stack([self.amax(n) for n in group]).amax()
                    for n in here:
                        done.add(n)
                        yield shard, n, _Quantize(preps.pop(n), job.modules[n],
                                                  job.writer.nvfp4_weight_scalar(amax))
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
    _check_scale_method(scales)
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


def _assert_predicted(tensors: dict[str, torch.Tensor], predicted: dict[str, tuple], shard: str) -> None:
    """What is about to be written equals the plan's prediction (names, dtypes, shapes), so
    ``recipe show`` / fit planning sizes are exact by construction."""
    got = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
    want = {n: (d, tuple(s)) for n, (d, s) in predicted.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:5]
        raise OutputError(f"internal: shard {shard} does not match the planned layout: {diff}", shard=shard)


def _reuse_bytes(job: _Job, shards: list[str]) -> int:
    """Free memory kept for reuse (quantize.base.memory.release_freed_memory): what the stages
    of :func:`_convert_shards` allocate again shard after shard (the output shard being built,
    the one queued, the one being written, and the reader's tensors: two queued, one in hand,
    the quantizer's, each with a kernel buffer of its size), plus one output shard of slack
    for the heap's fragmentation."""
    out_bytes, biggest, mine = Counter(), 0, set(shards)
    for t in job.source.tensors.values():
        if t.shard in mine:
            out_bytes[t.shard] += sum(DTYPE_BYTES[d] * math.prod(shape)
                                      for d, shape in job.predicted.get(t.name, {}).values())
            biggest = max(biggest, t.numel * DTYPE_BYTES[t.dtype])
    return 4 * max(out_bytes.values(), default=0) + 8 * biggest


def _quantize_nvfp4(job: _Job, name: str, value: _Quantize, stats: dict) -> dict[str, torch.Tensor]:
    """Run the NVFP4 kernel on one prepared weight (the quantize stage) and name its tensors
    through the writer, with the module's W4A4 input scalar when it has one."""
    writer = job.writer
    with job.clock("quantize"):
        packed, scale = value.prep.quantize(value.scalar)
        _shard_stats(stats, name, float(value.prep.amax), scale)
    a_in = job.input_amax.get(value.module)
    return writer.emit_nvfp4(value.module, packed, scale, value.scalar,
                             input_scalar=writer.nvfp4_input_scalar(a_in) if a_in is not None else None)


def _convert_shards(job: _Job, shards: list[str], out: Path, ledger: Ledger,
                    device: torch.device, kernel: str, bar) -> _RankResult:
    """Convert ``shards`` with reading, quantizing and writing overlapped (quantize/convert/overlap.py):
    at most 2 prepared tensors wait for the quantizer and 1 finished shard for the writer.

    Returns:
        this rank's :class:`_RankResult` (digests and data findings of ``shards``).
    """
    source, clock = job.source, job.clock
    t_loop, cpu_loop, graphs = time.perf_counter(), time.process_time(), compiled_graphs()
    counts = {"written": 0, "skipped": 0}
    on_disk, changed, cancel = set(), threading.Condition(), threading.Event()
    reuse = _reuse_bytes(job, shards)

    def write(item) -> None:
        shard, tensors, deps, amaxes, stats = item
        with clock("scale stats"):
            check = _check_record(tensors)
        with clock("write + sha256"):
            digest = write_shard_atomic(tensors, out / shard, sha256=True)
            stats["check"] = dict(check, file=file_identity(out / shard), sha256=digest)
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
                tensors.update(_quantize_nvfp4(job, name, value, stats))
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
    cpu = dict(clock.cpu_seconds)
    cpu["shard loop (process)"] = time.process_time() - cpu_loop  # all its threads, OpenMP's too
    return _RankResult(counts["written"], counts["skipped"], elements, digests,
                       {s: ledger.stats(s) for s in shards}, dict(clock.seconds), cpu,
                       (compiled_graphs() - graphs,))


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


def _on_rank_0(world: World, fn):
    """``fn()`` on rank 0 only; every rank returns its result, or raises its error."""
    result = err = None
    if world.rank == 0:
        try:
            result = fn()
        except BaseException as e:
            err = e
    result, err = world.broadcast((result, err))
    if err is not None:
        raise err
    return result


def convert(src: str | Path | Source, out: str | Path, options: ConvertOptions | None = None,
            **overrides) -> Summary:
    """Convert the checkpoint folder ``src`` into an NVFP4 build in ``out``.

    Args:
        src: folder with config.json and safetensors shards (block FP8, compressed-tensors
            FP8, or dense), or an opened ``Source`` (``quantize.hub.download`` streams one from the Hub).
        out: output folder; must be empty unless ``resume``.
        options, overrides: :class:`ConvertOptions`, its fields given as keywords replacing
            those of ``options`` (``convert(src, out, fmt="modelopt")``).

    Returns:
        Summary of the run (on every rank: the whole build's totals).

    Raises:
        SourceError, RecipeError, OutputError, CalibrationError, ValueError: with the tensor,
            shard or key named;
            OutputError also when the free disk cannot hold the rest of the build.
        CheckFailed: ``quantize check`` found errors in the written build (no manifest is
            written, so the folder is not a finished build).
        TypeError: a keyword that is not a :class:`ConvertOptions` field.
    """
    opts = replace(options or ConvertOptions(), **overrides)
    if opts.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {opts.workers}")
    if opts.workers > 1 and current_world().size == 1:
        shared = _shared_source(src)
        return spawn_local(opts.workers, convert, dict(src=shared, out=out, options=opts),
                           warm=functools.partial(_warm_kernels, opts, shared))
    t0 = time.perf_counter()
    world, out = current_world(), Path(out)
    rec, writer = load_recipe(opts.recipe), get_writer(opts.fmt)
    dev = _resolve_device(opts.device, world)
    opts = replace(opts, scales=resolve_scales(opts.scales, dev.type))
    choose_backend(opts.kernel, dev)  # refuse a kernel that cannot run here before any work
    if world.size > 1:
        _shared_source(src)
    plan = _plan(src, out, opts, rec, writer, world)
    _on_rank_0(world, lambda: _prepare_out(out, opts.resume))
    result = _run_ranks(plan, out, opts, dev, world)
    plan.notes += _data_notes([result.stats[s] for s in plan.job.out_shards])
    return _on_rank_0(world, lambda: _finish(plan, out, opts, result, t0))


def _warm_kernels(opts: ConvertOptions, src: Path) -> None:
    """In each worker before its shards: the inductor graphs the options will run
    (quantize.kernels.fused.warm_up), compiled by the first worker and loaded by the rest;
    nothing when no tensor of ``src`` is large enough for them (``--kernel auto`` gives those
    to the reference). Options or a source that cannot run are left for :func:`convert` to
    refuse with its own error."""
    try:
        dev = _resolve_device(opts.device, current_world())
        backend = choose_backend(opts.kernel, dev)
        order = get_writer(opts.fmt).NVFP4_ORDER
        if backend == "inductor" and opts.kernel == "auto":
            infos, _ = scan_headers(src, load_index(src, check_files=False))
            if not any(math.prod(i.shape) >= MIN_COMPILED_ELEMENTS for i in infos.values()):
                return
    except Exception:
        return
    if backend == "inductor" and resolve_scales(opts.scales, dev.type) == "rtn":
        warm_up(order)


def _preflight(src, out: Path, opts: ConvertOptions, rec, writer: ModuleType) -> tuple:
    """Pre-flight and the calibration options (run on every rank, so no rank writes before
    every rank has passed). Pre-flight predicts the outputs with the calibration's KV scales;
    its errors are raised before those of the calibration options."""
    try:
        calib, calib_err = _calibration(opts.calibration, opts.scheme, opts.kv_cache, opts.scales,
                                        writer.NVFP4_ORDER, opts.min_expert_tokens), None
    except Exception as e:
        calib, calib_err = None, e
    kv = tuple(calib.stats.kv_amax) if calib and calib.stats and opts.kv_cache else ()
    pre = preflight(src, out, recipe=rec, resume=opts.resume, fmt=opts.fmt, tp=opts.tp,
                    engine=opts.engine, carry_skip=_CARRY_SKIP, scheme=opts.scheme, kv_attention=kv,
                    allow_unknown_arch=opts.allow_unknown_arch)
    pre.raise_if_errors(Path(src).name if not isinstance(src, Source) else src.folder.name)
    if calib_err is not None:
        raise calib_err
    return pre, calib


def _plan(src, out: Path, opts: ConvertOptions, rec, writer: ModuleType, world: World) -> _Plan:
    """Pre-flight, calibration plans (W4A4 input amax, KV scales), notes and the resume
    fingerprint: everything before any tensor data is read, the same on every rank."""
    t_plan = time.perf_counter()
    pre, calib = _on_every_rank(world, lambda: _preflight(src, out, opts, rec, writer))
    t_plan = time.perf_counter() - t_plan
    source, decisions, stats = pre.source, pre.decisions, calib.stats
    input_amax = input_amax_plan(decisions, stats, calib.min_tokens) if opts.scheme == "w4a4" else {}
    kv_tensors = (kv_scale_tensors(source, stats, writer, kv_scale_dtype(source.config))
                  if opts.kv_cache and stats else {})
    skip = dropped_tensors(source)
    notes, tied = _plan_notes(pre, calib, skip)
    headers = {n: [i.shard, i.dtype, list(i.shape)] for n, i in source.infos.items()}
    options = {"scheme": opts.scheme, "format": opts.fmt, "recipe": rec.name, "recipe_sha256": rec.sha256,
               "tp": opts.tp, "engine": opts.engine}
    options["scales"] = opts.scales  # the method that ran (--scales auto resolved for the device)
    if stats is not None or opts.kv_cache:
        options.update(kv_cache=opts.kv_cache, calibration_sha256=calib.sha256)
    gptq = _gptq_results(opts.gptq, decisions, writer) if opts.gptq is not None else None
    if gptq is not None:
        options.update(method="gptq", gptq_sha256=gptq.sha256, gptq={
            **{k: gptq.meta.get(k) for k in ("damp", "act_order", "block", "scales", "min_tokens", "layers")},
            "calibration": gptq.meta.get("calibration"), "modules": len(gptq.modules),
            "fallback": gptq.fallback})
    job_id = fingerprint({"tool": __version__, "options": options, "headers": headers,
                          "decisions": {n: d.target.value for n, d in decisions.items()},
                          "source": opts.source_info or {}})
    shard_bytes = {s: 0 for s in source.shards}
    for i in source.infos.values():
        shard_bytes[i.shard] += i.nbytes
    out_shards = [s for s in source.shards if any(t.name not in skip for t in source.tensors_in(s))]
    job = _Job(source, decisions, {n: module_of(n) for n in decisions}, pre.predicted, skip, writer,
               out_shards, shard_bytes, opts.scales, stats.channel_sq_mean if stats else {},
               input_amax, kv_tensors, gptq=gptq)
    counts = Counter(d.target.value for n, d in decisions.items() if n not in skip)
    record = calibration_record(stats, calib.sha256, calib.min_tokens) if stats is not None else None
    return _Plan(job, headers, options, job_id, counts, notes, tied, record, t_plan)


def _gptq_results(path, decisions: dict[str, Decision], writer: ModuleType) -> GPTQResults:
    """Open a GPTQ work folder and check it against the plan.

    Raises:
        CalibrationError: unreadable or incomplete folder; results made in another
            arithmetic order than this output format's; a module the plan does not make NVFP4.
    """
    try:
        res = GPTQResults(path)
    except ValueError as e:
        raise CalibrationError(str(e), key=str(path)) from None
    if res.order != writer.NVFP4_ORDER:
        raise CalibrationError(f"GPTQ results {path} were made in the {res.order!r} NVFP4 order; this "
                               f"output format needs {writer.NVFP4_ORDER!r}: rerun --method gptq with this --format",
                               key=str(path))
    for m in res.modules:
        d = decisions.get(m + ".weight")
        if d is None or d.target is not Target.NVFP4:
            what = "is not in the source" if d is None else f"is planned as {d.target.value}"
            raise CalibrationError(f"GPTQ results {path} hold {m}, which {what}: GPTQ ran with another "
                                   "recipe or source", tensor=m + ".weight")
    return res


def _plan_notes(pre, calib: "_Calibration", skip: set[str]) -> tuple[list[str], bool]:
    """The summary's notes from pre-flight, calibration and the plan; and whether the output
    ties lm_head to the embedding (FC-23)."""
    source = pre.source
    notes = [f"{f.level}: {f.message}" for f in pre.findings] + list(calib.notes)
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
    if (note := unplaced_note(pre.decisions)) is not None:
        notes.append(note)
    for d in pre.decisions.values():
        if not d.reason.startswith(("recipe ", "sensitive:", "not a Linear")):
            notes.append(f"{d.name} kept as {d.target.value}: {d.reason}")
    return notes, tied


def _run_ranks(plan: _Plan, out: Path, opts: ConvertOptions, dev: torch.device,
               world: World) -> _RankResult:
    """This rank's share of the output shards, then every rank's results merged (any rank's
    error raised on every rank)."""
    job = plan.job
    shares = assign_shards({s: job.shard_bytes[s] for s in job.out_shards}, world.size)
    mine = shares[world.rank]
    bar = tqdm(total=sum(job.shard_bytes[s] for s in mine), unit="B", unit_scale=True,
               desc="convert" if world.size == 1 else f"convert rank {world.rank}",
               disable=not opts.progress, position=world.rank)

    def run_rank() -> _RankResult:
        bound_allocator(CONVERT_MMAP_THRESHOLD, one_arena=True)
        ledger = Ledger(out, plan.job_id, opts.resume, rank=world.rank if world.size > 1 else None)
        source = job.source  # a Hub source starts downloading what this rank will read
        todo = [s for s in mine if not ledger.is_done(s, _source_deps(source, job.decisions, s))]
        # every rank's reads, fused-group partners in other ranks' shards included (the same
        # on every rank); this rank's own without the partners whose amax the ledger holds,
        # as its stream in _Reader.items reads them
        orders = [source.read_order(x, _partner_reads(source, job.decisions, x)) for x in shares]
        known = ledger.known_amax(source.files.identity)
        source.files.will_read(orders, world.rank, source.read_order(
            todo, _partner_reads(source, job.decisions, mine, known)))
        return _convert_shards(job, mine, out, ledger, dev, opts.kernel, bar)

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
    job.source.close()
    return _RankResult.merge(results, {"pre-flight": plan.seconds})


def _shared_source(src: str | Path | Source) -> Path | Source:
    """What every worker opens: the folder of a local source, or a source whose shard files
    coordinate several processes themselves (``files.shared``: a Hub stream, each rank
    fetching what it reads into one cache), pickled to each worker."""
    if not isinstance(src, Source):
        return Path(src)
    if not src.has_data:
        raise ValueError("several workers or ranks need a source with data, not a header-only "
                         "descriptor")
    if type(src.files) is ShardFiles:
        return src.folder
    if not getattr(src.files, "shared", False):
        raise ValueError("several workers or ranks need a local source folder or a Hub source; "
                         f"{type(src.files).__name__} cannot be shared between processes")
    return src


def _write_configs(plan: _Plan, out: Path, opts: ConvertOptions) -> tuple[list[str], list[str]]:
    """Carried files, the writer's extra files and config.json (last: weights + config without
    the tokenizer never look like a loadable folder).

    Returns:
        (modules left unquantized, sorted: the config's ``ignore``; carried file names).
    """
    job = plan.job
    source, writer = job.source, job.writer
    linear = {n: (job.modules[n], d) for n, d in job.decisions.items()
              if n not in job.skip and job.modules[n] and len(source.tensors[n].shape) >= 2}  # N-D weights (Conv): in ignore too
    targets = {m: d.target.value for m, d in linear.values() if d.target.quantized}
    ignore = sorted({m for m, d in linear.values() if not d.target.quantized})
    if plan.tied and "lm_head" not in ignore:
        ignore.append("lm_head")  # the tied head is the unquantized embedding
    ignore = sorted(ignore)
    config = json.loads(json.dumps(source.config))
    if tied_embeddings(source.config) and not plan.tied:
        _set_tie(config, False)
    (config.get("text_config") or {}).pop("quantization_config", None)
    producer = {"name": "spark-quant", "version": __version__}
    config["quantization_config"] = writer.quantization_config(targets, ignore, opts.scheme, producer,
                                                               opts.kv_cache)
    carried = carry_files(source.folder, out, skip=set(_CARRY_SKIP))
    for fname, obj in writer.extra_files(targets, ignore, opts.scheme, producer, opts.kv_cache).items():
        write_json_atomic(obj, out / fname)
    write_json_atomic(config, out / "config.json")
    return ignore, carried


def _finish(plan: _Plan, out: Path, opts: ConvertOptions, result: _RankResult, t0: float) -> Summary:
    """After every shard is written (rank 0 only): index, carried files, config and extra
    files, the scale statistics counted as each shard was written (``write_check_stats``),
    ``quantize check`` (it reads only what was written: headers, the one-element scales, and
    the block scales of a shard changed since its write), manifest; then the ledgers go.

    Raises:
        CheckFailed: the check found errors (no manifest written).
    """
    t_finish = time.perf_counter()
    job, source = plan.job, plan.job.source
    index = write_index(out, job.out_shards)
    ignore, carried = _write_configs(plan, out, opts)
    write_check_stats(out, {s: result.stats[s]["check"] for s in job.out_shards
                            if "check" in result.stats.get(s, {})})
    findings = check_build(out, engine=opts.engine, tp=opts.tp)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise CheckFailed(f"quantize check found {len(errors)} error(s) in {out} (no manifest "
                          "written):\n  " + "\n  ".join(render_check(f) for f in errors[:20]),
                          tensor=errors[0].tensor, key=errors[0].kind)
    bytes_out = index["metadata"]["total_size"]
    write_manifest(out, {
        "tool": "spark-quant", "version": __version__,
        "source": {"path": source_path(source.folder), "layout": source.kind.value,
                   "shards": {s: fingerprint({n: h for n, h in plan.headers.items() if h[0] == s})
                              for s in source.shards}, **(opts.source_info or {})},
        "options": plan.options,
        "targets": {n: d.target.value for n, d in sorted(job.decisions.items()) if n not in job.skip},
        "summary": {"tensors_by_target": dict(sorted(plan.counts.items())), "bytes_in": plan.bytes_in,
                    "bytes_out": bytes_out, "ignore": ignore, "notes": plan.notes,
                    "carried_files": carried},
        **({"calibration": plan.calibration} if plan.calibration is not None else {}),
    }, result.digests)
    remove_ledgers(out)
    stages = dict(result.seconds)
    stages["finish (index, config, check, manifest)"] = time.perf_counter() - t_finish
    return Summary(out, dict(plan.counts), plan.bytes_in, bytes_out, result.elements,
                   time.perf_counter() - t0, result.written, result.skipped, ignore, plan.notes,
                   findings, stages, dict(result.cpu_seconds), list(result.compiled))


def _check_record(tensors: dict[str, torch.Tensor]) -> dict:
    """What ``quantize check``'s scale rule finds in an output shard about to be written,
    counted from its tensors (``quantize.inspect.check.scale_faults`` on each tensor named
    like a scale, :data:`SCALE_NAMES`): ``{"scales": tensors counted, "faults": {tensor: n}}``
    with only the tensors that have flagged values (formats.manifest CHECK_STATS_NAME)."""
    counted, faults = 0, {}
    for name, t in tensors.items():
        if name.rsplit(".", 1)[-1] in SCALE_NAMES:
            counted += 1
            if n := scale_faults(t.cpu()):
                faults[name] = n
    return {"scales": counted, "faults": dict(sorted(faults.items()))}


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
