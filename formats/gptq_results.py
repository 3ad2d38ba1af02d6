"""The GPTQ work folder: NVFP4 results of a GPTQ pass, read by the conversion in their place.

``calibrate.gptq`` quantizes the NVFP4 Linears of the decoder layers one layer at a time and
writes, per layer, ``layer-LLLLL.safetensors`` holding for each checkpoint module ``M``:

- ``M::packed``: uint8 [N, K/2], e2m1 codes, even column in the low nibble;
- ``M::block_scale``: float8_e4m3fn [N, K/16];
- ``M::scalar``: float32, the writer's one NVFP4 scalar (compressed-tensors: global scale
  ``2688 / amax`` [1]; ModelOpt: ``weight_scale_2 = amax / 2688`` 0-dim) of the module's
  tensor or fused group, in the order named by ``order`` (the writer's ``NVFP4_ORDER``).

``gptq.json`` is written last (its presence marks the folder complete): ``format_version``,
``order``, ``modules`` (module -> file), ``fallback`` (routed experts quantized without a
Hessian -> their routed tokens) and ``meta`` (source, calibration, damping, act order, block,
block-scale method, seconds). The conversion (``quantize.convert.pipeline``, option ``gptq``)
takes these tensors for those modules instead of quantizing, after checking that the scalar
equals what the module's fused group gets from the source.
"""

import json
from pathlib import Path

import torch

from formats.checkpoint import write_json_atomic
from formats.shards import write_shard_atomic

__all__ = ["GPTQ_FILE", "GPTQResults", "write_layer", "write_results"]

GPTQ_FILE = "gptq.json"
FORMAT_VERSION = 1
_PARTS = ("packed", "block_scale", "scalar")


def layer_file(index: int) -> str:
    return f"layer-{index:05d}.safetensors"


def write_layer(folder: str | Path, index: int, results: dict[str, tuple]) -> str:
    """Write one decoder layer's results ``{module: (packed, block_scale, scalar)}``
    atomically; returns the file name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = layer_file(index)
    tensors = {f"{m}::{p}": t.contiguous().cpu() for m, parts in results.items() for p, t in zip(_PARTS, parts)}
    write_shard_atomic(tensors, folder / name)
    return name


def write_results(folder: str | Path, order: str, modules: dict[str, str], fallback: dict[str, int],
                  meta: dict) -> Path:
    """Write ``gptq.json`` (last: it marks the folder complete)."""
    path = Path(folder) / GPTQ_FILE
    write_json_atomic({"format_version": FORMAT_VERSION, "order": order, "modules": dict(sorted(modules.items())),
                       "fallback": dict(sorted(fallback.items())), "meta": meta}, path)
    return path


class GPTQResults:
    """A complete GPTQ work folder, read lazily one module at a time.

    Attributes:
        folder, order (``global`` or ``scale_2``), modules (module -> file), fallback,
        meta, sha256 (of ``gptq.json``: the resume fingerprint of a build that uses it).
    """

    def __init__(self, folder: str | Path):
        import hashlib

        self.folder = Path(folder)
        path = self.folder / GPTQ_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ValueError(f"GPTQ results {path} not found: the GPTQ pass did not finish "
                             "(rerun --method gptq)") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"GPTQ results {path} are not valid JSON: {e}") from None
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: format_version {data.get('format_version')!r}, expected {FORMAT_VERSION}")
        self.order: str = data["order"]
        self.modules: dict[str, str] = dict(data["modules"])
        self.fallback: dict[str, int] = dict(data.get("fallback", {}))
        self.meta: dict = dict(data.get("meta", {}))
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        for m, f in self.modules.items():
            if not (self.folder / f).is_file():
                raise ValueError(f"GPTQ results {path}: {f} (holding {m}) is missing")

    def get(self, module: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16], scalar float32)``.

        Raises:
            KeyError: ``module`` is not in the results.
            ValueError: the file lacks one of its tensors (naming it).
        """
        from safetensors import safe_open

        f = self.modules[module]
        with safe_open(str(self.folder / f), "pt") as h:
            keys = set(h.keys())
            missing = [f"{module}::{p}" for p in _PARTS if f"{module}::{p}" not in keys]
            if missing:
                raise ValueError(f"GPTQ results {self.folder / f}: {missing[0]} is missing")
            return tuple(h.get_tensor(f"{module}::{p}") for p in _PARTS)
