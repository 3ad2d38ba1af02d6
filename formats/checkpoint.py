"""Folder-level layout: index, config.json, and the non-weight files carried across."""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from formats.shards import TensorInfo, discard, is_temp_name, read_header, read_metadata
from quantize.base.errors import Finding, OutputError, SourceError, raise_findings

__all__ = ["INDEX_NAME", "SINGLE_NAME", "trusted_root", "scan_index", "load_index", "folder_findings",
           "FRAMEWORKS",
           "scan_headers", "read_all_headers", "write_json_atomic", "write_index", "carry_plan",
           "carry_files"]

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


def _unsafe_member(folder: Path, rel, what: str) -> str | None:
    """Why ``rel`` (an index value) is not a plain file inside ``folder``, or None.

    Refused: non-strings, absolute paths, ``..``, sub-folders, links leading outside the
    folder (HF cache snapshot links into ``blobs`` are inside).
    """
    if not isinstance(rel, str) or not rel:
        return f"{what} names {rel!r}, which is not a file name"
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or len(p.parts) != 1 or "\\" in rel:
        return f"{what} names {rel!r}, which is not a file inside the source folder"
    full = folder / rel
    if full.is_symlink() and not full.resolve().is_relative_to(trusted_root(folder)):
        return f"{what} names {rel!r}, a link leading outside the source folder"
    return None


def scan_index(folder: Path, check_files: bool = True
               ) -> tuple[dict[str, str], list[Finding], set[str]]:
    """Tensor name -> shard file name, from the index or a single ``model.safetensors``,
    with every problem found (not just the first).

    Returns:
        ``(weight_map, findings, listed)``: the map keeps only entries whose shard is a safe,
        existing, non-empty file; findings (kind ``index``) list unreadable indexes, entries
        pointing outside the folder, missing or empty shard files (all at once), and
        pickled weights that are never loaded; ``listed`` is every tensor name the index
        lists, usable shard or not. ``check_files=False`` skips the on-disk check of the
        shards (a Hub source fetches them later).
    """
    folder = Path(folder)
    findings: list[Finding] = []
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    idx = folder / INDEX_NAME
    if idx.exists():
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
                RecursionError) as e:
            return {}, [Finding("error", "index", f"{INDEX_NAME} is malformed: {e}",
                                key="weight_map")], set()
    elif (folder / SINGLE_NAME).exists():
        try:
            weight_map = {k: SINGLE_NAME for k in read_header(folder / SINGLE_NAME)}
        except SourceError as e:
            return {}, [Finding.of(e, "header")], set()
    else:
        hint = f" (found pickled weights {pickles}, which are never loaded)" if pickles else ""
        return {}, [Finding("error", "index", f"{folder} has no {INDEX_NAME} or {SINGLE_NAME}{hint}")], set()
    if not weight_map:
        return {}, [Finding("error", "index", f"{INDEX_NAME} lists no tensors", key="weight_map")], set()
    bad: set = set()
    for shard in sorted(set(map(str, weight_map.values()))):
        raw = next(v for v in weight_map.values() if str(v) == shard)
        why = _unsafe_member(folder, raw, INDEX_NAME)
        if why:
            bad.add(shard)
            findings.append(Finding("error", "index", why, shard=shard))
    missing = sorted({s for s in weight_map.values() if s not in bad and isinstance(s, str)
                      and check_files
                      and (not (folder / s).is_file() or (folder / s).stat().st_size == 0)})
    if missing:
        findings.append(Finding("error", "index", "index names shard files that are missing or "
                                f"empty: {', '.join(missing)}", shard=missing[0]))
    if pickles:
        findings.append(Finding("info", "index", f"pickled weights {', '.join(pickles)} are "
                                "never loaded nor copied (safetensors only)"))
    skip = bad | set(missing)
    return {k: v for k, v in weight_map.items() if v not in skip}, findings, set(weight_map)


FRAMEWORKS = {"tf": "TensorFlow", "flax": "Flax / JAX", "jax": "JAX", "mlx": "MLX",
              "np": "NumPy", "numpy": "NumPy", "paddle": "PaddlePaddle"}
"""safetensors ``__metadata__["format"]`` values written by frameworks other than PyTorch
(transformers writes ``pt``); their tensors have other names and layouts (Keras kernels are
[in, out], MLX stores its own quantization)."""


def _index_shards(folder: Path) -> set[str]:
    """Every shard file name the index names, usable or not (empty when it is unreadable:
    :func:`scan_index` reports that)."""
    try:
        return {str(v) for v in json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def folder_findings(folder: Path, weight_map: dict[str, str]) -> list[Finding]:
    """Is the folder what the index says? (docs/faults.md; kind ``index``)

    - a ``.safetensors`` file the index references no tensor in: an error when it holds
      tensors the index does not list anywhere (they would be silently left out of the
      build), else a warning (a stale copy; it is not read). Mistral's
      ``consolidated*.safetensors`` (its native-format copy beside the transformers shards)
      is a warning either way;
    - a referenced shard whose header ``__metadata__["format"]`` names another framework
      (:data:`FRAMEWORKS`): an error; missing metadata or ``pt`` is fine.

    Reads shard headers only.
    """
    folder = Path(folder)
    out: list[Finding] = []
    referenced = set(weight_map.values())
    named = referenced | _index_shards(folder)  # refused entries (a link out, ...) have their own finding
    for p in sorted(folder.glob("*.safetensors")):
        if p.name in named or is_temp_name(p.name) or not p.is_file():
            continue
        try:
            names = set(read_header(p))
        except SourceError as e:
            out.append(Finding("warning", "index", f"{p.name} is in the folder but the index "
                               f"references no tensor in it, and its header is unreadable ({e}); "
                               "it is not read", shard=p.name))
            continue
        extra = sorted(names - set(weight_map))
        if extra and not p.name.startswith("consolidated"):
            out.append(Finding("error", "index", f"{p.name} is in the folder but the index "
                               f"references no tensor in it; it holds {len(extra)} tensor(s) the "
                               f"index does not list (e.g. {extra[0]}), which would be left out of "
                               "the build: add them to the index or remove the file",
                               tensor=extra[0], shard=p.name))
        else:
            why = ("Mistral's native-format copy" if p.name.startswith("consolidated")
                   else f"its {len(names)} tensor(s) are all listed in other shards")
            out.append(Finding("warning", "index", f"{p.name} is in the folder but the index "
                               f"references no tensor in it ({why}); it is not read", shard=p.name))
    for shard in sorted(referenced):
        path = folder / shard
        if not path.is_file():
            continue
        try:
            fmt = read_metadata(path).get("format")
        except SourceError:
            continue  # the header scan reports it
        if fmt is not None and fmt != "pt":
            out.append(Finding("error", "header", f"shard {shard}: header metadata format {fmt!r} "
                               f"says it was written by {FRAMEWORKS.get(fmt, 'another framework')}, "
                               "not PyTorch ('pt'); its tensor names and layouts are not "
                               "transformers': convert it to a PyTorch checkpoint first",
                               shard=shard, key="__metadata__.format"))
    return out


def load_index(folder: Path, check_files: bool = True) -> dict[str, str]:
    """Tensor name -> shard file name (see :func:`scan_index`).

    Raises:
        SourceError: no weights, unreadable index, an entry pointing outside the folder,
            or shard files that are missing or empty (all listed at once, before any read).
    """
    weight_map, findings, _ = scan_index(folder, check_files)
    raise_findings(findings, Path(folder).name)
    return weight_map


def scan_headers(folder: Path, weight_map: dict[str, str],
                 header_of: Callable[[str], dict[str, TensorInfo]] | None = None
                 ) -> tuple[dict[str, TensorInfo], list[Finding]]:
    """Read every shard header once and check the index against them, collecting problems.

    ``header_of(shard)`` supplies a shard's header (default: ``read_header`` of the file in
    ``folder``; a Hub source passes headers fetched with HTTP range requests).

    Returns:
        ``(infos, findings)``: TensorInfo for every listed tensor found in a readable
        header; findings for unreadable headers (kind ``header``), and, one per tensor (kind
        ``index``), index entries missing from their shard (FC-21a) and tensors in a shard
        that the index does not list there (they would be silently dropped).
    """
    folder = Path(folder)
    infos: dict[str, TensorInfo] = {}
    findings: list[Finding] = []
    header_of = header_of or (lambda shard: read_header(folder / shard))
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    for shard in sorted(by_shard):
        try:
            header = header_of(shard)
        except SourceError as e:
            findings.append(Finding.of(e, "header"))
            continue
        for name in sorted(by_shard[shard]):
            if name not in header:
                findings.append(Finding("error", "index", f"{name} (index says {shard}) is not "
                                        "in that shard's header", tensor=name, shard=shard))
            else:
                infos[name] = header[name]
        for name in sorted(n for n in header if weight_map.get(n) != shard):
            findings.append(Finding("error", "index", f"{name} (in {shard}, not listed in the "
                                    "index)", tensor=name, shard=shard))
    return infos, findings


def read_all_headers(folder: Path, weight_map: dict[str, str],
                     header_of: Callable[[str], dict[str, TensorInfo]] | None = None
                     ) -> dict[str, TensorInfo]:
    """Every listed tensor's TensorInfo (see :func:`scan_headers`).

    Raises:
        SourceError: unreadable headers and index entries missing from their shard (FC-21a),
            all listed.
    """
    infos, findings = scan_headers(folder, weight_map, header_of)
    raise_findings(findings, Path(folder).name)
    return infos


def write_json_atomic(obj: dict, path: Path) -> None:
    """Write JSON (indent 2, trailing newline) through a temp name and rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        discard(tmp)
        raise OutputError(f"cannot write {path.name} in {path.parent}: {e}", key=path.name) from None


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


def carry_plan(src: Path, skip: set[str]) -> tuple[list[str], list[str]]:
    """Which non-weight files (tokenizer, chat template, generation config, license, custom
    code) of ``src`` are carried into a build, keeping sub-folders.

    Weights (``*.safetensors``, pickles), the index, hidden paths, leftover temp files,
    sub-folders holding a checkpoint of their own and names in ``skip`` are not carried;
    links leading outside ``src`` (or its Hub cache repo folder) are refused.

    Returns:
        ``(relative paths to copy, messages about files refused)``.
    """
    src = Path(src)
    copy, refused = [], []
    root = trusted_root(src)
    # sub-folders that are checkpoints of their own (an earlier build kept beside the source)
    nested = {p.parent for p in src.rglob("config.json") if p.parent != src}
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if (not p.is_file() or rel.parts[0].startswith(".") or p.suffix in WEIGHT_SUFFIXES
                or p.suffix in PICKLE_SUFFIXES or is_temp_name(p.name) or str(rel) in skip
                or p.name == INDEX_NAME or any(p.is_relative_to(n) for n in nested)):
            continue
        if p.is_symlink() and not p.resolve().is_relative_to(root):
            refused.append(f"{rel} is a link leading outside the source folder; not copied")
            continue
        copy.append(str(rel))
    return copy, refused


def carry_files(src: Path, out: Path, skip: set[str]) -> list[str]:
    """Copy the files :func:`carry_plan` selects from ``src`` to ``out``, each through a temp
    name and rename. Custom code is copied as a file and never imported.

    Returns:
        the relative paths copied.

    Raises:
        OutputError: naming the file when a copy fails (disk full, read-only, ...).
    """
    src, out = Path(src), Path(out)
    copied, _ = carry_plan(src, skip)
    for rel in copied:
        dest = out / rel
        tmp = dest.with_name(dest.name + ".tmp")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, tmp)
            os.replace(tmp, dest)
        except OSError as e:
            discard(tmp)
            raise OutputError(f"cannot copy {rel} into {out}: {e}", key=rel) from None
    return copied
