"""Folder-level layout: index, config.json, and the non-weight files carried across."""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from formats.shards import TensorInfo, read_header
from quantize.errors import OutputError, SourceError

__all__ = ["INDEX_NAME", "SINGLE_NAME", "load_index", "read_all_headers", "write_json_atomic",
           "write_index", "carry_files"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors",)
# Never carried and never read: pickled weights can execute code on load.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def trusted_root(folder: Path) -> Path:
    """Where links inside ``folder`` may point: the folder itself, or for a huggingface_hub
    cache snapshot (``models--org--name/snapshots/<commit>``, whose files link to
    ``../../blobs/<hash>``) the repo's cache folder."""
    folder = Path(folder).resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(("models--", "datasets--")):
        return folder.parent.parent
    return folder


def _safe_member(folder: Path, rel: str, what: str) -> str:
    """Refuse index entries that point outside the folder (``..``, absolute, symlinks out)."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or len(p.parts) != 1:
        raise SourceError(f"{what} names {rel!r}, which is not a file inside the source folder",
                          shard=rel)
    full = (folder / rel)
    if full.is_symlink() and not full.resolve().is_relative_to(trusted_root(folder)):
        raise SourceError(f"{what} names {rel!r}, a link leading outside the source folder",
                          shard=rel)
    return rel


def load_index(folder: Path, check_files: bool = True) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or a single ``model.safetensors``.

    ``check_files=False`` skips the on-disk check of the shards (a Hub source fetches them later).

    Raises:
        SourceError: no weights, unreadable index, an entry pointing outside the folder,
            or shard files that are missing or empty (all listed at once, before any read).
    """
    folder = Path(folder)
    idx = folder / INDEX_NAME
    if idx.exists():
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SourceError(f"{INDEX_NAME} is malformed: {e}", key="weight_map") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise SourceError(f"{INDEX_NAME}: weight_map must map tensor names to shard file "
                              "names", key="weight_map")
        for shard in set(weight_map.values()):
            _safe_member(folder, shard, INDEX_NAME)
    elif (folder / SINGLE_NAME).exists():
        weight_map = {k: SINGLE_NAME for k in read_header(folder / SINGLE_NAME)}
    else:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = f" (found pickled weights {pickles}, which are never loaded)" if pickles else ""
        raise SourceError(f"{folder} has no {INDEX_NAME} or {SINGLE_NAME}{hint}")
    if not check_files:
        return dict(weight_map)
    bad = sorted({s for s in weight_map.values()
                  if not (folder / s).is_file() or (folder / s).stat().st_size == 0})
    if bad:
        raise SourceError(f"index names shard files that are missing or empty: {', '.join(bad)}",
                          shard=bad[0])
    return dict(weight_map)


def read_all_headers(folder: Path, weight_map: dict[str, str],
                     header_of: Callable[[str], dict[str, TensorInfo]] | None = None
                     ) -> dict[str, TensorInfo]:
    """Read every shard header once and check the index against them.

    ``header_of(shard)`` supplies a shard's header (default: ``read_header`` of the file in
    ``folder``; a Hub source passes headers fetched with HTTP range requests).

    Returns:
        tensor name -> TensorInfo for every tensor the index lists.

    Raises:
        SourceError: an index entry missing from its shard's header (FC-21a), listing all.
    """
    folder = Path(folder)
    infos: dict[str, TensorInfo] = {}
    missing = []
    header_of = header_of or (lambda shard: read_header(folder / shard))
    for shard in sorted(set(weight_map.values())):
        header = header_of(shard)
        for name, s in weight_map.items():
            if s != shard:
                continue
            if name not in header:
                missing.append(f"{name} (index says {shard})")
            else:
                infos[name] = header[name]
        unlisted = sorted(n for n in header if weight_map.get(n) != shard)
        missing += [f"{n} (in {shard}, not listed in the index)" for n in unlisted]
    if missing:
        raise SourceError("index and shard headers disagree: " + _first(missing),
                          tensor=missing[0].split(" ")[0])
    return infos


def _first(items: list[str], n: int = 20) -> str:
    """``a; b; ...`` for the first ``n`` items, then how many more."""
    more = f"; ... and {len(items) - n} more" if len(items) > n else ""
    return "; ".join(items[:n]) + more


def write_json_atomic(obj: dict, path: Path) -> None:
    """Write JSON (indent 2, trailing newline) through a temp name and rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        _discard(tmp)
        raise OutputError(f"cannot write {path.name} in {path.parent}: {e}", key=path.name) from None


def _discard(tmp: Path) -> None:
    """Remove a temp file after a failed write; a failure to remove it is not the error."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def write_index(folder: Path, shards: list[str]) -> dict:
    """Build ``model.safetensors.index.json`` from the headers of the shards actually written.

    ``weight_map`` is the union of those headers and ``total_size`` the sum of their tensor
    bytes (FC-21b), so the index cannot disagree with the files.
    """
    folder = Path(folder)
    weight_map, total = {}, 0
    for shard in shards:
        for name, info in read_header(folder / shard).items():
            weight_map[name] = shard
            total += info.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json_atomic(index, folder / INDEX_NAME)
    return index


def carry_files(src: Path, out: Path, skip: set[str]) -> list[str]:
    """Copy every non-weight file (tokenizer, chat template, generation config, license,
    custom code) from ``src`` to ``out``, keeping sub-folders; returns the relative paths.

    Weights (``*.safetensors``, pickles), the index and names in ``skip`` are not copied.
    Custom code is copied as a file and never imported.
    """
    src, out = Path(src), Path(out)
    root = trusted_root(src)
    # sub-folders that are checkpoints of their own (an earlier build kept beside the source)
    nested = {p.parent for p in src.rglob("config.json") if p.parent != src}
    copied = []
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if (not p.is_file() or rel.parts[0].startswith(".") or p.suffix in WEIGHT_SUFFIXES
                or p.suffix in PICKLE_SUFFIXES or str(rel) in skip or p.name == INDEX_NAME
                or any(p.is_relative_to(n) for n in nested)):
            continue
        if p.is_symlink() and not p.resolve().is_relative_to(root):
            continue
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        try:
            shutil.copyfile(p, tmp)
            os.replace(tmp, dest)
        except OSError as e:
            _discard(tmp)
            raise OutputError(f"cannot copy {rel} into {out}: {e}", key=str(rel)) from None
        copied.append(str(rel))
    return copied
