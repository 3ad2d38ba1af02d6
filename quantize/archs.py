"""Per-architecture knowledge: the only module that holds architecture module names.

Two kinds of facts live here, as data rows:

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
"""

import re
from dataclasses import dataclass

__all__ = ["FusedGroupRule", "FUSED_GROUP_RULES", "fused_group_of", "sensitive_role",
           "num_routed_experts", "mtp_layer_indices", "FUSED_EXPERT_PARAMS", "EXPERT_PROJECTIONS",
           "LAYER_OUTPUT_CARRY", "ATTENTION_CHILDREN", "expert_of", "is_mla_attention"]


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


# ---- calibration (layer-streamed forward through the transformers classes) ---------------

FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""transformers >= 5 keeps routed experts in memory as two 3-D parameters [E, 2I, H] (gate
rows then up rows) and [E, H, I] (``DeepseekV3Experts``, ``GlmMoeDsaExperts``,
``Glm5NextTextExperts``, ``Qwen3MoeExperts``); on disk they are per expert."""

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""On-disk per-expert Linears: ``<block>.experts.<E>.{gate_proj,up_proj,down_proj}``
(formats_spec.md A.3.1, A.3.3)."""

LAYER_OUTPUT_CARRY: dict[str, tuple[str, ...]] = {
    # Glm5NextTextDecoderLayer returns (hidden_states, topk_indices); the model passes the
    # indices to the next layer as prev_topk_indices (DSA cross-layer top-k sharing).
    "glm5_next_text": ("prev_topk_indices",),
    "glm5_next": ("prev_topk_indices",),
}
"""Decoder layers that return ``(hidden_states, *extras)``: the keyword arguments of the next
layer that the extras feed, in order. Layers of other model types return the hidden state."""

ATTENTION_CHILDREN = ("self_attn", "attention", "attn")
"""Attribute names of a decoder layer's attention block; compressed-tensors stores FP8 KV
scales on it as ``<layer>.self_attn.k_scale`` (formats_spec.md B.4)."""

_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")


def expert_of(module: str) -> tuple[str, int, str] | None:
    """``model.layers.3.mlp.experts.7.up_proj`` -> ``("model.layers.3.mlp.experts", 7,
    "up_proj")``; None for a module that is not a routed expert's Linear."""
    m = _EXPERT.match(module)
    return (m["block"], int(m["e"]), m["proj"]) if m else None


def is_mla_attention(attention: str, modules: set[str]) -> bool:
    """True for DeepSeek / GLM multi-head latent attention: the KV cache holds the
    compressed latent (``kv_a_layernorm`` output + the rope part of ``kv_a_proj_with_mqa``),
    one record per token, quantized with the layer's ``k_scale`` (vLLM MLAAttention)."""
    return f"{attention}.kv_a_proj_with_mqa" in modules
