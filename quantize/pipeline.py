"""``convert()``: stream a checkpoint shard by shard from FP8 (or dense) to NVFP4.

Steps: open and validate the source (a folder, or a Hub repo whose shards ``quantize.hub``
fetches on first read and deletes after their last) -> decide every tensor (``quantize.plan``,
recipe, TP / engine alignment) -> check the free disk -> per source shard, read lazily,
quantize (NVFP4 in the output format's arithmetic order, block FP8 passed through, MXFP8),
check the shard against the planned layout, write it atomically -> index, config
(+ hf_quant_config.json for ModelOpt), carried files -> ``quantize check`` -> manifest (only
when the check has no error).
Reading, quantizing and writing overlap (``quantize.overlap``: a reader thread, this thread, a
writer thread), NVFP4 goes through the fused kernels of ``quantize.kernels.fused``, and shards
can be divided among processes or torchrun ranks (``quantize.parallel``). Peak memory is two
output shards plus a few prepared tensors and one fused group, whatever the model size.
"""

import ctypes
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from formats import get_writer
from formats.checkpoint import INDEX_NAME, carry_files, write_index, write_json_atomic
from formats.shards import dtype_name, write_shard_atomic
from formats.sources import ShardFiles, Source, open_source
from quantize import __version__
from quantize.budget import check_free_disk, predicted_output_bytes
from quantize.errors import CheckFailed, OutputError, SourceError
from quantize.kernels.fp8 import quantize_fp8_block
from quantize.kernels.mxfp8 import quantize_mxfp8
from quantize.kernels.fused import Prepared, choose_backend, prepare_float, prepare_fp8
from quantize.kernels.nvfp4 import global_scale_from_amax, scale_2_from_amax
from quantize.manifest import (MANIFEST_NAME, PROGRESS_NAME, Ledger, fingerprint, has_ledger,
                               remove_ledgers, write_manifest)
from quantize.overlap import Consumer, Producer
from quantize.parallel import World, assign_shards, current_world, spawn_local
from quantize.plan import Decision, dropped_tensors, tied_embeddings, fp8_passthrough, module_of, plan_tensors, predict_outputs
from quantize.recipe import Target, load_recipe

__all__ = ["Summary", "convert"]

try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim
except (OSError, AttributeError):  # not glibc
    _LIBC = None


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


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _bound_allocator() -> None:
    """Serve every allocation of 1 MiB or more with its own mmap (glibc ``mallopt``).

    glibc otherwise raises its mmap threshold after the first large free and carves later
    tensors out of the heap, where fragmentation makes peak RSS creep up shard after shard;
    with a fixed threshold peak RSS stays flat in the number of shards (FC-04).
    """
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS after each shard (glibc ``malloc_trim``)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


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


def _prepare_out(src: Path, out: Path, resume: bool) -> None:
    """Refuse an --out that would overwrite the source or an unrelated folder; on resume,
    remove the files that mark a build complete before any shard is touched."""
    s, o = src.resolve(), out.resolve()
    if o == s or o.is_relative_to(s):
        raise OutputError(f"--out {out} is the source folder or inside it; choose a folder "
                          "outside the source", key=str(out))
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} exists and is not a folder", key=str(out))
    if out.exists() and any(out.iterdir()):
        ours = has_ledger(out) or (out / MANIFEST_NAME).exists()
        if not resume:
            raise OutputError(f"output folder {out} is not empty; "
                              + ("pass --resume to continue that build" if ours else
                                 "choose another --out"), key=str(out))
        if not ours:
            raise OutputError(f"--resume: {out} holds no spark-quant build (no "
                              f"{PROGRESS_NAME} or {MANIFEST_NAME}); refusing to write into it",
                              key=str(out))
        for name in (MANIFEST_NAME, INDEX_NAME, "config.json"):
            (out / name).unlink(missing_ok=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create --out {out}: {e}", key=str(out)) from None


def _check_finite(name: str, t: torch.Tensor, source: Source) -> None:
    """Refuse NaN / Inf in anything written from floating-point data (FP8 after dequant)."""
    if t.is_floating_point() and not torch.isfinite(t).all():
        info = source.tensors[name]
        what = "after dequantization " if info.is_fp8 else ""
        bad = int((~torch.isfinite(t)).sum())
        raise SourceError(f"tensor {name} in shard {info.shard} has {bad} NaN/Inf values "
                          f"{what}; refusing to write a silent NaN", tensor=name, shard=info.shard)


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


_SKIPPED = object()  # a shard the ledger has as finished


class _Reader:
    """Reads the tensors of the shards in hand, in order, and prepares each output: NVFP4
    weights up to the kernel call (bytes on the device, amax, the fused group's global scale),
    everything else ready to write. Runs in the background stage; the only reader of the
    source, so the Hub stream releases shards in the same order as a sequential run.

    NVFP4 uses the output format's arithmetic order (``writer.NVFP4_ORDER``): the
    compressed-tensors quantize-direction global scale, or ModelOpt's dequant-direction
    ``scale_2``; both scalars come from the same fused-group amax. ``known_amax`` holds the
    amax values an interrupted run already measured (from the resume ledger).
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
        source = self.job.source
        backend = choose_backend(self.kernel, self.device, source.tensors[name].numel)
        fp8 = source.read_fp8(name)
        if fp8 is not None:
            prep = prepare_fp8(*fp8, backend=backend, device=self.device, order=self.order)
        else:
            prep = prepare_float(source.read(name), backend=backend, device=self.device,
                                 order=self.order)
        prep.amax = prep.amax.cpu()
        if not torch.isfinite(prep.amax):  # the count and the message come from the reference
            _check_finite(name, source.read(name).to(torch.float32), source)
        self._amax[name] = prep.amax
        return prep

    def amax(self, name: str) -> torch.Tensor:
        if name not in self._amax:
            self.prepare(name)
        return self._amax[name]

    def _load(self, name: str) -> torch.Tensor:
        w = self.job.source.read(name).to(torch.float32)
        _check_finite(name, w, self.job.source)
        self._amax[name] = w.abs().amax()
        return w

    def fp8_block(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """128x128 block FP8: the source bytes and scale untouched when stored that way,
        else quantized from the fp32 read (DeepSeek convention, scale = block amax / 448)."""
        scale = fp8_passthrough(self.job.source, name)
        if scale is not None:
            return self.job.source.read_raw(name), self.job.source.read_raw(scale.name)
        return quantize_fp8_block(self._load(name))

    def items(self, shards: list[str], written=None):
        """Yield, per shard of ``shards`` (in stream order): ``(shard, name, value)`` for each
        output tensor, value ``(Prepared, global_scale, scale_2)`` for an NVFP4 weight, else a
        dict of tensors to write; then ``(shard, None, (deps, amaxes))``; or only
        ``(shard, _SKIPPED, None)`` when an earlier run finished it.

        ``written(shard)``, when given, blocks until ``shard`` is on disk: the reader then
        moves on (and the stream releases or fetches source shards) only as a sequential run
        would, which a fetching (Hub) source needs for its disk budget.
        """
        job, source = self.job, self.job.source
        order = [s for s in source.shards if s in set(shards)]
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
                        yield shard, n, (preps.pop(n), global_scale_from_amax(amax),
                                         scale_2_from_amax(amax))
                elif d.target is Target.FP8_BLOCK:
                    yield shard, t.name, job.writer.emit_fp8_block(mod, *self.fp8_block(t.name))
                elif d.target is Target.MXFP8:
                    yield shard, t.name, job.writer.emit_mxfp8(mod, *quantize_mxfp8(self._load(t.name)))
                else:
                    x = source.read(t.name)
                    _check_finite(t.name, x, source)
                    yield shard, t.name, {t.name: x.to(torch.bfloat16) if d.target is Target.BF16 else x}
            yield shard, None, (deps, self.amaxes())
            if written is not None:
                written(shard)


def _assert_predicted(tensors: dict[str, torch.Tensor], predicted: dict[str, tuple], shard: str) -> None:
    """What is about to be written equals the plan's prediction (names, dtypes, shapes), so
    ``recipe show`` / fit planning sizes are exact by construction."""
    got = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
    want = {n: (d, tuple(s)) for n, (d, s) in predicted.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:5]
        raise OutputError(f"internal: shard {shard} does not match the planned layout: {diff}", shard=shard)


def _convert_shards(job: _Job, shards: list[str], out: Path, ledger: Ledger,
                    device: torch.device, kernel: str, bar) -> tuple[int, int, int, dict]:
    """Convert ``shards`` with reading, quantizing and writing overlapped (quantize/overlap.py):
    at most 2 prepared tensors wait for the quantizer and 1 finished shard for the writer.

    Returns:
        (shards written, shards skipped because a ledger has them, elements quantized,
        {shard: sha256} of these shards).
    """
    source = job.source
    counts = {"written": 0, "skipped": 0}
    on_disk, changed, cancel = set(), threading.Condition(), threading.Event()

    def write(item) -> None:
        shard, tensors, deps, amaxes = item
        write_shard_atomic(tensors, out / shard)
        tensors.clear()
        _release_freed_memory()
        ledger.mark(shard, deps, amaxes)
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
        for shard, name, value in reader:
            if name is _SKIPPED:
                counts["skipped"] += 1
                bar.update(job.shard_bytes[shard])
            elif name is None:
                members = [t.name for t in source.tensors_in(shard) if t.name not in job.skip]
                _assert_predicted(tensors, {k: v for n in members
                                            for k, v in job.predicted[n].items()}, shard)
                bar.set_postfix_str(shard)
                saver.put((shard, tensors, *value))
                tensors = {}
            elif isinstance(value, tuple):  # NVFP4: the kernel runs here
                prep, g, s2 = value
                packed, scale = prep.quantize(s2 if job.writer.NVFP4_ORDER == "scale_2" else g)
                tensors.update(job.writer.emit_nvfp4(module_of(name), packed, scale, g, s2))
                elements += source.tensors[name].numel
            else:
                tensors.update(value)
                if job.decisions[name].target in (Target.FP8_BLOCK, Target.MXFP8):
                    elements += source.tensors[name].numel
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
    return counts["written"], counts["skipped"], elements, digests


def convert(src: str | Path | Source, out: str | Path, *, scheme: str = "w4a16",
            fmt: str = "compressed-tensors", recipe: str = "weight-only", device: str = "auto",
            resume: bool = False, progress: bool = True, source_info: dict | None = None,
            tp: int = 1, engine: str = "vllm", kernel: str = "auto", workers: int = 1) -> Summary:
    """Convert the checkpoint folder ``src`` into an NVFP4 build in ``out``.

    Args:
        src: folder with config.json and safetensors shards (block FP8, compressed-tensors
            FP8, or dense), or an opened ``Source`` (``quantize.hub`` streams one from the Hub).
        out: output folder; must be empty unless ``resume``.
        scheme: ``w4a16`` (weight-only NVFP4).
        fmt: output layout, see ``formats.OutputFormat``.
        recipe: preset name or TOML path (``quantize.recipe``).
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
        kernel: ``auto``, ``reference``, ``inductor`` (CPU) or ``triton`` (CUDA); see
            ``quantize.kernels.fused``. Every kernel writes the same bytes.
        workers: processes on this machine (``quantize.parallel``); under torchrun (an
            initialized torch.distributed group) the ranks divide the shards instead. Several
            processes need a local source folder.

    Returns:
        Summary of the run (on every rank: the whole build's totals).

    Raises:
        SourceError, RecipeError, OutputError, ValueError: with the tensor, shard or key named;
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
            engine=engine, kernel=kernel))
    t0 = time.perf_counter()
    world = current_world()
    source = src if isinstance(src, Source) else open_source(src)
    if world.size > 1:
        _local_folder(source)
    src, out = source.folder, Path(out)
    rec = load_recipe(recipe)
    writer = get_writer(fmt)
    dev = _resolve_device(device, world)
    choose_backend(kernel, dev)  # refuse a kernel that cannot run here before any work
    decisions = plan_tensors(source, rec, tp=tp, engine=engine)
    predicted = predict_outputs(source, decisions, fmt)
    notes = []
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
    job_id = fingerprint({"tool": __version__, "options": options, "headers": headers,
                          "decisions": {n: d.target.value for n, d in decisions.items()},
                          "source": source_info or {}})
    shard_bytes = {s: 0 for s in source.shards}
    for i in source.infos.values():
        shard_bytes[i.shard] += i.nbytes
    out_shards = [s for s in source.shards if any(t.name not in skip for t in source.tensors_in(s))]
    job = _Job(source, decisions, predicted, skip, writer, out_shards, shard_bytes)
    bytes_in = sum(shard_bytes.values())
    counts = Counter(d.target.value for n, d in decisions.items() if n not in skip)

    err = None
    if world.rank == 0:
        try:
            _prepare_out(src, out, resume)
        except OutputError as e:
            err = e
    if (err := world.broadcast(err)) is not None:
        raise err
    mine = assign_shards({s: shard_bytes[s] for s in out_shards}, world.size)[world.rank]
    bar = tqdm(total=sum(shard_bytes[s] for s in mine), unit="B", unit_scale=True,
               desc="convert" if world.size == 1 else f"convert rank {world.rank}",
               disable=not progress, position=world.rank)

    def run_rank():
        _bound_allocator()
        ledger = Ledger(out, job_id, resume, rank=world.rank if world.size > 1 else None)
        check_free_disk(out, predicted_output_bytes(source, predicted, set(ledger.done)),
                        source.files)
        return _convert_shards(job, mine, out, ledger, dev, kernel, bar)

    if world.size == 1:
        stats = [run_rank()]
    else:
        try:
            result = ("ok", run_rank())
        except BaseException as e:  # every rank learns of it below, then all raise
            result = ("err", e)
        results = world.gather(result)
        for status, value in results:
            if status == "err":
                raise value
        stats = [v for _, v in results]
    bar.close()
    source.close()
    written, skipped, elements = (sum(x[i] for x in stats) for i in range(3))
    digests = {k: v for x in stats for k, v in x[3].items()}

    summary = err = None
    if world.rank == 0:
        try:
            summary = _finish(job, src, out, scheme, options, headers, counts, notes, tied,
                              bytes_in, source_info, tp, engine, digests)
            summary.elements_quantized, summary.shards_written = elements, written
            summary.shards_skipped, summary.seconds = skipped, time.perf_counter() - t0
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


def _finish(job: _Job, src: Path, out: Path, scheme: str, options: dict, headers: dict,
            counts: Counter, notes: list[str], tied: bool, bytes_in: int,
            source_info: dict | None, tp: int, engine: str, digests: dict[str, str]) -> Summary:
    """After every shard is written (rank 0 only): index, config, extra files, carried files,
    ``quantize check``, manifest; then the ledgers go."""
    source, decisions, skip, writer = job.source, job.decisions, job.skip, job.writer
    index = write_index(out, job.out_shards)
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
    config["quantization_config"] = writer.quantization_config(targets, sorted(ignore), scheme, producer)
    for fname, obj in writer.extra_files(targets, sorted(ignore), scheme, producer).items():
        write_json_atomic(obj, out / fname)
    write_json_atomic(config, out / "config.json")
    carried = carry_files(src, out, skip={"config.json", MANIFEST_NAME, PROGRESS_NAME,
                                          "hf_quant_config.json"})
    from quantize.check import check_build  # the check reads only what was written

    findings = check_build(out, engine=engine, tp=tp)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise CheckFailed(f"quantize check found {len(errors)} error(s) in {out} (no manifest "
                          "written):\n  " + "\n  ".join(f.render() for f in errors[:20]),
                          tensor=errors[0].tensor, key=errors[0].rule)
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
    }, digests)
    remove_ledgers(out)
    return summary
