"""Source layouts, chosen from ``config.json`` ``quantization_config`` (never from shapes).

- ``fp8``: DeepSeek-V3 / GLM-5 block FP8. ``<m>.weight`` F8_E4M3 [N, K] with
  ``<m>.weight_scale_inv`` F32/BF16 [ceil(N/bh), ceil(K/bw)], a multiplier; (bh, bw) from
  ``weight_block_size``; ``scale_fmt: ue8m0`` only constrains the values (powers of two).
  [DeepSeek-V3 README_WEIGHTS.md, inference/kernel.py; docs/formats.md §A.1]
- ``compressed-tensors`` ``float-quantized``: ``<m>.weight`` F8_E4M3 with ``<m>.weight_scale``
  by strategy tensor / channel / group / block. [compressed-tensors
  quantization/lifecycle/initialize.py; docs/formats.md §A.2]
- dense: bf16 / fp16 / fp32 tensors, no ``quantization_config``.

A *header-only descriptor* (``{"config": {...}, "tensors": {name: {"dtype": "F8_E4M3",
"shape": [N, K]}}}``, one JSON file, e.g. from ``scripts/make_glm_fixture.py --size full``)
opens as a Source with headers and no data: planning works, ``read`` raises.

A *logical* tensor is what the model sees: an FP8 weight and its scale are one logical
tensor named like the weight, read back as float32. Scale sidecars never leave this module.

Fused 3-D experts (transformers >= 5 in-memory layout saved as is, ``archs.FUSED_EXPERT_PARAMS``):
``<block>.experts.gate_up_proj`` [E, 2I, H] (gate rows then up rows) and
``<block>.experts.down_proj`` [E, H, I], dense only, are split into the per-expert Linears
engines load, ``<block>.experts.<e>.{gate_proj,up_proj,down_proj}.weight`` [I, H] / [H, I]
(the names of DeepSeek / GLM releases and vLLM's expert mapping; docs/formats.md). Any other
3-D tensor under ``.experts.`` is refused: written through unquantized it would sit in a build
whose config says every Linear is NVFP4.

Activation and KV-cache sidecars of an FP8 source (:data:`DROPPED_SUFFIXES`: static
``input_scale``, ``k_scale`` / ``v_scale`` ...) are in the source's FP8 convention; they are
never carried into a build (``Source.dropped``, reported by the converter; docs/faults.md).
"""

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from formats.checkpoint import folder_findings, scan_headers, scan_index
from formats.shards import ShardReader, TensorInfo, prefetch_file, read_header
from quantize import archs
from quantize.base.errors import Finding, SourceError, raise_findings
from quantize.kernels.fp8 import dequantize_fp8_block, dequantize_fp8_broadcast

__all__ = ["SourceKind", "LogicalTensor", "ShardFiles", "Source", "inspect_source", "open_source", "read_config",
           "describe_dropped", "DROPPED_SUFFIXES", "SCALE_DTYPES"]

FP8_DTYPES = {"F8_E4M3"}
SCALE_DTYPES = {"F32", "BF16", "F16", "F8_E8M0"}
"""Stored dtypes of an FP8 weight's scale; ``F8_E8M0`` (2^(b-127), the ue8m0 scales of
DeepSeek-V3.1-style releases) is read as float32 powers of two."""
DROPPED_SUFFIXES = (".input_scale", ".input_zero_point", ".output_scale", ".k_scale",
                    ".v_scale", ".q_scale", ".prob_scale", ".kv_scale", ".activation_scale",
                    ".weight_zero_point")
"""Sidecars of an FP8 source (block FP8 or compressed-tensors) that describe its activations
or KV cache in the FP8 convention (static e4m3 input scales, FP8 KV scales amax/448); they do
not carry over to a re-quantized weight and are dropped and reported (``Source.dropped``)."""
CT_DROPPED_SUFFIXES = DROPPED_SUFFIXES  # former name
_FUSED_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<param>[A-Za-z0-9_]+)(?:\.weight)?$")


class SourceKind(str, Enum):
    """Source layouts; values are the config's ``quant_method`` (or ``dense``)."""

    BLOCK_FP8 = "fp8"
    CT_FP8 = "compressed-tensors"
    DENSE = "dense"


@dataclass(frozen=True)
class LogicalTensor:
    """A tensor as the model sees it: name, shard of its data, shape, source dtype, and the
    scale sidecar (FP8 only). ``part`` ``(stored name, expert e, row start, row stop)``: rows
    ``[start, stop)`` of expert ``e`` of a fused 3-D expert tensor [E, R, C] (module docstring)."""

    name: str
    shard: str
    shape: tuple[int, ...]
    dtype: str
    scale: TensorInfo | None = None
    part: tuple[str, int, int, int] | None = None

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
    scale_fmt: str | None = None  # block FP8 "ue8m0": scales declared powers of two


class ShardFiles:
    """Where a source's shard files are. This base class: already on disk in ``folder``.

    ``quantize.hub.download.HubShards`` overrides it to take headers from the Hub, download a shard on
    first read and delete it once no later shard reads it.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.check_on_open = True  # load_index checks that every shard file exists
        self.seen: dict[str, tuple[int, int]] = {}  # shard -> (size, mtime_ns) at header read

    def header(self, shard: str) -> dict[str, TensorInfo]:
        """Header of ``shard`` (tensor name -> TensorInfo), without reading tensor data; the
        file's (size, mtime_ns) just before is kept in ``seen``: the reader refuses a shard
        that differs from it when it opens it (changed mid-run, docs/faults.md)."""
        st = (self.folder / shard).stat()
        self.seen[shard] = (st.st_size, st.st_mtime_ns)
        return read_header(self.folder / shard)

    def expected(self, shard: str) -> tuple[int, int] | None:
        """(size, mtime_ns) the file had when its header was read; None if never read here."""
        return self.seen.get(shard)

    def path(self, shard: str) -> Path:
        """Local path of ``shard``, making it available first if needed."""
        return self.folder / shard

    def identity(self, shard: str) -> list:
        """What says a shard's bytes are unchanged (resume ledger): [size, mtime_ns].

        Raises:
            OSError: the file is gone.
        """
        st = (self.folder / shard).stat()
        return [st.st_size, st.st_mtime_ns]

    def release(self, shard: str) -> None:
        """``shard`` will not be read again in this run (a no-op for a local folder)."""

    def finish(self) -> None:
        """Every shard has been streamed."""

    def to_fetch(self) -> dict[str, int]:
        """Shard name -> bytes still to download before it can be read (none for a folder)."""
        return {}

    budget_limit: int | None = None
    """The user's most bytes of downloaded shards on disk at once (None: what the disk allows)."""

    def set_disk_budget(self, free_bytes: int) -> None:
        """``free_bytes`` of free disk are left for downloads once the rest of the build is
        reserved (``quantize.inspect.budget.check_free_disk``; a no-op for a folder)."""

    def will_read(self, orders: list[list[str]], rank: int, todo: list[str]) -> None:
        """The converter's plan before its first read: ``orders`` every rank's shards in the
        order its stream first reads them (:meth:`Source.read_order`), ``todo`` this rank's
        without the shards an earlier run finished (a no-op for a folder; a Hub source starts
        downloading ahead)."""

    def close(self) -> None:
        """Stop any background work (the source is closed)."""


class Source:
    """A source checkpoint folder with lazy, dequantizing reads.

    ``findings`` holds the FP8 pairing and fused-expert problems found while building the
    logical tensors (kind ``fp8``; :func:`open_source` refuses a source with any error) and
    warnings (F8_E8M0 scales under a config that declares no ``scale_fmt: ue8m0``). ``unreadable`` names
    tensors the index lists whose shard or header entry could not be read (already reported).
    """

    def __init__(self, folder: Path, config: dict, kind: SourceKind, layout: _Fp8Layout | None,
                 weight_map: dict[str, str], infos: dict[str, TensorInfo], has_data: bool = True,
                 files: ShardFiles | None = None, unreadable: frozenset[str] = frozenset()):
        self.folder, self.config, self.kind, self.layout = Path(folder), config, kind, layout
        self.weight_map, self.infos, self.has_data = weight_map, infos, has_data
        self.unreadable = unreadable
        self.files = files or ShardFiles(self.folder)
        self.tensors: dict[str, LogicalTensor] = {}
        self.dropped: list[str] = []
        self.split: dict[str, list[str]] = {}  # fused 3-D expert tensor -> its logical tensors
        # O_DIRECT for shards already on disk; a fetched shard was just written (its bytes are
        # in the page cache)
        self._reader = ShardReader(self.folder, max_open=2, locate=self.files.path,
                                   direct=type(self.files) is ShardFiles,
                                   expect=getattr(self.files, "expected", None))
        self.findings = self._build_logical(unreadable)

    # ---- structure -------------------------------------------------------------------
    def _build_logical(self, unreadable: frozenset[str]) -> list[Finding]:
        """Pair FP8 weights with their scales. Names in ``unreadable`` (listed, but in a shard
        whose header failed) are already reported and never reported again here."""
        problems: list[tuple[str, str]] = []
        suffix = self.layout.scale_suffix if self.layout else None
        fused = self._split_fused_experts(problems)
        e8m0: dict[str, list[str]] = {}
        warnings: list[Finding] = []
        for name, info in sorted(self.infos.items()):
            if name in fused:
                continue
            if suffix and name.endswith(".weight" + suffix):
                if name[: -len(suffix)] not in self.infos and name[: -len(suffix)] not in unreadable:
                    problems.append((name, f"orphan scale {name} in {info.shard}: no weight "
                                           f"{name[: -len(suffix)]}"))
                continue
            if self.kind is not SourceKind.DENSE and name.endswith(DROPPED_SUFFIXES):
                self.dropped.append(name)
                continue
            scale = None
            if info.dtype in FP8_DTYPES:
                if self.layout is None:
                    problems.append((name, f"{name} in {info.shard} is FP8 but config.json "
                                           "declares no FP8 quantization_config"))
                    continue
                scale = self.infos.get(name + suffix)
                if scale is None:
                    if name + suffix not in unreadable:
                        problems.append((name, f"FP8 weight {name} in {info.shard} has no "
                                               f"{name + suffix}"))
                    continue
                err = self._check_scale(info, scale)
                if err:
                    problems.append((name, err))
                    continue
                if scale.dtype == "F8_E8M0" and self.layout.scale_fmt != "ue8m0":
                    e8m0.setdefault(scale.shard, []).append(scale.name)
            elif info.dtype.startswith("F8"):
                problems.append((name, f"{name} in {info.shard} has dtype {info.dtype}; only "
                                       "F8_E4M3 FP8 sources are supported"))
                continue
            self.tensors[name] = LogicalTensor(name, info.shard, info.shape, info.dtype, scale)
        for shard, names in sorted(e8m0.items()):
            warnings.append(Finding(
                "warning", "fp8", f"shard {shard}: {len(names)} scale(s) stored as F8_E8M0 (e.g. "
                f"{names[0]}) but quantization_config declares no scale_fmt 'ue8m0'; read as the "
                "powers of two they encode", tensor=names[0], shard=shard))
        return [Finding("error", "fp8", msg, tensor=n, shard=self.infos[n].shard if n in self.infos
                        else self.tensors[n].shard if n in self.tensors else None)
                for n, msg in problems] + warnings

    def _split_fused_experts(self, problems: list[tuple[str, str]]) -> set[str]:
        """Logical per-expert tensors from fused 3-D experts (module docstring); problems for
        every 3-D tensor under ``.experts.`` that is not that layout. Returns the stored
        names consumed (split or refused)."""
        consumed: set[str] = set()
        blocks: dict[str, dict[str, TensorInfo]] = {}
        for name, info in self.infos.items():
            m = _FUSED_EXPERT.match(name)
            if m and len(info.shape) >= 3:
                blocks.setdefault(m["block"], {})[m["param"]] = info
                consumed.add(name)
        hidden = archs.text_config(self.config).get("hidden_size")
        want = "; expected transformers' experts.gate_up_proj [E, 2I, H] (gate rows then up " \
               "rows) with experts.down_proj [E, H, I]"
        refuse = "refusing to write routed experts unquantized under a config that says every " \
                 "Linear is quantized"
        for block, params in sorted(blocks.items()):
            gu, down = params.get("gate_up_proj"), params.get("down_proj")
            odd = sorted(set(params) - {"gate_up_proj", "down_proj"})
            if odd:
                info = params[odd[0]]
                problems.append((info.name, f"fused 3-D expert tensor {info.name} {list(info.shape)} in "
                                 f"{info.shard}: layout not understood{want}; {refuse}"))
                continue
            if gu is None or down is None:
                have = gu or down
                problems.append((have.name, f"fused 3-D expert tensor {have.name} in {have.shard} "
                                 f"has no {block}.{'down_proj' if down is None else 'gate_up_proj'}"
                                 f"{want}; {refuse}"))
                continue
            if any(i.dtype.startswith("F8") or i.dtype in ("U8", "I8") for i in (gu, down)):
                q = gu if gu.dtype.startswith("F8") or gu.dtype in ("U8", "I8") else down
                problems.append((q.name, f"fused 3-D expert tensor {q.name} in {q.shard} has dtype "
                                 f"{q.dtype}: only bf16 / fp16 / fp32 fused experts are split; "
                                 f"dequantize it or store the experts per expert; {refuse}"))
                continue
            ok = (len(gu.shape) == 3 and len(down.shape) == 3 and gu.shape[0] == down.shape[0]
                  and gu.shape[1] % 2 == 0 and gu.shape[1] // 2 == down.shape[2]
                  and gu.shape[2] == down.shape[1] and (hidden is None or gu.shape[2] == hidden))
            if not ok:
                problems.append((gu.name, f"fused 3-D expert tensors {gu.name} {list(gu.shape)} and "
                                 f"{down.name} {list(down.shape)} in {gu.shard} do not fit each other"
                                 f"{' and hidden_size ' + str(hidden) if hidden is not None else ''}"
                                 f"{want}; {refuse}"))
                continue
            e_count, rows, h = gu.shape
            inter = rows // 2
            names = []
            for e in range(e_count):
                for proj, info, start, stop, shape in (
                        ("gate_proj", gu, 0, inter, (inter, h)), ("up_proj", gu, inter, rows, (inter, h)),
                        ("down_proj", down, 0, h, (h, inter))):
                    n = f"{block}.{e}.{proj}.weight"
                    if n in self.infos:
                        problems.append((n, f"{n} is stored both per expert and in the fused "
                                         f"{info.name} ({info.shard}); keep one of them"))
                        continue
                    self.tensors[n] = LogicalTensor(n, info.shard, shape, info.dtype, None,
                                                    (info.name, e, start, stop))
                    names.append(n)
            self.split[gu.name] = [n for n in names if self.tensors[n].part[0] == gu.name]
            self.split[down.name] = [n for n in names if self.tensors[n].part[0] == down.name]
        return consumed

    def _check_scale(self, w: TensorInfo, s: TensorInfo) -> str | None:
        if len(w.shape) != 2:
            return f"FP8 weight {w.name} in {w.shard} is {len(w.shape)}-D; expected 2-D"
        if s.dtype not in SCALE_DTYPES:
            return (f"scale {s.name} in {s.shard} has dtype {s.dtype}; expected F32, BF16, F16 "
                    "or F8_E8M0")
        n, k = w.shape
        lay = self.layout
        if lay.block:
            bh, bw = lay.block
            ok = {(-(-n // bh), -(-k // bw))}
        elif lay.group:
            ok = {(n, -(-k // lay.group))}
        else:  # tensor or channel strategy
            ok = {(n, 1), (n,), (1,), (), (1, 1)}
        if tuple(s.shape) not in ok:
            want = " or ".join(str(list(x)) for x in sorted(ok, key=len, reverse=True)[:2])
            return (f"scale {s.name} in {s.shard} has shape {list(s.shape)}; weight {w.name} "
                    f"{n}x{k} needs {want}")
        return None

    @property
    def shards(self) -> list[str]:
        """Shard file names in index order (sorted names)."""
        return sorted(set(self.weight_map.values()))

    def tensors_in(self, shard: str) -> list[LogicalTensor]:
        """Logical tensors whose data lives in ``shard`` (their scale may live elsewhere)."""
        return [t for t in self.tensors.values() if t.shard == shard]

    def reads_of(self, shard: str) -> set[str]:
        """Shards read to convert the tensors of ``shard``: their data and scale sidecars.

        Fused-group partners in other shards are not listed: the converter keeps their amax
        (in memory and in its resume ledger) once it has read them; the shards of those a
        stream does not convert itself (another rank's) come from the converter as the
        ``partners`` of :meth:`read_order` and :meth:`stream`.
        """
        out = {shard}
        for t in self.tensors_in(shard):
            out.add(t.shard)
            if t.scale is not None:
                out.add(t.scale.shard)
        return out

    def read_order(self, shards: list[str], partners: dict[str, set[str]] | None = None
                   ) -> list[str]:
        """Shard files in the order a :meth:`stream` of ``shards`` first reads them: each
        shard of ``shards`` in index order, followed by the other shards it reads
        (:meth:`reads_of` and ``partners[shard]``, sorted) not read before.

        ``partners``: shard -> further shards the converter reads to convert it (the shards of
        fused-group partners whose amax it does not hold: one another rank converts,
        ``quantize.convert.pipeline._partner_reads``); the same mapping as its :meth:`stream`.
        """
        reads = self._reads(shards, partners)
        out: list[str] = []
        for s, rs in reads.items():
            for r in [s, *sorted(rs - {s})]:
                if r not in out:
                    out.append(r)
        return out

    def _reads(self, shards: list[str] | None, partners: dict[str, set[str]] | None
               ) -> dict[str, set[str]]:
        """Shards of ``shards`` (all when None) in index order -> every shard converting it
        reads (:meth:`reads_of` plus ``partners``)."""
        wanted = set(self.shards if shards is None else shards)
        return {s: self.reads_of(s) | set((partners or {}).get(s, ())) for s in self.shards
                if s in wanted}

    def __reduce__(self):
        # another process (--workers) opens the same source again: the folder and the shard
        # files object (a Hub stream pickles its plan, not its threads)
        return (open_source, (self.folder, self.files))

    def stream(self, shards: list[str] | None = None,
               partners: dict[str, set[str]] | None = None) -> Iterator[str]:
        """Yield shard names in index order (all, or those of ``shards``: one rank's share).
        When the caller moves on from a shard, every shard read so far (those yielded, the
        shards they read: :meth:`reads_of` and ``partners``, as in :meth:`read_order`) that
        no later shard reads is closed and handed to ``files.release`` once (a Hub source
        deletes it when no rank reads it any more), so only the current shard and its
        cross-shard partners stay on disk. ``files.finish()`` runs after the last shard."""
        reads = self._reads(shards, partners)
        order = list(reads)
        released: set[str] = set()
        for i, shard in enumerate(order):
            yield shard
            read = set().union(*(reads[s] for s in order[: i + 1]))
            later = set().union(*(reads[s] for s in order[i + 1:]))
            for s in self.shards:
                if s in read and s not in later and s not in released:
                    released.add(s)
                    self._reader.drop(s)
                    self.files.release(s)
        self.files.finish()

    # ---- reads -----------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """Read a logical tensor. FP8 weights come back dequantized as float32 [N, K];
        everything else exactly as stored (dtype and bits unchanged).

        Raises:
            SourceError: naming the tensor and shard when the bytes cannot be read, or when
                the source is a header-only descriptor.
        """
        self._require_data(name)
        t = self.tensors[name]
        if t.part is not None:
            stored, e, start, stop = t.part
            return self._reader.get(t.shard, stored, rows=(e, e + 1))[0, start:stop].clone()
        raw = self._reader.get(t.shard, name)
        if t.scale is None:
            return raw
        scale = self._scale(t)
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
        self._require_data(name)
        raw = self._reader.get(t.shard, name)
        scale = self._scale(t)
        n, k = raw.shape
        if self.layout.block:
            return raw, scale, tuple(self.layout.block)
        if self.layout.group:
            return raw, scale, (1, self.layout.group)
        if scale.numel() == 1:
            return raw, scale.reshape(1, 1), (n, k)
        return raw, scale.reshape(n, 1), (1, k)

    def prefetch(self, shard: str) -> None:
        """Start reading ``shard`` from disk in the background when it is already on disk
        (``formats.shards.prefetch_file``); never fetches it. Nothing where the reader reads
        large tensors with O_DIRECT (the page cache would be filled for nothing)."""
        if not self._reader.direct:
            prefetch_file(self.files.folder / shard)

    def read_raw(self, name: str) -> torch.Tensor:
        """Read any stored tensor (weights or scale sidecars) exactly as stored."""
        self._require_data(name)
        return self._reader.get(self.infos[name].shard, name)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a 2-D logical tensor, as :meth:`read` would give them
        (FP8 dequantized to float32 [stop - start, K]), reading only those rows and the
        scale rows they use."""
        self._require_data(name)
        t = self.tensors[name]
        if t.part is not None:
            return self.read(name)[start:stop].clone()
        raw = self._reader.get(t.shard, name, rows=(start, stop))
        if t.scale is None:
            return raw
        lay = self.layout
        if lay.block:
            bh = lay.block[0]
            s = _e8m0_as_f32(self._reader.get(t.scale.shard, t.scale.name,
                                              rows=(start // bh, -(-stop // bh))))
            s = s.repeat_interleave(bh, dim=0)[start - (start // bh) * bh:][: stop - start]
            return dequantize_fp8_block(raw, s, (1, lay.block[1]))
        scale_rows = t.scale.shape[0] if len(t.scale.shape) == 2 else 1
        s = _e8m0_as_f32(self._reader.get(t.scale.shard, t.scale.name, rows=(start, stop))
                         if scale_rows == t.shape[0] and scale_rows > 1 else self.read_raw(t.scale.name))
        return dequantize_fp8_broadcast(raw, s, lay.group)

    def _scale(self, t: LogicalTensor) -> torch.Tensor:
        """The scale of FP8 ``t`` as stored, F8_E8M0 as float32 (powers of two)."""
        return _e8m0_as_f32(self._reader.get(t.scale.shard, t.scale.name))

    def _require_data(self, name: str) -> None:
        if not self.has_data:
            raise SourceError(f"cannot read {name}: {self.folder.name} is a header-only descriptor "
                              "(no tensor data); it can be planned (recipe show, plan) but not "
                              "converted", tensor=name, shard=self.folder.name)

    def close(self) -> None:
        self._reader.close()
        self.files.close()


def _e8m0_as_f32(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.float32) if scale.dtype == torch.float8_e8m0fnu else scale


def describe_dropped(names: list[str]) -> str:
    """One summary line for the sidecars a source dropped (``Source.dropped``): count, count
    per kind and an example, e.g. ``dropped 3 FP8 activation/KV sidecars (input_scale 1,
    k_scale 1, v_scale 1; e.g. a.input_scale): ...``."""
    kinds: dict[str, int] = {}
    for n in names:
        k = n.rsplit(".", 1)[-1]
        kinds[k] = kinds.get(k, 0) + 1
    per = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    return (f"dropped {len(names)} FP8 activation/KV sidecars ({per}; e.g. {sorted(names)[0]}): "
            "they are in the source's FP8 convention and are not carried into the build "
            "(quantize calibrate writes W4A4 input scales and FP8 KV scales in the target's)")


def _layout_from_config(qc: dict | None) -> tuple[SourceKind, _Fp8Layout | None]:
    if not qc:
        return SourceKind.DENSE, None
    if not isinstance(qc, dict):
        raise SourceError("config.json quantization_config must be an object",
                          key="quantization_config")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise SourceError(f"block FP8 fmt {qc.get('fmt')!r} is not supported (only e4m3)",
                              key="quantization_config.fmt")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise SourceError(f"quantization_config.weight_block_size must be [rows, cols], got {block!r}",
                              key="quantization_config.weight_block_size")
        fmt = qc.get("scale_fmt")
        return SourceKind.BLOCK_FP8, _Fp8Layout("_scale_inv", block=tuple(block),
                                                scale_fmt=fmt if isinstance(fmt, str) else None)
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
            block = a.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise SourceError(f"FP8 block strategy needs block_structure [rows, cols], got {block!r}",
                                  key="quantization_config.config_groups.weights.block_structure")
            return SourceKind.CT_FP8, _Fp8Layout("_scale", block=tuple(block))
        if strategy == "group":
            group = a.get("group_size")
            if not (isinstance(group, int) and group > 0):
                raise SourceError(f"FP8 group strategy needs a positive group_size, got {group!r}",
                                  key="quantization_config.config_groups.weights.group_size")
            return SourceKind.CT_FP8, _Fp8Layout("_scale", group=group)
        if strategy in ("tensor", "channel"):
            return SourceKind.CT_FP8, _Fp8Layout("_scale")
        raise SourceError(f"FP8 strategy {strategy!r} is not supported",
                          key="quantization_config.config_groups.weights.strategy")
    raise SourceError(f"source quant_method {method!r} is not supported (fp8, compressed-tensors "
                      "float-quantized, or unquantized)", key="quantization_config.quant_method")


def _open_descriptor(path: Path) -> Source:
    """A header-only descriptor file as a Source without data (every tensor's shard is the
    descriptor's file name)."""
    shape = '{"config": {...}, "tensors": {name: {"dtype", "shape"}}}'
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SourceError(f"{path.name} is not valid JSON ({e}); a header-only descriptor is "
                          f"{shape}", key=path.name) from None
    if isinstance(data, dict) and "tensors" not in data and (
            path.name == "config.json" or "model_type" in data or "architectures" in data):
        raise SourceError(f"{path} is a model's config.json, not a header-only descriptor {shape}: "
                          f"give the folder that holds it and its shards ({path.parent})",
                          key=path.name)
    missing = ([k for k in ("config", "tensors") if not isinstance(data.get(k), dict)]
               if isinstance(data, dict) else ["config", "tensors"])
    if missing:
        raise SourceError(f"{path.name} is not a header-only descriptor {shape}: it has no "
                          f"{' and no '.join(repr(k) for k in missing)} object", key=path.name)
    config, tensors = data["config"], data["tensors"]
    infos = {}
    for name, spec in tensors.items():
        try:
            info = TensorInfo(name, path.name, spec["dtype"], tuple(int(d) for d in spec["shape"]))
            info.nbytes  # noqa: B018  (unknown dtype -> KeyError)
        except (KeyError, TypeError, ValueError):
            raise SourceError(f"{path.name}: tensor {name} needs a known dtype and an integer shape, "
                              f"got {spec!r}", tensor=name, shard=path.name) from None
        infos[name] = info
    qc = config.get("quantization_config")
    if qc is None:
        qc = archs.text_config(config).get("quantization_config")
    kind, layout = _layout_from_config(qc)
    return Source(path, config, kind, layout, {n: path.name for n in infos}, infos, has_data=False)


def read_config(folder: str | Path) -> dict:
    """``folder/config.json`` as a dict, checked as pre-flight checks it: readable JSON, an
    object, integer counts of the right type (``archs.config_type_errors``), an object
    ``quantization_config``. For commands that need the config before (or without) opening
    the source: ``plan``, ``calibrate``.

    Raises:
        SourceError: naming config.json and the key at fault (the first problem).
    """
    config, findings = _read_config(Path(folder))
    if findings:
        raise SourceError(findings[0].message, key=findings[0].key)
    for key, message in archs.config_type_errors(config):
        raise SourceError(message, key=key)
    for where in (config, archs.text_config(config)):
        qc = where.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise SourceError("config.json quantization_config must be an object",
                              key="quantization_config")
    return config


def _read_config(folder: Path) -> tuple[dict, list[Finding]]:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        return {}, [Finding("error", "config", f"{folder} has no config.json", key="config.json")]
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        return {}, [Finding("error", "config", f"config.json is not valid JSON: {e}",
                            key="config.json")]
    if not isinstance(config, dict):
        return {}, [Finding("error", "config", "config.json is not a JSON object",
                            key="config.json")]
    return config, []


def inspect_source(folder: str | Path, files: ShardFiles | None = None
                   ) -> tuple["Source | None", list[Finding]]:
    """Open a source folder (or a header-only descriptor ``*.json``) and collect every
    structural problem, of every kind, at once: config.json and its ``quantization_config``,
    the index (entries outside the folder, missing or empty shards), every shard header,
    index vs headers, FP8 weight/scale pairs. No tensor data is read. ``files`` says where
    shards are and supplies their headers (default: all in ``folder``; ``quantize.hub.download``
    passes one backed by the Hub and its cache).

    Returns:
        ``(source, findings)``; source is None when the config or index is unusable.
    """
    folder = Path(folder)
    if folder.is_file() and folder.suffix == ".json":
        source = _open_descriptor(folder)
        return source, source.findings
    if not folder.is_dir():
        return None, [Finding("error", "config", f"source folder {folder} does not exist")]
    config, findings = _read_config(folder)
    qc = config.get("quantization_config")
    if qc is None:
        qc = archs.text_config(config).get("quantization_config")
    layout_ok = not findings
    kind, layout = SourceKind.DENSE, None
    if layout_ok:
        try:
            kind, layout = _layout_from_config(qc)
        except SourceError as e:
            findings.append(Finding.of(e, "config"))
            layout_ok = False
    files = files or ShardFiles(folder)
    weight_map, idx_findings, listed = scan_index(folder, check_files=files.check_on_open)
    infos, hdr_findings = scan_headers(folder, weight_map, files.header)
    findings += idx_findings + hdr_findings
    if type(files) is ShardFiles:  # a Hub source's folder holds only what it fetched
        findings += folder_findings(folder, weight_map)
    if not layout_ok or not weight_map:
        return None, findings
    unreadable = frozenset(n for n in listed if n not in infos)
    source = Source(folder, config, kind, layout, weight_map, infos, files=files,
                    unreadable=unreadable)
    return source, findings + source.findings


def open_source(folder: str | Path, files: ShardFiles | None = None) -> Source:
    """Open and validate a source folder (config, index, every shard header, FP8 pairs), or
    a header-only descriptor ``*.json`` (see module docstring).

    Every check runs before any tensor data is read; all findings, of every kind, are
    reported together (see :func:`inspect_source`).

    Raises:
        SourceError: listing each problem with the file, key, shard or tensor at fault.
    """
    source, findings = inspect_source(folder, files)
    raise_findings(findings, Path(folder).name)
    return source
