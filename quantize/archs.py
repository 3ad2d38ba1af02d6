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
           "num_routed_experts", "mtp_layer_indices", "kv_record_dims"]


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


def kv_record_dims(config: dict) -> dict:
    """What one token's KV-cache record holds in one attention layer, from the text config.

    MLA (DeepSeek-V2/V3, GLM-5: ``kv_lora_rank`` set): engines cache the normalized latent
    (``kv_lora_rank`` values) and the RoPE key (``qk_rope_head_dim``), not the expanded heads
    (vLLM ``MLACommonImpl``; FlashMLA's 656-byte record for 512 + 64). Otherwise K and V of
    each KV head: ``num_key_value_heads`` (default ``num_attention_heads``) x ``head_dim``
    (default ``hidden_size / num_attention_heads``).

    Returns:
        ``{"kind": "mla", "latent": int, "rope": int, "layers": int}`` or
        ``{"kind": "mha", "kv_heads": int, "head_dim": int, "layers": int}``; ``layers`` counts
        softmax-attention layers (``layer_types`` entries naming full or sliding attention when
        present, else ``num_hidden_layers``).
    """
    cfg = config.get("text_config") or config
    types = cfg.get("layer_types")
    layers = (sum(1 for t in types if "attention" in t and "linear" not in t) if types
              else int(cfg["num_hidden_layers"]))
    if cfg.get("kv_lora_rank"):
        return {"kind": "mla", "latent": int(cfg["kv_lora_rank"]),
                "rope": int(cfg["qk_rope_head_dim"]), "layers": layers}
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    return {"kind": "mha", "kv_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(head_dim), "layers": layers}
