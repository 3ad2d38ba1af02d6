"""``quantize plan``: will a build fit on one, two or four GB10 nodes, and with what KV pool.

Reads only safetensors headers and config.json. The memory model, per TP rank (a GB10 node
has one GPU, so by default TP = nodes and a rank has the whole node)::

    budget    = node memory × mem-util / ranks per node
    weights   = Σ split tensor bytes / TP + Σ replicated tensor bytes (archs.tp_replicated_role)
    reserve   = activation peak + non-torch (NCCL, CUDA context) + CUDA graphs
    draft     = MTP layer weights (--draft mtp) or SIZE / TP (--draft external:SIZE)
    KV pool   = budget − weights − reserve − draft
    tokens    = ⌊KV pool / (bytes per token × block)⌋ × block

the shape of vLLM's ``determine_available_memory`` (``available_kv = total × util −
peak``, vllm/v1/worker/gpu_worker.py) and its block rounding (docs/eval.md §6.2). Bytes per
token and per sequence come from ``quantize.archs.kvcache``. A session of length ``n`` (128k =
128,000 input tokens, the seeds' convention) needs ``n + answer`` tokens plus its fixed
per-sequence state (KDA, indexer tail) expressed in tokens, so a pool holds
``pool_tokens / (n + answer + state_tokens)`` of them. The verdict is vLLM's startup check:
one ``max_model_len`` request must fit in the pool (``check_enough_kv_cache_memory``,
vllm/v1/core/kv_cache_utils.py); the margin is what is left after it.

Default runtime reserve, 6 GiB per rank: activation peak 4 GiB, non-torch 1 GiB, CUDA graphs
1 GiB. Anchor: a 2x Spark TP2 deployment with ~94 GiB of weights per rank has no KV cache at
mem-util 0.80 (3.4 GiB left) and runs at 0.90 (15.5 GiB left), so its reserve lies between
(docs/eval.md §6.2); vLLM's own log for a 7B model shows activation 9.4 GiB at long
batched-token counts, so raise ``--activation-gib`` for large ``max_num_batched_tokens``.

Output tensors come from the converter's own ``plan.plan_tensors`` and ``plan.predict_outputs``
(names, dtypes and shapes from the output writer); the tests hold the prediction equal to the
converted build, byte for byte and tensor for tensor.
"""

import json
import math
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from formats.checkpoint import load_index, read_all_headers
from formats.compressed_tensors import FORMAT_NAME as CT_NVFP4_FORMAT
from formats.manifest import MANIFEST_NAME
from formats.shards import TensorInfo
from formats.sources import open_source, read_config
from quantize import archs
from quantize.archs.kvcache import KVDtype, KVModel, kv_model
from quantize.plan.recipe import default_recipe, load_recipe
from quantize.plan.tensors import arch_assumption, plan_tensors, predict_outputs

PLAN_NAME = "plan.json"  # the fit table in a build folder, read by its model card

__all__ = ["GIB", "PLAN_NAME", "write_plan", "SESSION_INPUTS", "Reserve", "Draft", "parse_draft", "parse_size",
           "BuildTensors", "build_tensors", "sessions", "WeightTerm", "FitReport", "plan_fit"]

GIB = 2**30
SESSION_INPUTS = {"128k": 128_000, "256k": 256_000, "512k": 512_000, "1M": 1_000_000}
"""Input tokens of the session lengths reported (k = 1000, the seeds' convention)."""


@dataclass(frozen=True)
class Reserve:
    """Runtime memory per rank outside weights and KV, in GiB (see module docstring)."""

    activation_gib: float = 4.0
    non_torch_gib: float = 1.0
    graphs_gib: float = 1.0

    def __post_init__(self):
        if min(self.activation_gib, self.non_torch_gib, self.graphs_gib) < 0:
            raise ValueError("runtime reserve terms must be >= 0 GiB")

    @property
    def total_gib(self) -> float:
        return self.activation_gib + self.non_torch_gib + self.graphs_gib


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(?:([kmgt])(i)?)?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from ``"5GiB"``, ``"4.5GB"``, ``"3e9"`` (GB, MB… decimal; GiB, MiB… binary).

    Raises:
        ValueError: not a size.
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (examples: 5GiB, 4.5GB, 3e9)")
    unit = ((m.group(2) or "") + ("i" if m.group(3) else "")).lower()
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Draft:
    """A speculative-decoding arm: ``none``, ``mtp`` (the checkpoint's MTP layers), or
    ``external`` (a separate draft model of ``size_bytes``, split over TP like vLLM's default
    ``draft_tensor_parallel_size``, whose KV costs ``kv_bytes_per_token`` per rank)."""

    kind: str
    size_bytes: int = 0
    kv_bytes_per_token: int = 0

    @property
    def label(self) -> str:
        if self.kind != "external":
            return self.kind
        kv = f", kv {self.kv_bytes_per_token} B/token" if self.kv_bytes_per_token else ""
        return f"external {self.size_bytes / GIB:.2f} GiB{kv}"


def parse_draft(text: str) -> Draft:
    """``none`` | ``mtp`` | ``external:SIZE`` | ``external:SIZE,kv=BYTES_PER_TOKEN``.

    Raises:
        ValueError: anything else, with the accepted forms.
    """
    if text in ("none", "mtp"):
        return Draft(text)
    if text.startswith("external:"):
        size, _, kv = text[len("external:"):].partition(",")
        kv_bytes = 0
        if kv:
            if not kv.startswith("kv="):
                raise ValueError(f"--draft {text}: expected external:SIZE,kv=BYTES")
            kv_bytes = parse_size(kv[3:])
        return Draft("external", parse_size(size), kv_bytes)
    raise ValueError(f"--draft {text!r}: use none, mtp, external:SIZE or external:SIZE,kv=BYTES")


def sessions(pool_tokens: int, input_tokens: int, answer_tokens: int = 2048,
             state_tokens: float = 0.0) -> float:
    """How many sessions of ``input_tokens + answer_tokens`` a pool of ``pool_tokens`` holds
    at once, each also costing ``state_tokens`` (its per-sequence state in token units)."""
    return pool_tokens / (input_tokens + answer_tokens + state_tokens)


@dataclass(frozen=True)
class WeightTerm:
    """Weights of one kind: total bytes in the build and bytes resident on each rank."""

    what: str
    tensors: int
    total_bytes: int
    per_rank_bytes: int


@dataclass
class FitReport:
    """Every term of the plan, per rank unless named per node. Bytes are exact integers;
    ``*_gib`` are GiB (2^30 B)."""

    source: str
    model: str
    recipe: str
    nodes: int
    tp: int
    ranks_per_node: int
    mem_util: float
    node_mem_gib: float
    kv_dtype: str
    draft: str
    max_model_len: int
    answer_tokens: int
    block_size: int
    budget_bytes: int
    weights: list[WeightTerm]
    weights_bytes: int
    reserve: Reserve
    reserve_bytes: int
    draft_bytes: int
    kv_pool_bytes: int
    kv: KVModel
    bytes_per_token: float
    bytes_per_seq: int
    kv_pool_tokens: int
    state_tokens: float
    sessions: dict[str, float | None]
    fits: bool
    margin_bytes: int
    build_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def margin_gib(self) -> float:
        return self.margin_bytes / GIB

    def to_json(self) -> dict:
        """A JSON-ready dict of every term (bytes, GiB, tokens, sessions, verdict)."""
        d = asdict(self)
        d["reserve"]["total_gib"] = self.reserve.total_gib
        d["kv"]["bytes_per_token"] = self.kv.bytes_per_token
        d["kv"]["bytes_per_seq"] = self.kv.bytes_per_seq
        d["weights_per_node_bytes"] = self.weights_bytes * self.ranks_per_node
        d["margin_gib"] = round(self.margin_gib, 3)
        return json.loads(json.dumps(d, default=str))

    def fit_row(self) -> dict:
        """This plan as one row of a build's ``plan.json`` fit table (model_cards/README.md:
        ``{"fit": [row, ...]}``, the card's columns are the first row's keys, in order)."""
        row = {"nodes": self.nodes, "TP": self.tp, "KV dtype": self.kv_dtype, "draft": self.draft,
               "max-model-len": self.max_model_len, "weights GiB/rank": round(self.weights_bytes / GIB, 2),
               "KV pool tokens": self.kv_pool_tokens}
        row.update({f"sessions {k}": "-" if v is None else round(v, 1) for k, v in self.sessions.items()})
        row["fits"] = "yes" if self.fits else "no"
        return row

    def render(self) -> str:
        """The plan as a text table, one term per line (GiB per rank)."""
        def row(label: str, nbytes: float, indent: int = 2) -> str:
            return f"{' ' * indent}{label:<{60 - indent}}{nbytes / GIB:>10.2f}"

        r = self.reserve
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        lines = [f"plan: {self.model} · recipe {self.recipe} · {nodes} · TP{self.tp} · "
                 f"KV {self.kv_dtype} · draft {self.draft}",
                 f"build on disk: {self.build_bytes / GIB:.2f} GiB",
                 f"{'memory per rank (' + str(self.ranks_per_node) + ' per node)':<60}{'GiB':>10}",
                 row(f"node memory {self.node_mem_gib:g} GiB × mem-util {self.mem_util:g}"
                     + (f" / {self.ranks_per_node} ranks" if self.ranks_per_node > 1 else ""),
                     self.budget_bytes),
                 row("− weights resident", self.weights_bytes)]
        lines += [row(w.what, w.per_rank_bytes, 6) for w in self.weights]
        lines.append(row(f"− runtime reserve (activation {r.activation_gib:g} + non-torch "
                         f"{r.non_torch_gib:g} + graphs {r.graphs_gib:g})", self.reserve_bytes))
        if self.draft_bytes:
            lines.append(row(f"− draft weights ({self.draft})", self.draft_bytes))
        lines.append(row("= KV pool", self.kv_pool_bytes))
        lines.append(f"KV per rank: {self.bytes_per_token:,.2f} B per token, "
                     f"{self.bytes_per_seq / 2**20:,.2f} MiB per sequence "
                     f"(= {self.state_tokens:,.0f} tokens)")
        for t in self.kv.terms:
            cost = " + ".join(c for c in (f"{t.per_token:g} B/token" if t.per_token else "",
                                          f"{_kib(t.per_seq)}/seq" if t.per_seq else "") if c)
            lines.append(f"  {t.layers:3d} × {t.what:<38} {cost:<24} {t.layout}")
        lines.append(f"KV pool: {self.kv_pool_tokens:,} tokens (block {self.block_size})")
        lines.append(f"sessions at once (input + {self.answer_tokens:,} answer tokens): "
                     + " · ".join(f"{k} {'-' if v is None else f'{v:.1f}'}"
                                  for k, v in self.sessions.items()))
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"max-model-len {self.max_model_len:,}: {verdict}, margin "
                     f"{self.margin_gib:+.2f} GiB per rank")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _kib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def _is_build(folder: Path, config: dict) -> bool:
    """An NVFP4 build (read as stored), not a source: ours (manifest), ModelOpt, or
    compressed-tensors whose format (top level or any config group) is NVFP4 or mixed."""
    qc = (config.get("quantization_config")
          or archs.text_config(config).get("quantization_config") or {})
    groups = qc.get("config_groups") or {}
    fmts = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    return ((folder / MANIFEST_NAME).is_file() or qc.get("quant_method") == "modelopt"
            or bool(fmts & {CT_NVFP4_FORMAT, "mixed-precision"}))


@dataclass(frozen=True)
class BuildTensors:
    """The tensors of a build, as ``(name, shape, bytes)``: predicted for a source at TP
    ``tp``, or read from a build folder (``recipe`` ``as stored``, ``tp`` None). ``assumed``:
    what the plan of an unknown ``model_type`` assumed (``plan.tensors.arch_assumption``)."""

    source: str
    config: dict
    recipe: str
    tensors: tuple[tuple[str, tuple[int, ...], int], ...]
    tp: int | None = None
    assumed: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(b for _, _, b in self.tensors)

    @cached_property
    def placement(self) -> tuple[tuple[str | None, int | None, int], ...]:
        """Per tensor: (why every TP rank holds it whole or None, MTP layer index or None,
        bytes). MTP layers are those at index >= num_hidden_layers."""
        n_layers = archs.text_config(self.config).get("num_hidden_layers", 1 << 30)
        out = []
        for name, shape, nbytes in self.tensors:
            layer = archs.decoder_layer_of(name)
            role = archs.tp_replicated_role(name, tuple(shape))
            out.append((role, layer if layer is not None and layer >= n_layers else None, nbytes))
        return tuple(out)


def build_tensors(src: str | Path, recipe: str | None = None, fmt: str = "compressed-tensors",
                  tp: int = 1, engine: str = "vllm", allow_unknown_arch: bool = False) -> BuildTensors:
    """Every tensor a build of ``src`` holds, from headers and config only: an FP8 / dense
    source folder or header-only descriptor is predicted with the converter's own functions
    (``plan.plan_tensors`` for ``tp`` / ``engine``, then ``plan.predict_outputs`` through the
    ``fmt`` writer; tied heads dropped as the converter drops them); an NVFP4 build folder is
    read as stored. ``recipe`` None: the source's ``--recipe`` default
    (``plan.recipe.default_recipe``: spark-mixed for glm5_next, else weight-only).

    Raises:
        SourceError, RecipeError: unreadable source or recipe (named).
    """
    folder = Path(src)
    config = read_config(folder) if (folder / "config.json").is_file() else None
    if config is not None and _is_build(folder, config):
        infos = read_all_headers(folder, load_index(folder))
        rows = tuple((n, i.shape, i.nbytes) for n, i in sorted(infos.items()))
        return BuildTensors(str(folder), config, "as stored", rows)
    source = open_source(folder)
    rec = load_recipe(recipe or default_recipe(source.config))
    decisions = plan_tensors(source, rec, tp=tp, engine=engine, allow_unknown_arch=allow_unknown_arch)
    outputs = predict_outputs(source, decisions, fmt)
    rows = tuple((n, tuple(shape), TensorInfo(n, "", dtype, tuple(shape)).nbytes)
                 for per_tensor in outputs.values() for n, (dtype, shape) in per_tensor.items())
    source.close()
    return BuildTensors(str(folder), source.config, rec.name, rows, tp,
                        arch_assumption(source.config, decisions))


def _weight_terms(build: BuildTensors, tp: int) -> tuple[list[WeightTerm], WeightTerm | None, int]:
    """Group tensors by how ranks hold them: split over TP, or replicated (by role); MTP
    layers apart. Returns (terms, MTP term or None, number of MTP layers)."""
    buckets: dict[str, list[int]] = {}
    for role, mtp_layer, nbytes in build.placement:
        key = ("MTP" if mtp_layer is not None
               else f"replicated: {role}" if role else f"split over TP{tp}")
        b = buckets.setdefault(key, [0, 0, 0])
        b[0] += 1
        b[1] += nbytes
        b[2] += nbytes if role else -(-nbytes // tp)
    mtp = buckets.pop("MTP", None)
    terms = [WeightTerm(k, *v) for k, v in sorted(buckets.items())]
    n_mtp = len({layer for _, layer, _ in build.placement if layer is not None})
    return terms, (WeightTerm("MTP layer", *mtp) if mtp else None), n_mtp


def plan_fit(src: str | Path | BuildTensors, *, recipe: str | None = None, nodes: int = 2,
             tp: int | None = None,
             mem_util: float = 0.90, node_mem_gib: float = 121.7, kv_dtype: str = "fp8",
             max_model_len: int | None = None, draft: str = "none", answer_tokens: int = 2048,
             reserve: Reserve = Reserve(), block_size: int = 64,
             fmt: str = "compressed-tensors", engine: str = "vllm",
             allow_unknown_arch: bool = False) -> FitReport:
    """Plan a build of ``src`` on ``nodes`` GB10 nodes: a source folder or descriptor
    (planned through ``recipe`` and ``fmt``; None: the source's ``--recipe`` default), an NVFP4
    build folder (as stored), or a ``BuildTensors`` already read (then ``recipe`` and ``fmt``
    are not used).

    Args:
        nodes: GB10 nodes (121.7 GiB usable each by default: vLLM reports 121.69 GiB total on
            GB10, docs/eval.md §6.1).
        tp: tensor-parallel size, a multiple of ``nodes`` (default ``nodes``).
        mem_util: vLLM ``gpu_memory_utilization``.
        kv_dtype: bf16, fp8 or nvfp4 (records in ``quantize.archs.kvcache``).
        max_model_len: tokens of the longest request (default: ``max_position_embeddings``).
        draft: ``none``, ``mtp`` or ``external:SIZE[,kv=BYTES]`` (``parse_draft``).
        answer_tokens: tokens generated per session on top of its input.
        reserve: runtime reserve per rank.
        block_size: KV block (tokens) the pool is rounded down to.
        fmt: output format whose writer names the predicted tensors.
        engine: whose per-TP alignment rules the recipe is planned under.
        allow_unknown_arch: plan a ``model_type`` the architecture map does not know from
            tensor names alone (its assumption is the first note); else SourceError.

    Returns:
        FitReport with every term.

    Raises:
        SourceError, RecipeError: unreadable source or recipe (named).
        ValueError: bad arguments, or config keys the KV model needs are missing.
    """
    tp = tp or nodes
    if nodes < 1 or tp < 1 or tp % nodes:
        raise ValueError(f"--tp {tp} must be a positive multiple of --nodes {nodes}")
    if not 0 < mem_util <= 1:
        raise ValueError(f"--mem-util {mem_util} must be in (0, 1]")
    if block_size < 1 or answer_tokens < 0:
        raise ValueError("block size must be >= 1 and answer tokens >= 0")
    kvd = KVDtype(kv_dtype)
    dr = parse_draft(draft)
    build = src if isinstance(src, BuildTensors) else build_tensors(src, recipe, fmt, tp, engine,
                                                                     allow_unknown_arch)
    config, name = build.config, Path(build.source).name
    cfg = archs.text_config(config)
    ranks_per_node = tp // nodes
    terms, mtp, n_mtp = _weight_terms(build, tp)
    weights = sum(t.per_rank_bytes for t in terms)
    notes = [build.assumed] if build.assumed else []
    if build.tp is not None and build.tp != tp:
        notes.append(f"tensors were predicted for TP{build.tp} (per-shard alignment), planned "
                     f"here at TP{tp}")
    if dr.kind == "mtp" and mtp is None:
        raise ValueError(f"--draft mtp: {name} has no MTP layer (no tensors under "
                         f"layers.{cfg.get('num_hidden_layers')} or beyond)")
    kv = kv_model(config, kvd, tp, n_mtp if dr.kind == "mtp" else 0)
    draft_bytes = -(-dr.size_bytes // tp) if dr.kind == "external" else 0
    if dr.kind == "mtp":
        draft_bytes = mtp.per_rank_bytes
    elif mtp is not None:
        notes.append(f"MTP layer ({mtp.total_bytes / GIB:.2f} GiB in the build) is not loaded "
                     "without --draft mtp")
    if dr.kind == "external" and not dr.kv_bytes_per_token:
        notes.append("external draft KV not counted: give external:SIZE,kv=BYTES_PER_TOKEN")
    budget = int(node_mem_gib * GIB * mem_util / ranks_per_node)
    reserve_bytes = int(reserve.total_gib * GIB)
    pool = budget - weights - reserve_bytes - draft_bytes
    bpt = kv.bytes_per_token + dr.kv_bytes_per_token
    per_seq = kv.bytes_per_seq
    if bpt <= 0:
        raise ValueError(f"{name}: the config describes no per-token KV cache")
    pool_tokens = max(0, math.floor(pool / (bpt * block_size)) * block_size)
    state_tokens = per_seq / bpt
    mml = max_model_len or cfg.get("max_position_embeddings")
    if not isinstance(mml, int) or mml < 1:
        raise ValueError("give --max-model-len: the config has no max_position_embeddings")
    if mml > (cfg.get("max_position_embeddings") or mml):
        notes.append(f"max-model-len {mml:,} exceeds the config's max_position_embeddings "
                     f"{cfg['max_position_embeddings']:,}")
    sess = {k: (round(sessions(pool_tokens, n, answer_tokens, state_tokens), 3)
                if n + answer_tokens <= mml else None) for k, n in SESSION_INPUTS.items()}
    margin = int(pool - (mml * bpt + per_seq))
    if kvd is KVDtype.NVFP4:
        notes.append("nvfp4 KV: the MLA record is derived (no engine publishes one), and vLLM's "
                     "NVFP4 KV for SM12x (GB10) was not merged in the snapshots examined "
                     "(docs/eval.md §4.4)")
    need = node_mem_gib * mem_util
    notes.append(f"vLLM refuses to start if free memory at launch is below node memory × "
                 f"mem-util = {need:.1f} GiB; GB10 shows 101-115 GiB free at boot (drop page "
                 "caches first, docs/eval.md §6.1)")
    return FitReport(
        source=build.source, model=str(config.get("model_type") or cfg.get("model_type", "?")),
        recipe=build.recipe, nodes=nodes, tp=tp, ranks_per_node=ranks_per_node,
        mem_util=mem_util, node_mem_gib=node_mem_gib, kv_dtype=kvd.value, draft=dr.label,
        max_model_len=mml, answer_tokens=answer_tokens, block_size=block_size,
        budget_bytes=budget, weights=terms, weights_bytes=weights,
        reserve=reserve, reserve_bytes=reserve_bytes, draft_bytes=draft_bytes,
        kv_pool_bytes=pool, kv=kv, bytes_per_token=bpt, bytes_per_seq=per_seq,
        kv_pool_tokens=pool_tokens, state_tokens=state_tokens, sessions=sess,
        fits=margin >= 0, margin_bytes=margin, build_bytes=build.nbytes,
        notes=notes)


def write_plan(report: FitReport, build: str | Path) -> Path:
    """Add ``report`` as a row of ``build``'s ``plan.json`` (created when absent); a row with the
    same nodes, TP, KV dtype, draft and max-model-len is replaced. Returns the file's path.

    Raises:
        OutputError: ``build`` is not a finished build folder (no manifest).
    """
    from formats.checkpoint import write_json_atomic
    from quantize.base.errors import OutputError

    build = Path(build)
    if not (build / MANIFEST_NAME).is_file():
        raise OutputError(f"--out {build}: not a finished build (no {MANIFEST_NAME}); the fit "
                          "table is written into the build folder its card is made from",
                          key=str(build))
    path = build / PLAN_NAME
    rows = json.loads(path.read_text()).get("fit", []) if path.is_file() else []
    row = report.fit_row()
    key = ("nodes", "TP", "KV dtype", "draft", "max-model-len")
    rows = [r for r in rows if not isinstance(r, dict) or any(r.get(k) != row[k] for k in key)]
    write_json_atomic({"fit": [*rows, row]}, path)
    return path
