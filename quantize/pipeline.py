"""``convert()``: stream a checkpoint shard by shard from FP8 (or dense) to NVFP4.

Steps: open and validate the source -> decide every tensor -> per source shard, read lazily,
quantize, write one output shard atomically -> index, config, carried files -> manifest.
Reading, quantizing and writing overlap (quantize/overlap.py) and shards can be divided
among processes (quantize/parallel.py). Peak memory is two output shards plus a few prepared
tensors and one fused group, whatever the model size.
"""

import ctypes
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from formats import get_writer
from formats.checkpoint import INDEX_NAME, carry_files, write_index, write_json_atomic
from formats.shards import write_shard_atomic
from formats.sources import Source, open_source
from quantize import __version__
from quantize.errors import OutputError, SourceError
from quantize.kernels.fused import Prepared, choose_backend, prepare_float, prepare_fp8
from quantize.kernels.nvfp4 import global_scale_from_amax
from quantize.manifest import (MANIFEST_NAME, PROGRESS_NAME, Ledger, fingerprint, remove_ledgers,
                               write_manifest)
from quantize.overlap import Consumer, Producer
from quantize.parallel import World, assign_shards, current_world, spawn_local
from quantize.plan import Decision, module_of, plan_tensors
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
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and world.size > 1:
        local = int(os.environ.get("LOCAL_RANK", world.rank))
        dev = torch.device("cuda", local % torch.cuda.device_count())
    return dev


def _tied(config: dict) -> bool:
    return bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False)))


def _prepare_out(out: Path, resume: bool) -> None:
    if out.exists() and any(out.iterdir()) and not resume:
        raise OutputError(f"output folder {out} is not empty; pass --resume to continue a build "
                          "or choose another --out", key=str(out))
    out.mkdir(parents=True, exist_ok=True)


@dataclass
class _Job:
    """Everything decided before any tensor data is read; the same on every rank."""

    source: Source
    decisions: dict[str, Decision]
    skip: set[str]
    out_shards: list[str]  # output shards, in source order (shards with something to write)
    shard_bytes: dict[str, int]


def _nan_error(source: Source, name: str) -> SourceError:
    t = source.tensors[name]
    bad = int((~torch.isfinite(source.read(name).to(torch.float32))).sum())
    return SourceError(f"tensor {name} in shard {t.shard} has {bad} NaN/Inf values after "
                       "dequantization; refusing to write a silent NaN", tensor=name, shard=t.shard)


class _Reader:
    """Reads the tensors of the shards in hand, in order, and prepares the NVFP4 ones (bytes to
    the device, amax, the fused group's global scale). Runs in the background stage."""

    def __init__(self, job: _Job, device: torch.device, kernel: str):
        self.job, self.device, self.kernel = job, device, kernel
        self._amax: dict[str, torch.Tensor] = {}  # members of fused groups held in other shards

    def prepare(self, name: str) -> Prepared:
        t = self.job.source.tensors[name]
        backend = choose_backend(self.kernel, self.device, t.numel)
        fp8 = self.job.source.read_fp8(name)
        if fp8 is not None:
            prep = prepare_fp8(*fp8, backend=backend, device=self.device)
        else:
            prep = prepare_float(self.job.source.read(name), backend=backend, device=self.device)
        prep.amax = prep.amax.cpu()
        if not torch.isfinite(prep.amax):
            raise _nan_error(self.job.source, name)
        return prep

    def amax(self, name: str) -> torch.Tensor:
        if name not in self._amax:
            self._amax[name] = self.prepare(name).amax
        return self._amax[name]

    def items(self, shards: list[str]):
        """Yield ``(shard, name, value)`` for every output tensor of ``shards`` and
        ``(shard, None, None)`` after each shard; for NVFP4 targets value is
        ``(Prepared, global_scale)``, else the tensor to write."""
        job = self.job
        for i, shard in enumerate(shards):
            for ahead in shards[i : i + 2]:  # this shard and the next: the disk never idles
                job.source.prefetch(ahead)
            done: set[str] = set()
            members = [t for t in job.source.tensors_in(shard) if t.name not in job.skip]
            for t in members:
                if t.name in done:
                    continue
                d = job.decisions[t.name]
                if d.target is Target.NVFP4:
                    group = [m + ".weight" for m in d.members] or [t.name]
                    here = [n for n in group if job.source.tensors[n].shard == shard]
                    preps = {n: self.prepare(n) for n in here}
                    amax = torch.stack([preps[n].amax if n in preps else self.amax(n)
                                        for n in group]).amax()
                    g = global_scale_from_amax(amax)
                    for n in here:
                        done.add(n)
                        yield shard, n, (preps.pop(n), g.clone())  # one tensor each on disk
                elif d.target is Target.BF16:
                    yield shard, t.name, job.source.read(t.name).to(torch.bfloat16)
                else:
                    yield shard, t.name, job.source.read(t.name)
            yield shard, None, None


def _convert_shards(job: _Job, shards: list[str], writer, out: Path, ledger: Ledger,
                    device: torch.device, kernel: str, bar) -> tuple[int, int, int, dict]:
    """Convert ``shards`` with reading, quantizing and writing overlapped (quantize/overlap.py):
    at most 2 prepared tensors wait for the quantizer and 1 finished shard for the writer.

    Returns:
        (shards written, shards skipped because the ledger has them, elements quantized,
        {shard: sha256} of this rank's shards).
    """
    todo = []
    for shard in shards:
        if ledger.is_done(shard):
            bar.update(job.shard_bytes[shard])
        else:
            todo.append(shard)

    def write(item) -> None:
        shard, tensors = item
        write_shard_atomic(tensors, out / shard)
        tensors.clear()
        _release_freed_memory()
        ledger.mark(shard)
        bar.update(job.shard_bytes[shard])

    reader = Producer(lambda: _Reader(job, device, kernel).items(todo), depth=2, name="read")
    saver = Consumer(write, depth=1, name="write")
    elements = 0
    try:
        tensors: dict[str, torch.Tensor] = {}
        for shard, name, value in reader:
            if name is None:
                bar.set_postfix_str(shard)
                saver.put((shard, tensors))
                tensors = {}
            elif job.decisions[name].target is Target.NVFP4:
                prep, g = value
                packed, scale = prep.quantize(g)
                tensors.update(writer.emit_nvfp4(module_of(name), packed, scale, g))
                elements += job.source.tensors[name].numel
            else:
                tensors[name] = value
        saver.finish()
    finally:
        reader.close()
        saver.close()
    return len(todo), len(shards) - len(todo), elements, {s: ledger.done[s] for s in shards}

def convert(src: str | Path, out: str | Path, *, scheme: str = "w4a16",
            fmt: str = "compressed-tensors", recipe: str = "weight-only", device: str = "auto",
            resume: bool = False, progress: bool = True, source_info: dict | None = None,
            kernel: str = "auto", workers: int = 1) -> Summary:
    """Convert the checkpoint folder ``src`` into an NVFP4 build in ``out``.

    Args:
        src: folder with config.json and safetensors shards (block FP8, compressed-tensors
            FP8, or dense).
        out: output folder; must be empty unless ``resume``.
        scheme: ``w4a16`` (weight-only NVFP4).
        fmt: output layout, see ``formats.OutputFormat``.
        recipe: preset name or TOML path (``quantize.recipe``).
        device: ``cpu``, ``cuda`` or ``auto``; with several ranks on CUDA, rank r uses GPU
            ``LOCAL_RANK`` (else r) modulo the GPU count.
        resume: skip output shards a ledger records as finished (sha256 checked); the
            final folder is byte-identical to an uninterrupted run.
        source_info: extra provenance (repo id, revision) recorded in the manifest.
        kernel: ``auto``, ``reference``, ``inductor`` (CPU) or ``triton`` (CUDA); see
            ``quantize.kernels.fused``. Every kernel writes the same bytes.
        workers: processes on this machine (``quantize.parallel``); under torchrun (an
            initialized torch.distributed group) the ranks divide the shards instead.

    Returns:
        Summary of the run (on every rank: the whole build's totals).

    Raises:
        SourceError, RecipeError, OutputError, ValueError: with the tensor, shard or key named.
    """
    if workers > 1 and not current_world().size > 1:
        return spawn_local(workers, convert, dict(
            src=src, out=out, scheme=scheme, fmt=fmt, recipe=recipe, device=device,
            resume=resume, progress=progress, source_info=source_info, kernel=kernel))
    t0 = time.perf_counter()
    world = current_world()
    src, out = Path(src), Path(out)
    source = open_source(src)
    rec = load_recipe(recipe)
    writer = get_writer(fmt)
    dev = _resolve_device(device, world)
    choose_backend(kernel, dev)  # refuse a kernel that cannot run here before any work
    decisions = plan_tensors(source, rec)
    notes = []
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
    job_id = fingerprint({"tool": __version__, "options": options, "headers": headers,
                          "decisions": {n: d.target.value for n, d in decisions.items()}})
    shard_bytes = {s: 0 for s in source.shards}
    for i in source.infos.values():
        shard_bytes[i.shard] += i.nbytes
    out_shards = [s for s in source.shards
                  if any(t.name not in skip for t in source.tensors_in(s))]
    job = _Job(source, decisions, skip, out_shards, shard_bytes)
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
    _bound_allocator()
    ledger = Ledger(out, job_id, resume, rank=world.rank if world.size > 1 else None)
    mine = assign_shards({s: shard_bytes[s] for s in out_shards}, world.size)[world.rank]
    bar = tqdm(total=sum(shard_bytes[s] for s in mine), unit="B", unit_scale=True,
               desc="convert" if world.size == 1 else f"convert rank {world.rank}",
               disable=not progress, position=world.rank)
    if world.size == 1:
        stats = [_convert_shards(job, mine, writer, out, ledger, dev, kernel, bar)]
    else:
        try:
            mine_stats = ("ok", _convert_shards(job, mine, writer, out, ledger, dev, kernel, bar))
        except BaseException as e:  # every rank learns of it below, then all raise
            mine_stats = ("err", e)
        results = world.gather(mine_stats)
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
            summary = _finish(src, out, job, writer, scheme, options, headers, counts, notes,
                              bytes_in, source_info, digests)
            summary.elements_quantized, summary.shards_written = elements, written
            summary.shards_skipped, summary.seconds = skipped, time.perf_counter() - t0
        except BaseException as e:
            err = e
    summary, err = world.broadcast((summary, err))
    if err is not None:
        raise err
    return summary


def _finish(src: Path, out: Path, job: _Job, writer, scheme: str, options: dict, headers: dict,
            counts: Counter, notes: list[str], bytes_in: int, source_info: dict | None,
            digests: dict[str, str]) -> Summary:
    """After every shard is written: index, config, carried files, manifest (rank 0 only)."""
    source, decisions, skip = job.source, job.decisions, job.skip
    index = write_index(out, job.out_shards)
    ignore = sorted({module_of(n) for n, d in decisions.items()
                     if n not in skip and d.target is not Target.NVFP4 and module_of(n)})
    if _tied(source.config) and "lm_head" not in ignore:
        ignore.append("lm_head")  # the tied head is the unquantized embedding
    config = json.loads(json.dumps(source.config))
    (config.get("text_config") or {}).pop("quantization_config", None)
    config["quantization_config"] = writer.quantization_config(sorted(ignore), scheme)
    write_json_atomic(config, out / "config.json")
    carried = carry_files(src, out, skip={"config.json", MANIFEST_NAME, PROGRESS_NAME})
    remove_ledgers(out)
    summary = Summary(out, dict(counts), bytes_in, index["metadata"]["total_size"], 0, 0.0, 0, 0,
                      sorted(ignore), notes)
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
    return summary
