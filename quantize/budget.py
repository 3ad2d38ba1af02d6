"""Disk budget of a conversion, checked before the first shard is converted.

A build needs room for what it will still write, and a Hub source also for the shards it
will download: the converter holds a shard and its cross-shard partner, so the two largest
shards still to fetch. When the output and the download cache share a filesystem both amounts
are needed there at once.
"""

import shutil
from pathlib import Path

import torch

from formats.sources import ShardFiles, Source
from quantize.errors import OutputError
from quantize.kernels.nvfp4 import global_scale_from_amax, quantize_nvfp4
from quantize.plan import Decision, module_of
from quantize.recipe import Target

__all__ = ["predicted_output_bytes", "check_free_disk"]

GiB = 2**30


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _nvfp4_bytes(writer, module: str, shape: tuple[int, ...], cache: dict) -> int:
    """Tensor bytes the writer emits for one NVFP4 Linear, from the kernel and writer run on
    ``meta`` tensors (no data, no layout knowledge repeated here)."""
    if shape not in cache:
        w = torch.empty(shape, dtype=torch.float32, device="meta")
        g = global_scale_from_amax(torch.empty((), dtype=torch.float32, device="meta"))
        packed, scale = quantize_nvfp4(w, g)
        cache[shape] = sum(t.numel() * t.element_size()
                           for t in writer.emit_nvfp4(module, packed, scale, g).values())
    return cache[shape]


def predicted_output_bytes(source: Source, decisions: dict[str, Decision], writer,
                           skip: set[str] = frozenset(), done: set[str] = frozenset()) -> int:
    """Tensor bytes the converter will still write for shards not in ``done``.

    NVFP4 tensors: what ``writer.emit_nvfp4`` returns for the kernel's outputs; BF16: 2 bytes
    per element; kept tensors: as read (FP8 sources dequantize to float32, others keep their
    stored bytes). Safetensors headers and carried files (a few MiB) are not counted.
    """
    cache: dict = {}
    total = 0
    for name, t in source.tensors.items():
        if name in skip or t.shard in done:
            continue
        target = decisions[name].target
        if target is Target.NVFP4:
            total += _nvfp4_bytes(writer, module_of(name), t.shape, cache)
        elif target is Target.BF16:
            total += 2 * t.numel
        else:
            total += 4 * t.numel if t.is_fp8 else source.infos[name].nbytes
    return total


def _existing_parent(p: Path) -> Path:
    p = Path(p).resolve()
    while not p.exists():
        p = p.parent
    return p


def check_free_disk(out: Path, out_bytes: int, files: ShardFiles) -> None:
    """Stop before converting when the free disk cannot hold the rest of the build.

    Needs ``out_bytes`` free under ``out`` and, for sources still to download, the two
    largest of ``files.to_fetch()`` under ``files.folder`` (the Hub cache); both on the same
    filesystem when they share a device.

    Raises:
        OutputError: with every number (needed, free, the paths) and what to change.
    """
    fetch = sorted(files.to_fetch().values())[-2:]
    fetch_bytes = sum(fetch)
    places = {}
    for path, need, what in ((out, out_bytes, f"output {_size(out_bytes)}"),
                             (files.folder, fetch_bytes,
                              f"{len(fetch)} largest source shards to download "
                              f"{_size(fetch_bytes)}")):
        if need == 0:
            continue
        p = _existing_parent(path)
        dev = p.stat().st_dev
        spot = places.setdefault(dev, {"path": p, "need": 0, "what": []})
        spot["need"] += need
        spot["what"].append(what)
    for spot in places.values():
        free = shutil.disk_usage(spot["path"]).free
        if free < spot["need"]:
            raise OutputError(
                f"not enough free disk on the filesystem of {spot['path']}: need "
                f"{_size(spot['need'])} ({' + '.join(spot['what'])}), free {_size(free)}. "
                "Free some space, choose another --out, or point HF_HOME "
                "(the download cache) at another disk.", key=str(spot["path"]))
