"""Source layouts, chosen from ``config.json`` ``quantization_config`` (never from shapes).

- ``fp8``: DeepSeek-V3 / GLM-5 block FP8. ``<m>.weight`` F8_E4M3 [N, K] with
  ``<m>.weight_scale_inv`` F32/BF16 [ceil(N/bh), ceil(K/bw)], a multiplier; (bh, bw) from
  ``weight_block_size``; ``scale_fmt: ue8m0`` only constrains the values (powers of two).
  [DeepSeek-V3 README_WEIGHTS.md, inference/kernel.py; formats_spec.md A.1]
- ``compressed-tensors`` ``float-quantized``: ``<m>.weight`` F8_E4M3 with ``<m>.weight_scale``
  by strategy tensor / channel / group / block. [compressed-tensors
  quantization/lifecycle/initialize.py; formats_spec.md A.2]
- dense: bf16 / fp16 / fp32 tensors, no ``quantization_config``.

A *logical* tensor is what the model sees: an FP8 weight and its scale are one logical
tensor named like the weight, read back as float32. Scale sidecars never leave this module.
"""

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from formats.checkpoint import load_index, read_all_headers
from formats.shards import ShardReader, TensorInfo
from quantize.errors import SourceError
from quantize.kernels.fp8 import dequantize_fp8_block, dequantize_fp8_broadcast

__all__ = ["SourceKind", "LogicalTensor", "Source", "open_source"]

FP8_DTYPES = {"F8_E4M3"}
SCALE_DTYPES = {"F32", "BF16", "F16"}
# compressed-tensors sidecars that describe activations or the KV cache of an FP8 model;
# they do not carry over to a re-quantized weight and are reported as dropped.
CT_DROPPED_SUFFIXES = (".input_scale", ".input_zero_point", ".output_scale", ".k_scale",
                       ".v_scale", ".q_scale", ".weight_zero_point")


class SourceKind(str, Enum):
    """Source layouts; values are the config's ``quant_method`` (or ``dense``)."""

    BLOCK_FP8 = "fp8"
    CT_FP8 = "compressed-tensors"
    DENSE = "dense"


@dataclass(frozen=True)
class LogicalTensor:
    """A tensor as the model sees it: name, shard of its data, shape, source dtype, and the
    scale sidecar (FP8 only)."""

    name: str
    shard: str
    shape: tuple[int, ...]
    dtype: str
    scale: TensorInfo | None = None

    @property
    def is_fp8(self) -> bool:
        return self.scale is not None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class _Fp8Layout:
    scale_suffix: str  # "_scale_inv" (block FP8) or "_scale" (compressed-tensors)
    block: tuple[int, int] | None = None
    group: int | None = None


class Source:
    """A validated source checkpoint folder with lazy, dequantizing reads."""

    def __init__(self, folder: Path, config: dict, kind: SourceKind, layout: _Fp8Layout | None,
                 weight_map: dict[str, str], infos: dict[str, TensorInfo]):
        self.folder, self.config, self.kind, self.layout = Path(folder), config, kind, layout
        self.weight_map, self.infos = weight_map, infos
        self.tensors: dict[str, LogicalTensor] = {}
        self.dropped: list[str] = []
        self._reader = ShardReader(self.folder, max_open=2)
        self._build_logical()

    # ---- structure -------------------------------------------------------------------
    def _build_logical(self) -> None:
        problems = []
        suffix = self.layout.scale_suffix if self.layout else None
        for name, info in sorted(self.infos.items()):
            if suffix and name.endswith(".weight" + suffix):
                if name[: -len(suffix)] not in self.infos:
                    problems.append(f"orphan scale {name} in {info.shard}: no weight "
                                    f"{name[: -len(suffix)]}")
                continue
            if self.kind is SourceKind.CT_FP8 and name.endswith(CT_DROPPED_SUFFIXES):
                self.dropped.append(name)
                continue
            scale = None
            if info.dtype in FP8_DTYPES:
                if self.layout is None:
                    problems.append(f"{name} in {info.shard} is FP8 but config.json declares no "
                                    "FP8 quantization_config")
                    continue
                scale = self.infos.get(name + suffix)
                if scale is None:
                    problems.append(f"FP8 weight {name} in {info.shard} has no {name + suffix}")
                    continue
                err = self._check_scale(info, scale)
                if err:
                    problems.append(err)
                    continue
            elif info.dtype.startswith("F8"):
                problems.append(f"{name} in {info.shard} has dtype {info.dtype}; only F8_E4M3 "
                                "FP8 sources are supported")
                continue
            self.tensors[name] = LogicalTensor(name, info.shard, info.shape, info.dtype, scale)
        if problems:
            raise SourceError(f"{len(problems)} problem(s) in {self.folder.name}:\n  "
                              + "\n  ".join(problems), tensor=problems[0].split(" ")[2])

    def _check_scale(self, w: TensorInfo, s: TensorInfo) -> str | None:
        if len(w.shape) != 2:
            return f"FP8 weight {w.name} in {w.shard} is {len(w.shape)}-D; expected 2-D"
        if s.dtype not in SCALE_DTYPES:
            return f"scale {s.name} in {s.shard} has dtype {s.dtype}; expected F32 or BF16"
        n, k = w.shape
        lay = self.layout
        if lay.block:
            bh, bw = lay.block
            ok = {(-(-n // bh), -(-k // bw))}
        elif lay.group:
            ok = {(n, -(-k // lay.group))}
        else:  # tensor or channel strategy
            ok = {(1,), (), (1, 1), (n, 1), (n,)}
        if tuple(s.shape) not in ok:
            return (f"scale {s.name} in {s.shard} has shape {list(s.shape)}; weight {w.name} "
                    f"{n}x{k} needs {sorted(ok)[0]}")
        return None

    @property
    def shards(self) -> list[str]:
        """Shard file names in index order (sorted names)."""
        return sorted(set(self.weight_map.values()))

    def tensors_in(self, shard: str) -> list[LogicalTensor]:
        """Logical tensors whose data lives in ``shard`` (their scale may live elsewhere)."""
        return [t for t in self.tensors.values() if t.shard == shard]

    # ---- reads -----------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """Read a logical tensor. FP8 weights come back dequantized as float32 [N, K];
        everything else exactly as stored (dtype and bits unchanged).

        Raises:
            SourceError: naming the tensor and shard when the bytes cannot be read.
        """
        t = self.tensors[name]
        raw = self._reader.get(t.shard, name)
        if t.scale is None:
            return raw
        scale = self._reader.get(t.scale.shard, t.scale.name)
        if self.layout.block:
            return dequantize_fp8_block(raw, scale, self.layout.block)
        return dequantize_fp8_broadcast(raw, scale, self.layout.group)

    def read_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
        """Read an FP8 logical tensor without dequantizing it.

        Returns:
            ``(weight float8_e4m3fn [N, K], scale [ceil(N/bh), ceil(K/bw)], (bh, bw))`` with
            the scale a multiplier grid as stored (float32 or bfloat16): block FP8 as is;
            compressed-tensors group g as blocks (1, g), channel as (1, K), tensor as (N, K).
            ``dequantize_fp8_block(*result)`` equals :meth:`read`. None for tensors that are
            not FP8.

        Raises:
            SourceError: naming the tensor and shard when the bytes cannot be read.
        """
        t = self.tensors[name]
        if t.scale is None:
            return None
        raw = self._reader.get(t.shard, name)
        scale = self._reader.get(t.scale.shard, t.scale.name)
        n, k = raw.shape
        if self.layout.block:
            return raw, scale, tuple(self.layout.block)
        if self.layout.group:
            return raw, scale, (1, self.layout.group)
        if scale.numel() == 1:
            return raw, scale.reshape(1, 1), (n, k)
        return raw, scale.reshape(n, 1), (1, k)

    def prefetch(self, shard: str) -> None:
        """Start reading ``shard`` from disk in the background (see ``ShardReader.prefetch``)."""
        self._reader.prefetch(shard)

    def read_raw(self, name: str) -> torch.Tensor:
        """Read any stored tensor (weights or scale sidecars) exactly as stored."""
        return self._reader.get(self.infos[name].shard, name)

    def close(self) -> None:
        self._reader.close()


def _layout_from_config(qc: dict | None) -> tuple[SourceKind, _Fp8Layout | None]:
    if not qc:
        return SourceKind.DENSE, None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise SourceError(f"block FP8 fmt {qc.get('fmt')!r} is not supported (only e4m3)",
                              key="quantization_config.fmt")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise SourceError(f"quantization_config.weight_block_size must be [rows, cols], got {block!r}",
                              key="quantization_config.weight_block_size")
        return SourceKind.BLOCK_FP8, _Fp8Layout("_scale_inv", block=tuple(block))
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        fmts = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
        fmts.discard(None)
        if not fmts <= {"float-quantized", "naive-quantized"}:
            raise SourceError(f"compressed-tensors source format {sorted(fmts)} is not supported "
                              "(only float-quantized FP8)", key="quantization_config.format")
        args = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
        args = [a for a in args if a.get("num_bits") == 8 and a.get("type") == "float"]
        if not args:
            raise SourceError("compressed-tensors source has no 8-bit float weight scheme",
                              key="quantization_config.config_groups")
        strategies = {a.get("strategy") for a in args}
        if len(strategies) != 1:
            raise SourceError(f"mixed FP8 strategies {sorted(map(str, strategies))} are not supported",
                              key="quantization_config.config_groups")
        a = args[0]
        strategy = a.get("strategy")
        if strategy == "block":
            return SourceKind.CT_FP8, _Fp8Layout("_scale", block=tuple(a["block_structure"]))
        if strategy == "group":
            return SourceKind.CT_FP8, _Fp8Layout("_scale", group=int(a["group_size"]))
        if strategy in ("tensor", "channel"):
            return SourceKind.CT_FP8, _Fp8Layout("_scale")
        raise SourceError(f"FP8 strategy {strategy!r} is not supported",
                          key="quantization_config.config_groups.weights.strategy")
    raise SourceError(f"source quant_method {method!r} is not supported (fp8, compressed-tensors "
                      "float-quantized, or unquantized)", key="quantization_config.quant_method")


def open_source(folder: str | Path) -> Source:
    """Open and validate a source folder: config, index, every shard header, FP8 pairs.

    Every check runs before any tensor data is read; all findings of one kind are reported
    together.

    Raises:
        SourceError: naming the file, key, shard or tensor at fault.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise SourceError(f"source folder {folder} does not exist")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise SourceError(f"{folder} has no config.json", key="config.json")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise SourceError(f"config.json is not valid JSON: {e}", key="config.json") from None
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    kind, layout = _layout_from_config(qc)
    weight_map = load_index(folder)
    infos = read_all_headers(folder, weight_map)
    return Source(folder, config, kind, layout, weight_map, infos)
