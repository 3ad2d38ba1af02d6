"""Disk budget of a conversion, checked before the first shard is converted.

A build needs room for what it will still write, and a Hub source also for the shards it
will download: the converter holds a shard and its cross-shard partner, so the two largest
shards still to fetch. When the output and the download cache share a filesystem both amounts
are needed there at once.
"""

import shutil
from pathlib import Path

from formats.shards import DTYPE_BYTES
from formats.sources import ShardFiles, Source
from quantize.base.errors import OutputError

__all__ = ["predicted_output_bytes", "check_free_disk"]

GiB = 2**30


def _size(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def predicted_output_bytes(source: Source, predicted: dict[str, dict],
                           done: set[str] = frozenset()) -> int:
    """Tensor bytes the converter will still write for source shards not in ``done``.

    ``predicted`` is :func:`quantize.plan.tensors.predict_outputs` (logical name -> {output tensor:
    (safetensors dtype, shape)}), the same prediction the converter checks every shard
    against. Safetensors headers and carried files (a few MiB) are not counted.
    """
    total = 0
    for name, outs in predicted.items():
        if source.tensors[name].shard in done:
            continue
        for dtype, shape in outs.values():
            n = DTYPE_BYTES[dtype]
            for d in shape:
                n *= d
            total += n
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
    filesystem when they share a device. Tells ``files`` (``set_disk_budget``) how much free
    disk its downloads may fill ahead of the converter: the free disk of the cache's
    filesystem less the output's share of it.

    Raises:
        OutputError: with every number (needed, free, the paths) and what to change.
    """
    fetch = sorted(files.to_fetch().values())[-2:]
    fetch_bytes = sum(fetch)
    limit = files.budget_limit
    if limit is not None and fetch and limit < fetch_bytes:
        raise OutputError(
            f"a source budget of {_size(limit)} is less than the {len(fetch)} largest "
            f"source shards to download ({_size(fetch_bytes)}): the converter holds a shard and "
            "the next one it reads at once; raise --source-budget", key=str(files.folder))
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
        spot["fetch"] = spot.get("fetch", False) or path is files.folder
    for spot in places.values():
        free = shutil.disk_usage(spot["path"]).free
        if spot.get("fetch"):
            # what the read-ahead of a Hub source may fill: the free disk less the output
            files.set_disk_budget(free - (spot["need"] - fetch_bytes))
        if free < spot["need"]:
            raise OutputError(
                f"not enough free disk on the filesystem of {spot['path']}: need "
                f"{_size(spot['need'])} ({' + '.join(spot['what'])}), free {_size(free)}. "
                "Free some space, choose another --out, or point HF_HOME "
                "(the download cache) at another disk.", key=str(spot["path"]))
