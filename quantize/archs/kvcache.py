"""KV-cache bytes per token and per sequence, derived from the config. Pure arithmetic.

Record formats (bytes per token per layer, held by every TP rank unless noted):

MLA latent, ``L = kv_lora_rank``, ``R = qk_rope_head_dim``. The latent is shared by all heads,
so every TP rank stores the whole record (vLLM ``MLAAttentionSpec`` with one KV head).

| KV dtype | fields                                                     | bytes            |
|----------|------------------------------------------------------------|------------------|
| bf16     | L bf16 NoPE latent, R bf16 RoPE                            | 2L + 2R          |
| fp8      | L e4m3 latent, one f32 scale per 128-value tile, R bf16    | L + 4·⌈L/128⌉ + 2R |
| nvfp4    | L/2 packed e2m1, one e4m3 block scale per 16, R bf16       | L/2 + L/16 + 2R  |

The fp8 row is FlashMLA's ``fp8_ds_mla`` record (deepseek-ai/FlashMLA README, vLLM
``kv_cache_dtype="fp8_ds_mla"``; docs/eval.md §4.3). The nvfp4 row is NVFP4 numerics
(e2m1 codes, e4m3 scale per 16, one f32 global scale per layer, not per token) applied to the
latent with RoPE kept bf16 — derived, not a published engine layout (docs/eval.md §4.5).
DeepSeek-V3 geometry (L 512, R 64): 1152 / 656 / 416. GLM-5.3-Flash (``glm5_next``:
L 512, R 0, NoPE MLA): 1024 / 528 / 288.

DSA indexer key (layers that run their own indexer): ``index_head_dim`` e4m3 values plus one
f32 scale per 128, stored once per ``index_kpool`` tokens (GLM-5.3-Flash kpool-compressed
entries: vLLM ``Glm5NextIndexerCache``, ``tokens_per_state = index_kpool``; DeepSeek-V3.2 /
GLM-5 store one per token, ``DeepseekV32IndexerCache``). Always fp8, whatever the KV dtype:
132 B per 16 tokens = 8.25 B/token for GLM-5.3-Flash. Its in-progress pool (raw bf16 key +
bf16 gate score for ``index_kpool`` tokens, vLLM ``Glm5NextTailCache``) is a fixed
per-sequence state: 2 · 2 · kpool · index_head_dim B per indexer layer.

GQA / MHA: ``2 · H_kv · D · b`` with b = 2 (bf16) or 1 (fp8), and ``2 · H_kv · (D/2 + D/16)``
for nvfp4 (docs/eval.md §6.2, §4.5). KV heads are split across TP ranks (never below one).
Sliding-window layers are counted as full attention (an upper bound).

KDA: no per-token record. Each sequence holds, per layer and rank, three bf16 short-conv
windows ``3 · (H/tp · D) · (kernel − 1)`` and an f32 recurrent state ``(H/tp) · D · D``
(vLLM ``MambaStateShapeCalculator.kda_state_shape``, ``MambaStateDtypeCalculator.kda_state_dtype``):
4.14 MiB per layer per sequence for GLM-5.3-Flash at TP1.

Does the issue's lead hold? "kv_lora_rank 512 and an indexer key of 128 would make the bf16
record 1,024 + 128 = 1,152 bytes and an fp8 one 512 + 16 + 128 = 656": the sums are right
only if a 128-byte indexer key is stored for every token. It is not: the config has no RoPE
dims and the indexer key is one fp8 entry per 16-token pool, so the GLM-5.3-Flash record is
1024 + 8.25 (bf16), 528 + 8.25 (fp8), 288 + 8.25 (nvfp4). 1,152 and 656 are the DeepSeek
(512 + 64 RoPE) records, and 368 is SGLang's DeepSeek-V4 MXFP4 record (448 e2m1 + 14 ue8m0 +
2 pad + 64 bf16 RoPE); neither follows from the GLM-5.3-Flash config.
"""

from dataclasses import dataclass
from enum import Enum

from quantize.archs import AttnKind, AttnLayer, attention_layers, text_config
from quantize.kernels.dtypes import NVFP4_GROUP_SIZE

__all__ = ["KVDtype", "Record", "mla_record", "gqa_record", "indexer_record", "kda_state",
           "indexer_tail_state", "KVTerm", "KVModel", "kv_model"]

FP8_TILE = 128
"""Values per f32 scale in FlashMLA's fp8 latent and in the DSA indexer key cache."""


class KVDtype(str, Enum):
    """KV-cache element format; values are the CLI names."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


@dataclass(frozen=True)
class Record:
    """A byte layout: ``fields`` are (label, bytes) in storage order."""

    fields: tuple[tuple[str, float], ...]

    @property
    def nbytes(self) -> float:
        return sum(b for _, b in self.fields)

    def describe(self) -> str:
        return " + ".join(f"{label} ({b:g} B)" for label, b in self.fields if b)


def _nvfp4(n: int) -> tuple[tuple[str, float], ...]:
    if n % NVFP4_GROUP_SIZE:
        raise ValueError(f"an NVFP4 record needs a multiple of {NVFP4_GROUP_SIZE} values, got {n}")
    return ((f"{n} e2m1", n / 2), (f"{n // NVFP4_GROUP_SIZE} e4m3 scales", n / NVFP4_GROUP_SIZE))


def mla_record(kv_lora_rank: int, rope_dim: int, dtype: KVDtype) -> Record:
    """Bytes per token per MLA layer (the latent record in the table above).

    Raises:
        ValueError: nvfp4 with ``kv_lora_rank`` not a multiple of 16.
    """
    L, R = kv_lora_rank, rope_dim
    rope = ((f"{R} bf16 RoPE", 2 * R),)
    if dtype is KVDtype.BF16:
        return Record(((f"{L} bf16", 2 * L),) + rope)
    if dtype is KVDtype.FP8:
        tiles = -(-L // FP8_TILE)
        return Record(((f"{L} e4m3", L), (f"{tiles} f32 scales", 4 * tiles)) + rope)
    return Record(_nvfp4(L) + rope)


def gqa_record(kv_heads: int, head_dim: int, dtype: KVDtype) -> Record:
    """Bytes per token per GQA/MHA layer for ``kv_heads`` heads (K and V)."""
    if dtype is KVDtype.NVFP4:
        f = _nvfp4(head_dim)
        return Record(tuple((f"2x{kv_heads}x{label}", 2 * kv_heads * b) for label, b in f))
    b = 2 if dtype is KVDtype.BF16 else 1
    return Record(((f"2x{kv_heads}x{head_dim} {dtype.value}", 2 * kv_heads * head_dim * b),))


def indexer_record(index_head_dim: int, kpool: int = 1) -> Record:
    """Bytes per token per DSA indexer layer: an fp8 key with f32 tile scales, one per
    ``kpool`` tokens."""
    tiles = -(-index_head_dim // FP8_TILE)
    per = f" per {kpool} tokens" if kpool > 1 else ""
    return Record(((f"{index_head_dim} e4m3{per}", index_head_dim / kpool),
                   (f"{tiles} f32 scale{per}", 4 * tiles / kpool)))


def indexer_tail_state(index_head_dim: int, kpool: int) -> int:
    """Bytes per sequence per kpool indexer layer: raw bf16 key and gate score of the
    in-progress pool (0 without kpool compression)."""
    return 2 * 2 * kpool * index_head_dim if kpool > 1 else 0


def kda_state(num_heads: int, head_dim: int, conv_kernel: int, tp: int) -> int:
    """Bytes per sequence per KDA layer on one of ``tp`` ranks: bf16 q/k/v conv windows and
    the f32 recurrent state.

    Raises:
        ValueError: ``num_heads`` not divisible by ``tp`` (vLLM asserts the same).
    """
    if num_heads % tp:
        raise ValueError(f"KDA heads {num_heads} do not split across TP {tp}")
    h = num_heads // tp
    return 3 * h * head_dim * (conv_kernel - 1) * 2 + h * head_dim * head_dim * 4


@dataclass(frozen=True)
class KVTerm:
    """One row of the KV table: ``layers`` layers of one kind, each costing ``per_token``
    bytes per token and ``per_seq`` bytes per sequence on every rank."""

    what: str
    layers: int
    per_token: float
    per_seq: int
    layout: str


@dataclass(frozen=True)
class KVModel:
    """Per-rank KV cost of a model (or of a draft's extra layers)."""

    dtype: KVDtype
    tp: int
    terms: tuple[KVTerm, ...]

    @property
    def bytes_per_token(self) -> float:
        return sum(t.layers * t.per_token for t in self.terms)

    @property
    def bytes_per_seq(self) -> int:
        return sum(t.layers * t.per_seq for t in self.terms)


def _terms(cfg: dict, layers: list[AttnLayer], dtype: KVDtype, tp: int, tag: str) -> list[KVTerm]:
    n_mla = sum(x.kind is AttnKind.MLA for x in layers)
    n_gqa = sum(x.kind is AttnKind.GQA for x in layers)
    n_kda = sum(x.kind is AttnKind.KDA for x in layers)
    n_idx = sum(x.indexer for x in layers)
    out = []
    if n_mla:
        rec = mla_record(cfg["kv_lora_rank"], cfg.get("qk_rope_head_dim") or 0, dtype)
        out.append(KVTerm(f"{tag}MLA latent ({dtype.value})", n_mla, rec.nbytes, 0, rec.describe()))
    if n_idx:
        d, kpool = cfg["index_head_dim"], cfg.get("index_kpool") or 1
        rec = indexer_record(d, kpool)
        tail = indexer_tail_state(d, kpool)
        out.append(KVTerm(f"{tag}DSA indexer key (fp8)", n_idx, rec.nbytes, tail,
                          rec.describe() + (f"; in-progress pool {tail:,} B/seq" if tail else "")))
    if n_gqa:
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        local = max(1, heads // tp)
        rec = gqa_record(local, head_dim, dtype)
        out.append(KVTerm(f"{tag}GQA K/V ({dtype.value}, {local} heads/rank)", n_gqa,
                          rec.nbytes, 0, rec.describe()))
    if n_kda:
        st = kda_state(cfg["linear_num_heads"], cfg["linear_head_dim"],
                       cfg["linear_conv_kernel_dim"], tp)
        out.append(KVTerm(f"{tag}KDA state (bf16 conv + f32 recurrent)", n_kda, 0, st,
                          f"{st:,} B/seq"))
    return out


def kv_model(config: dict, dtype: KVDtype, tp: int, mtp_layers: int = 0) -> KVModel:
    """Per-rank KV bytes per token and per sequence of the decoder layers of ``config``
    (plus ``mtp_layers`` MTP layers, listed as separate terms), at TP ``tp``.

    Layer kinds come from ``archs.attention_layers``; record sizes from the table in this
    module's docstring.

    Raises:
        ValueError: missing config keys (named), or shapes that do not fit the dtype / TP.
    """
    cfg = text_config(config)
    layers = attention_layers(config, mtp_layers)
    try:
        terms = _terms(cfg, [x for x in layers if not x.mtp], dtype, tp, "")
        terms += _terms(cfg, [x for x in layers if x.mtp], dtype, tp, "MTP ")
    except KeyError as e:
        raise ValueError(f"config lacks {e.args[0]!r}, needed for the KV-cache size") from None
    return KVModel(dtype, tp, tuple(terms))
