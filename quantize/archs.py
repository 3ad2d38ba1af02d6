"""Per-architecture knowledge: the only module that holds architecture module names.

Facts live here as data rows:

- Fused groups: Linears that engines run as one GEMM and therefore load with one global
  scale (and must share one precision). vLLM: ``qkv_proj = [q, k, v]``,
  ``gate_up_proj = [gate, up]`` (dense, shared experts, each routed expert),
  ``fused_qkv_a_proj = [q_a_proj, kv_a_proj_with_mqa]`` (DeepSeek / GLM MLA,
  vllm/model_executor/models/deepseek_v2.py ``packed_modules_mapping``), Kimi-Linear / GLM-5.3
  KDA ``in_proj_qkvgfab = [q, k, v, b, f_a]`` and GLM-5.3 ``wk_weights_proj = [wk,
  weights_proj]`` (formats_spec.md A.3.4, B.3.3).
- Sensitive modules kept in high precision whatever the recipe: embeddings, lm_head and the
  MTP ``shared_head.head``, MoE routers (identified structurally, FC-16), the MTP ``eh_proj``
  (vLLM builds it as a plain nn.Linear, formats_spec.md A.3.1), vision towers.
- For the fit planner: which decoder layers cache what (``attention_layers``: MLA, GQA or KDA,
  with or without a DSA indexer, from config keys) and which weights every TP rank holds whole
  (``tp_replicated_role``, vLLM's replicated layers).
"""

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["FusedGroupRule", "FUSED_GROUP_RULES", "fused_group_of", "sensitive_role",
           "num_routed_experts", "mtp_layer_indices", "AttnKind", "AttnLayer", "attention_layers",
           "decoder_layer_of", "tp_replicated_role"]


@dataclass(frozen=True)
class FusedGroupRule:
    """``pattern`` matches a module name; group ``g`` is the shared prefix, ``m`` the member."""

    name: str
    pattern: re.Pattern
    members: tuple[str, ...]


def _rule(name: str, members: tuple[str, ...], scope: str) -> FusedGroupRule:
    alt = "|".join(re.escape(m) for m in members)
    return FusedGroupRule(name, re.compile(rf"^(?P<g>{scope})\.(?P<m>{alt})$"), members)


FUSED_GROUP_RULES: tuple[FusedGroupRule, ...] = (
    _rule("qkv_proj", ("q_proj", "k_proj", "v_proj"), r".*\.(?:self_attn|attention|attn)"),
    _rule("in_proj_qkvgfab", ("q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_a_proj",
                              "f_a_proj"), r".*\.(?:linear_attn|self_attn)"),
    _rule("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"), r".*\.self_attn"),
    _rule("wk_weights_proj", ("wk", "weights_proj"), r".*\.indexer"),
    _rule("gate_up_proj", ("gate_proj", "up_proj"),
          r".*\.(?:mlp|shared_experts?|experts\.\d+)"),
    _rule("w13", ("w1", "w3"), r".*\.experts\.\d+"),
)

_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|tok_embeddings|word_embeddings)$")
_LM_HEAD = re.compile(r"(^|\.)(lm_head|shared_head\.head|output)$")
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe|moe)\.(gate|router)$")
_EH_PROJ = re.compile(r"\.eh_proj$")
_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|mm_projector|multi_modal_projector)(\.|$)")


def num_routed_experts(config: dict) -> int | None:
    """Routed-expert count from the text config (``n_routed_experts``, ``num_experts`` or
    ``num_local_experts``), or None for dense models."""
    cfg = config.get("text_config") or config
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def mtp_layer_indices(config: dict) -> list[int]:
    """Decoder-layer indices of MTP / NextN layers: ``num_hidden_layers + k`` for
    ``k < num_nextn_predict_layers`` (DeepSeek-V3 README_WEIGHTS.md; never a constant)."""
    cfg = config.get("text_config") or config
    n = cfg.get("num_hidden_layers")
    k = cfg.get("num_nextn_predict_layers") or 0
    return list(range(n, n + k)) if isinstance(n, int) else []


def fused_group_of(module: str, present: set[str]) -> tuple[str, tuple[str, ...]] | None:
    """The fused group ``module`` belongs to, as ``(group id, member module names present)``.

    When several rules match (GQA q/k/v vs KDA q/k/v/b/f_a) the one with the most members
    present wins; a group with a single member present is no group (returns None).
    """
    best = None
    for rule in FUSED_GROUP_RULES:
        m = rule.pattern.match(module)
        if m:
            members = tuple(f"{m['g']}.{x}" for x in rule.members if f"{m['g']}.{x}" in present)
            if len(members) > 1 and (best is None or len(members) > len(best[1])):
                best = (f"{m['g']}.{rule.name}", members)
    return best


def sensitive_role(module: str, shape: tuple[int, ...], config: dict,
                   siblings: set[str] = frozenset()) -> str | None:
    """Why a 2-D Linear-like weight must stay high precision, or None.

    Routers are found structurally (FC-16): a ``.gate`` / ``.router`` module under an MoE
    block whose output dim equals the routed-expert count, or that has an
    ``e_score_correction_bias``; the substring "gate" alone never decides (``gate_proj`` is
    an ordinary Linear).

    Returns:
        one of ``embedding``, ``lm_head``, ``router``, ``mtp_eh_proj``, ``vision``, or None.
    """
    if _EMBEDDING.search(module):
        return "embedding"
    if _LM_HEAD.search(module):
        return "lm_head"
    if _VISION.search(module):
        return "vision"
    if _EH_PROJ.search(module):
        return "mtp_eh_proj"
    if _ROUTER.search(module):
        n_exp = num_routed_experts(config)
        if (n_exp is not None and shape[0] == n_exp) or f"{module}.e_score_correction_bias" in siblings:
            return "router"
    return None


# ---- Attention layout and TP sharding (the fit planner, ``quantize.fit``) -------------------

class AttnKind(str, Enum):
    """How a decoder layer keeps its past: a per-token record (MLA latent, GQA K/V) or a fixed
    per-sequence state (KDA)."""

    MLA = "mla"
    GQA = "gqa"
    KDA = "kda"


@dataclass(frozen=True)
class AttnLayer:
    """One decoder layer's cache: its kind, whether it runs its own DSA indexer (and so caches
    indexer keys), and whether it is an MTP / NextN layer."""

    index: int
    kind: AttnKind
    indexer: bool = False
    mtp: bool = False


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_LINEAR_ATTN_TYPES = {"linear_attention"}


def decoder_layer_of(name: str) -> int | None:
    """Decoder-layer index of a tensor name (``model.layers.45.mlp...`` -> 45), else None.
    Vision-tower blocks are not decoder layers (None)."""
    if _VISION.search(name):
        return None
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _kda_flags(cfg: dict) -> list[bool]:
    n = cfg["num_hidden_layers"]
    if isinstance(cfg.get("layer_types"), list):
        return [t in _LINEAR_ATTN_TYPES for t in cfg["layer_types"]]
    lac = cfg.get("linear_attn_config")
    if isinstance(lac, dict) and isinstance(lac.get("kda_layers"), list):
        kda = set(lac["kda_layers"])  # 1-indexed [HF kimi_linear configuration]
        return [i + 1 in kda for i in range(n)]
    if cfg.get("model_type") in ("glm5_next", "glm5_next_text"):
        # transformers Glm5NextTextConfig.__post_init__: every fourth layer is MLA + DSA.
        return [i % 4 != 3 for i in range(n)]
    return [False] * n


def attention_layers(config: dict, mtp_layers: int = 0) -> list[AttnLayer]:
    """The cache-holding layers of a text config, decoder layers first, then ``mtp_layers``
    MTP / NextN layers (indices ``num_hidden_layers + k``).

    Rules (config keys only, never shapes):

    - KDA layers: ``layer_types == "linear_attention"`` (glm5_next, qwen3_next convention),
      or ``linear_attn_config.kda_layers`` (kimi_linear, 1-indexed), or for ``glm5_next``
      without ``layer_types`` the transformers default (layer i is KDA unless i % 4 == 3).
    - Every other layer is MLA when the config has ``kv_lora_rank``, else GQA.
    - A full-attention layer runs its own DSA indexer when the config has ``index_head_dim``
      and ``indexer_types[i]`` is ``"full"`` (a ``"shared"`` layer reuses the previous
      layer's top-k and has no indexer, HF ``modeling_glm5_next.py`` ``skip_topk``).
    - An MTP layer is a full-attention decoder layer (a full DSA decoder layer in GLM-5.3-Flash,
      with its own indexer when the model has one).

    Raises:
        ValueError: ``num_hidden_layers`` missing, or ``layer_types`` of the wrong length.
    """
    cfg = config.get("text_config") or config
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int):
        raise ValueError("config has no integer num_hidden_layers")
    kda = _kda_flags(cfg)
    if len(kda) != n:
        raise ValueError(f"config layer_types has {len(kda)} entries, num_hidden_layers is {n}")
    full = AttnKind.MLA if cfg.get("kv_lora_rank") else AttnKind.GQA
    has_indexer = bool(cfg.get("index_head_dim"))
    itypes = cfg.get("indexer_types") if isinstance(cfg.get("indexer_types"), list) else None
    out = []
    for i in range(n + mtp_layers):
        mtp = i >= n
        if not mtp and kda[i]:
            out.append(AttnLayer(i, AttnKind.KDA))
            continue
        runs_indexer = has_indexer and (mtp or itypes is None or itypes[i] == "full")
        out.append(AttnLayer(i, full, runs_indexer, mtp))
    return out


# Weights every TP rank holds whole (vLLM): routers (GateLinear / ReplicatedLinear), the MLA
# ``fused_qkv_a_proj`` (DeepSeekV2FusedQkvAProjLinear, disable_tp), the whole DSA indexer
# (``wq_b`` ReplicatedLinear, ``wk_weights_proj`` disable_tp, kpool parameters;
# vllm/models/glm5next/nvidia/attention.py), the KDA ``f_a`` / ``g_a`` shards of
# ``in_proj_qkvbfg_a`` (replicated_shard_ids (4, 5), vllm/models/glm5next/common/kda.py), mHC
# mixing parameters, the MTP ``eh_proj`` (nn.Linear), and vision towers (conservative: vLLM
# can run the encoder data-parallel, ``mm_encoder_tp_mode="data"``). Everything else 2-D or
# more (experts, shared experts, dense MLP, q_b/kv_b/o_proj, KDA q/k/v/b/f_b/g_b/o/conv,
# embeddings as VocabParallelEmbedding, lm_head as ParallelLMHead) is split across TP ranks.
_TP_REPLICATED = (
    ("mla_a_proj", re.compile(r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.")),
    ("indexer", re.compile(r"\.indexer\.")),
    ("kda_a_proj", re.compile(r"\.(f_a_proj|g_a_proj)\.")),
    ("mhc", re.compile(r"(^|\.)(attn_hc|ffn_hc|hc_head)\.|\.hc_(attn|ffn|head)_")),
    ("mtp_eh_proj", re.compile(r"\.eh_proj\.")),
)


def tp_replicated_role(name: str, shape: tuple[int, ...], config: dict,
                       siblings: set[str] = frozenset()) -> str | None:
    """Why tensor ``name`` is held whole by every TP rank, or None when it is split across
    ranks. 0-D / 1-D tensors (norms, biases, scalars, ``e_score_correction_bias``) are
    replicated; routers are found structurally (``sensitive_role``)."""
    if len(shape) < 2:
        return "vector"
    for role, pat in _TP_REPLICATED:
        if pat.search(name):
            return role
    module = name.rsplit(".", 1)[0]
    role = sensitive_role(module, shape, config, siblings)
    if role in ("router", "vision"):
        return role
    return None
