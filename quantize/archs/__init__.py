"""Per-architecture knowledge: the only module that holds architecture module names.

Facts live here as data rows, each with its source:

- Fused groups: Linears that engines run as one GEMM and therefore load with one global
  scale (and must share one precision). vLLM ``packed_modules_mapping``:
  ``qkv_proj = [q, k, v]``, ``gate_up_proj = [gate, up]`` (dense, shared experts, each routed
  expert), ``fused_qkv_a_proj = [q_a_proj, kv_a_proj_with_mqa]`` (DeepSeek / GLM MLA,
  vllm/model_executor/models/deepseek_v2.py), GLM-5.3-Flash KDA
  ``in_proj_qkvbfg_a = [q, k, v, b, f_a, g_a]`` and indexer ``wk_weights_proj = [wk,
  weights_proj]`` (vLLM glm5next ``load_weights`` stacked_params_mapping / vllm#56327
  ``Glm5NextForConditionalGeneration.packed_modules_mapping``; docs/formats.md §A.3.4, §B.3.3).
- Roles: what a Linear is (routed expert, shared expert, dense MLP, MLA, KDA, indexer,
  attention, vision), found from the module name *and the sibling modules present*, never
  from a substring alone. Recipes may match ``role:<name>``.
- Sensitive modules kept in high precision whatever the recipe: embeddings, lm_head and the
  MTP ``shared_head.head``, MoE routers (identified structurally, FC-16), the MTP ``eh_proj``
  (vLLM builds it as a plain nn.Linear, docs/formats.md §A.3.1), vision towers, and per
  model_type the DSA indexer ``weights_proj`` (bf16 in the GLM-5 FP8 release; llm-compressor
  glm5_example.py: "sensitive to quantization").
- Release layouts: how the FP8 releases store each tensor on disk (for the fixture builder).
- For the fit planner: which decoder layers cache what (``attention_layers``: MLA, GQA or KDA,
  with or without a DSA indexer, from config keys) and which weights every TP rank holds whole
  (``tp_replicated_role``, vLLM's replicated layers).
"""

import re
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["FusedGroupRule", "FUSED_GROUP_RULES", "ROLES", "fused_group_of", "module_roles",
           "sensitive_role", "DSA_MODEL_TYPES", "num_routed_experts", "mtp_layer_indices", "text_config",
           "tp_split", "ReleaseLayout", "RELEASE_LAYOUTS", "release_storage", "MTP_EXTRA_TENSORS",
           "AttnKind", "AttnLayer", "attention_layers", "decoder_layer_of", "tp_replicated_role",
           "FUSED_EXPERT_PARAMS", "EXPERT_PROJECTIONS", "LAYER_OUTPUT_CARRY", "ATTENTION_CHILDREN",
           "expert_of", "is_mla_attention", "moe_layer_indices", "check_layout",
           "MTP_REQUIRED_PARTS", "kv_record_dims", "KV_DTYPES", "KVScaleName", "kv_scale_of",
           "portable_layer_types", "KNOWN_MODEL_TYPES", "unknown_model_type", "unknown_arch_message",
           "missing_model_type", "unknown_arch",
           "NAME_ONLY_RULES", "CONFIG_INT_KEYS", "config_type_errors"]

KV_DTYPES = ("bf16", "fp8", "nvfp4")
"""KV-cache storage dtypes whose per-token records the map knows (``quantize.archs.kvcache``):
bf16, fp8 e4m3 with a per-tensor scale, NVFP4 (e2m1 + e4m3 per 16 + fp32 global)."""


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
    # KDA: the six input projections are one vLLM GEMM (f_a / g_a replicated across TP ranks).
    _rule("in_proj_qkvbfg_a", ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj",
                               "forget_gate.f_a_proj"), r".*\.(?:linear_attn|self_attn)"),
    _rule("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"), r".*\.self_attn"),
    _rule("wk_weights_proj", ("wk", "weights_proj"), r".*\.indexer"),
    _rule("gate_up_proj", ("gate_proj", "up_proj"),
          r".*\.(?:mlp|shared_experts?|experts\.\d+)"),
    _rule("w13", ("w1", "w3"), r".*\.experts\.\d+"),
)

_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embed_in|wte|wpe|tok_embeddings|word_embeddings|"
                        r"embed_positions|position_embeddings)$")
_LM_HEAD = re.compile(r"(^|\.)(lm_head|embed_out|shared_head\.head|output)$")
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe|moe|feed_forward)\.(gate|router)$")
# Qwen2-MoE / Qwen3-Next shared-expert gate: [1, hidden], a scalar gate per token.
_SHARED_EXPERT_GATE = re.compile(r"\.shared_expert_gate$")
_EH_PROJ = re.compile(r"\.eh_proj$")
_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|mm_projector|multi_modal_projector)(\.|$)")

# Per model_type: (pattern, role) of Linears that stay high precision in every recipe.
DSA_MODEL_TYPES = ("glm5_next", "glm5_next_text", "glm_moe_dsa", "deepseek_v32")
"""model_types whose DSA indexer the map knows (its ``weights_proj`` stays high precision)."""
_SENSITIVE_BY_MODEL_TYPE: dict[str, tuple[tuple[re.Pattern, str], ...]] = {
    mt: ((re.compile(r"\.indexer\.weights_proj$"), "indexer_weights_proj"),)
    for mt in DSA_MODEL_TYPES
}
# vLLM 0.26 deepseek_v2.py builds the indexer's fused wk_weights_proj with quant_config=None and
# loads wk as BF16 (or dequantizes a 128x128 block-FP8 wk); an NVFP4 wk does not load.
for _mt in ("glm_moe_dsa", "deepseek_v32"):
    _SENSITIVE_BY_MODEL_TYPE[_mt] += ((re.compile(r"\.indexer\.wk$"), "indexer_wk"),)

KNOWN_MODEL_TYPES = (
    # dense GQA decoders: q/k/v/o_proj + mlp.gate/up/down_proj (transformers modeling_llama,
    # modeling_mistral, modeling_qwen2, modeling_qwen3, modeling_gemma3; the demo is llama)
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text",
    # MoE with per-expert Linears and a router named mlp.gate / block_sparse_moe.gate
    # (modeling_mixtral, modeling_qwen2_moe, modeling_qwen3_moe, modeling_qwen3_next)
    "mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next",
    # MLA (+ DSA indexer, MTP) families: RELEASE_LAYOUTS, DSA_MODEL_TYPES, kimi_linear KDA
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm5_next", "glm5_next_text",
    "kimi_linear",
)
"""model_types whose tensor names the rows of this map were written for (roles, fused groups,
routers, MTP placement, per-model_type high-precision modules). Any other ``model_type`` is
refused by the plan unless the user accepts planning from tensor names alone
(``--allow-unknown-arch``; :func:`unknown_model_type`)."""

NAME_ONLY_RULES = ("embedding, lm_head, router, MTP eh_proj and vision Linears stay high "
                   "precision (found by name); every other 2-D Linear weight follows the recipe; "
                   "no model-specific rule applies (DSA indexer, engine model rules)")
"""What a plan of an unknown ``model_type`` assumes (the line printed with ``--allow-unknown-arch``)."""


MODEL_CONFIG_KEYS = ("architectures", "hidden_size", "num_hidden_layers")
"""Keys every transformers model config has: a config.json with one of them (top level or in
``text_config``) describes a model, and must say which (:func:`missing_model_type`)."""


def unknown_model_type(config: dict) -> str | None:
    """The ``model_type`` of ``config`` (top level, then ``text_config``) that is present and
    not in :data:`KNOWN_MODEL_TYPES`, as its ``repr``; None when every present one is known.
    A config with no ``model_type`` returns None here (:func:`missing_model_type` says whether
    that is refused)."""
    for cfg in (config, text_config(config)):
        if "model_type" in cfg and cfg["model_type"] not in KNOWN_MODEL_TYPES:
            return repr(cfg["model_type"])
    return None


def missing_model_type(config: dict) -> bool:
    """True when ``config`` describes a model (one of :data:`MODEL_CONFIG_KEYS`, top level or in
    ``text_config``) and has no ``model_type`` at either level: as unknown as a ``model_type``
    the map does not know. A config with none of those keys either (the synthetic checkpoints
    of the tests, a bare list of tensors) claims no architecture and is planned by tensor names."""
    levels = (config, text_config(config))
    return (not any("model_type" in c for c in levels)
            and any(k in c for c in levels for k in MODEL_CONFIG_KEYS))


def unknown_arch(config: dict) -> str | None:
    """What the architecture map does not know about ``config``, as the start of a sentence
    (``model_type 'x' is not in the architecture map``, ``config.json has no model_type``), or
    None when it knows the model (or nothing claims one)."""
    if (mt := unknown_model_type(config)) is not None:
        return f"model_type {mt} is not in the architecture map"
    if missing_model_type(config):
        return "config.json has no model_type"
    return None


def unknown_arch_message(model_type: str | None) -> str:
    """The refusal of an unknown ``model_type`` (``model_type``: its ``repr``, from
    :func:`unknown_model_type`; None: the key is missing, :func:`missing_model_type`): names it
    (or the missing key) and the known ones, and the flag that accepts it."""
    what = (f"config.json model_type {model_type} is not in the architecture map" if model_type is not None
            else "config.json has no model_type key (at the top level or in text_config), so the "
                 "architecture map cannot tell the model")
    return (f"{what} (known: {', '.join(KNOWN_MODEL_TYPES)}): which Linears stay high precision would "
            "be guessed from tensor names; set model_type to the architecture the checkpoint is, or "
            f"pass --allow-unknown-arch to plan it from tensor names alone ({NAME_ONLY_RULES})")


# ---- roles ---------------------------------------------------------------------------
ROLES = ("routed_expert", "shared_expert", "dense_mlp", "mla", "kda", "indexer", "attention",
         "vision", "mtp")
"""Names a recipe may use as ``role:<name>``."""

_ROUTED = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")
_SHARED = re.compile(r"\.shared_experts?\.(gate_proj|up_proj|down_proj)$")
_DENSE = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)$")
_INDEXER = re.compile(r"\.indexer\.[^.]+$")
_ATTN = re.compile(r"^(?P<a>.*\.(?:self_attn|linear_attn|attention|attn))\.(?P<m>[a-z_]+(?:\.[a-z_]+)?)$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Attention blocks are told apart by the projections they own (vLLM model classes):
# MLA owns kv_a_proj_with_mqa; KDA owns b_proj / f_a_proj (Kimi Linear, GLM-5.3-Flash).
_MLA_MARK = ("kv_a_proj_with_mqa",)
_KDA_MARK = ("b_proj", "f_a_proj", "forget_gate.f_a_proj")


def text_config(config: dict) -> dict:
    """The text-model part of a config (``text_config`` of multimodal wrappers, else itself)."""
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


# Config keys read as counts or sizes (this map, fit, the fixtures): a non-negative integer when
# present; the ``*_lora_rank`` keys may also be null (no low-rank projection).
CONFIG_INT_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                   "max_position_embeddings", "n_routed_experts", "num_experts", "n_shared_experts",
                   "num_experts_per_tok", "num_nextn_predict_layers", "kv_lora_rank", "q_lora_rank",
                   "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_head_dim",
                   "index_n_heads", "index_topk")


def config_type_errors(config: dict) -> list[tuple[str, str]]:
    """``(key, message)`` for each :data:`CONFIG_INT_KEYS` value of the wrong type or sign, at
    the top level and in ``text_config`` (key ``text_config.<name>``); empty when all are
    fine. Pre-flight reports them all, the plan refuses the first (``SourceError``)."""
    out = []
    for where, cfg in (("", config), ("text_config.", text_config(config))):
        if where and cfg is config:
            continue
        for key in CONFIG_INT_KEYS:
            v = cfg.get(key)
            if key not in cfg or (v is None and key.endswith("_lora_rank")):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                out.append((where + key, f"config.json {where}{key} is {v!r}: it must be a "
                                         "non-negative integer"))
    return out


def module_roles(module: str, modules: set[str], config: dict | None = None) -> frozenset[str]:
    """Roles of a Linear module, from its name and the set of module names present.

    ``mtp`` is added for modules of an MTP layer (index from config, never a constant).
    Returns an empty set for modules with no role (e.g. routers, which are sensitive).
    """
    roles = set()
    if _VISION.search(module):
        return frozenset({"vision"})
    if _ROUTED.search(module):
        roles.add("routed_expert")
    elif _SHARED.search(module):
        roles.add("shared_expert")
    elif _DENSE.search(module):
        roles.add("dense_mlp")
    elif _INDEXER.search(module):
        roles.add("indexer")
    else:
        m = _ATTN.match(module)
        if m:
            a = m["a"]
            if any(f"{a}.{x}" in modules for x in _KDA_MARK):
                roles.add("kda")
            elif any(f"{a}.{x}" in modules for x in _MLA_MARK):
                roles.add("mla")
            else:
                roles.add("attention")
    if config is not None:
        lm = _LAYER.search(module)
        if lm and int(lm.group(1)) in mtp_layer_indices(config):
            roles.add("mtp")
    return frozenset(roles)


def num_routed_experts(config: dict) -> int | None:
    """Routed-expert count from the text config (``n_routed_experts``, ``num_experts`` or
    ``num_local_experts``), or None for dense models."""
    cfg = text_config(config)
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def mtp_layer_indices(config: dict) -> list[int]:
    """Decoder-layer indices of MTP / NextN layers: ``num_hidden_layers + k`` for
    ``k < num_nextn_predict_layers`` (``num_mtp_layers`` in transformers' DeepseekV3Config)
    (DeepSeek-V3 README_WEIGHTS.md; never a constant)."""
    cfg = text_config(config)
    n = cfg.get("num_hidden_layers")
    k = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0
    return list(range(n, n + k)) if isinstance(n, int) else []


def fused_group_of(module: str, present: set[str]) -> tuple[str, tuple[str, ...]] | None:
    """The fused group ``module`` belongs to, as ``(group id, member module names present)``.

    When several rules match (GQA q/k/v vs KDA q/k/v/b/f_a/g_a) the one with the most members
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

    A router is also recognised when its MoE block has ``experts.*`` siblings, for configs
    that do not state the expert count.

    Returns:
        one of ``embedding``, ``lm_head``, ``router``, ``mtp_eh_proj``, ``vision``,
        ``indexer_weights_proj`` / ``indexer_wk`` (per model_type), or None.
    """
    if _EMBEDDING.search(module):
        return "embedding"
    if _LM_HEAD.search(module):
        return "lm_head"
    if _VISION.search(module):
        return "vision"
    if _EH_PROJ.search(module):
        return "mtp_eh_proj"
    if _SHARED_EXPERT_GATE.search(module):
        return "router"
    if _ROUTER.search(module):
        n_exp = num_routed_experts(config)
        block = module.rsplit(".", 1)[0]
        if ((n_exp is not None and shape[0] == n_exp)
                or f"{module}.e_score_correction_bias" in siblings
                or (n_exp is None and any(n.startswith(f"{block}.experts.") for n in siblings))):
            return "router"
    for pattern, role in _SENSITIVE_BY_MODEL_TYPE.get(config.get("model_type", ""), ()):
        if pattern.search(module):
            return role
    return None


# ---- tensor parallelism ----------------------------------------------------------------
# How engines shard each Linear under TP (vLLM model files): RowParallelLinear splits K,
# ColumnParallel / MergedColumnParallel split N, ReplicatedLinear splits nothing.
_ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj|w2|out_proj)$")
_REPLICATED = re.compile(
    r"(\.(q_a_proj|kv_a_proj_with_mqa|f_a_proj|g_a_proj|eh_proj)$)"  # DeepSeek MLA / KDA (vllm#56327)
    r"|(\.indexer\.[^.]+$)"  # DSA indexer runs replicated (vLLM deepseek_v2.py Indexer)
    r"|(\.(mlp|block_sparse_moe|moe)\.(gate|router)$)")


def tp_split(module: str) -> str:
    """``row`` (K split), ``column`` (N split) or ``replicated`` under tensor parallelism."""
    if _REPLICATED.search(module) or _VISION.search(module):
        return "replicated"
    if _ROW_PARALLEL.search(module):
        return "row"
    return "column"


# ---- release layouts (fixture builder) --------------------------------------------------
@dataclass(frozen=True)
class ReleaseLayout:
    """How an FP8 release stores its tensors, per model_type.

    Every 2-D ``.weight`` of an ``nn.Linear`` (and every per-expert weight) is block FP8
    (F8_E4M3 + F32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]) unless ``bf16_linears``
    matches; tensors matching ``f32`` are float32; everything else bfloat16.

    ``mtp_layer_kind``: config list entries appended for the MTP layer (it is a full
    attention + MoE decoder layer, DeepSeek-V3 README_WEIGHTS.md).

    ``config_keys``: keys the release's config.json carries that the transformers config
    class has no field for, but engines read (DeepSeek-V3 and GLM-5 config.json; vLLM 0.26
    deepseek_v2.py): the router's ``topk_method: noaux_tc`` (``e_score_correction_bias`` exists
    only with it) and ``scoring_func: sigmoid`` (default softmax), ``moe_layer_freq: 1`` (with
    ``first_k_dense_replace``, vLLM's only MoE-placement rule), GLM-5's
    ``indexer_rope_interleave: true`` (its indexer RoPE is interleaved, vLLM's default NeoX).
    GLM-5.3-Flash adds the keys vLLM's glm5next model reads as plain attributes (AttributeError
    when absent: ``mhc``, ``mla_use_nope``, ``topk_method``, ``scoring_func``,
    ``indexer_rope_interleave``) or with a default that differs from the release
    (``moe_router_dtype``, ``index_share_for_mtp_iteration``, ``index_kpool_compress``);
    docs/formats.md §A.3.4.

    ``bf16_roles``: ``module_roles`` whose Linear weights the release stores BF16 however
    they are named (GLM-5.3-Flash KDA, whose ``o_proj`` shares its name with MLA's).

    ``mtp_drop``: patterns of tensor names (relative to the MTP layer) the MTP layer of the
    release does not hold although the decoder layer it is built from has them
    (GLM-5.3-Flash: no mHC sites and no ``shared_head.head``; docs/formats.md §A.3.4).
    """

    model_type: str
    hf_class: str
    bf16_linears: tuple[str, ...]
    f32: tuple[str, ...]
    mtp_layer_kind: dict
    config_keys: dict = field(default_factory=dict)
    bf16_roles: tuple[str, ...] = ()
    mtp_drop: tuple[str, ...] = ()


_COMMON_BF16_LINEARS = (r"(^|\.)lm_head\.weight$", r"\.indexer\.weights_proj\.weight$",
                        r"\.eh_proj\.weight$", r"\.shared_head\.head\.weight$",
                        r"(^|\.)(visual|vision_tower)\.")

_NOAUX_TC = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
_GLM5_KEYS = {**_NOAUX_TC, "indexer_rope_interleave": True}
# GLM-5.3-Flash config.json keys vLLM 0.32 glm5next reads (docs/formats.md §A.3.4).
_GLM53_KEYS = {**_GLM5_KEYS, "mhc": True, "mla_use_nope": True, "moe_router_dtype": "float32",
               "index_share_for_mtp_iteration": True, "index_kpool_compress": True}
# vLLM 0.32 glm5next has no FP8 load path for the KDA projections, MLA kv_b_proj and indexer
# wq_b (only q_a / kv_a / q_b / o_proj and indexer wk are dequantized on load), so the FP8
# release stores them BF16 (docs/formats.md §A.3.4).
_GLM53_BF16_LINEARS = _COMMON_BF16_LINEARS + (r"\.self_attn\.kv_b_proj\.weight$",
                                              r"\.indexer\.wq_b\.weight$")

RELEASE_LAYOUTS: dict[str, ReleaseLayout] = {
    # DeepSeek-V3 FP8 release: router bf16, e_score_correction_bias f32
    # (DeepSeek-V3 README_WEIGHTS.md, inference/model.py Gate).
    "deepseek_v3": ReleaseLayout("deepseek_v3", "DeepseekV3ForCausalLM", _COMMON_BF16_LINEARS,
                                 (r"\.e_score_correction_bias$",), {}, _NOAUX_TC),
    # GLM-5 FP8 release: DeepSeek-style block FP8; indexer weights_proj bf16 without
    # weight_scale_inv (transformers models/glm_moe_dsa/modular_glm_moe_dsa.py).
    "glm_moe_dsa": ReleaseLayout("glm_moe_dsa", "GlmMoeDsaForCausalLM", _COMMON_BF16_LINEARS,
                                 (r"\.e_score_correction_bias$",),
                                 {"mlp_layer_types": "sparse", "layer_types": "indexed_attention",
                                  "indexer_types": "full"}, _GLM5_KEYS),
    # GLM-5.3-Flash: on-disk names = transformers 5.24 reverse conversion mapping
    # (conversion_mapping.py "glm5_next": f_a_proj/f_b_proj/dt_bias/A_log at self_attn level,
    # hc_{attn,ffn}_{fn,base,scale}, q/k/v_conv1d, per-expert 2-D experts). Float32 on disk:
    # the class's _keep_in_fp32_modules_strict minus the router weight [UNCONFIRMED: the
    # release's exact dtypes are not public; routers follow the DeepSeek/GLM-5 releases].
    # BF16 beyond the common set: every KDA projection, kv_b_proj, indexer wq_b (vLLM has no
    # FP8 path for them). MTP layer: an MLA + DSA + MoE decoder layer without mHC and without
    # shared_head.head (vLLM mtp.py builds neither; docs/formats.md §A.3.4).
    "glm5_next": ReleaseLayout("glm5_next", "Glm5NextForConditionalGeneration", _GLM53_BF16_LINEARS,
                               (r"\.e_score_correction_bias$", r"_conv1d\.weight$", r"\.dt_bias$",
                                r"\.A_log$", r"\.hc_(attn|ffn)_(base|scale)$"),
                               {"mlp_layer_types": "sparse", "layer_types": "indexed_attention",
                                "indexer_types": "full"}, _GLM53_KEYS,
                               bf16_roles=("kda",), mtp_drop=(r"^hc_(attn|ffn)_", r"^shared_head\.head\.")),
}

_LEGACY_LAYER_TYPES = {"indexed_attention": "deepseek_sparse_attention"}


def portable_layer_types(layer_types: list[str]) -> list[str]:
    """``layer_types`` as every transformers 5.x config class accepts them: transformers
    5.24 names DSA layers ``indexed_attention`` and maps the older ``deepseek_sparse_attention``
    onto it (``_LEGACY_LAYER_TYPE_REMAP``); 5.17, which vLLM 0.26 runs with, knows only
    ``deepseek_sparse_attention`` and rejects ``indexed_attention``. Other values unchanged."""
    return [_LEGACY_LAYER_TYPES.get(t, t) for t in layer_types]


MTP_EXTRA_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "shared_head.head.weight", "embed_tokens.weight")
"""Tensors an MTP layer holds besides a full decoder layer (DeepSeek-V3 README_WEIGHTS.md;
GLM-4.x NextN, llama.cpp PR #14939). Shapes: norms [H], eh_proj [H, 2H], head/embed [V, H].
A release may hold fewer (``ReleaseLayout.mtp_drop``: GLM-5.3-Flash has no ``shared_head.head``)."""


def release_storage(layout: ReleaseLayout, name: str, shape: tuple[int, ...],
                    is_linear: bool, roles: frozenset[str] = frozenset()) -> str:
    """On-disk storage of one tensor in an FP8 release: ``fp8`` (F8_E4M3 + weight_scale_inv),
    ``F32`` or ``BF16``. ``roles``: the module's :func:`module_roles` (matched against
    ``layout.bf16_roles``)."""
    if is_linear and len(shape) == 2 and name.endswith(".weight") and not any(
            re.search(p, name) for p in layout.bf16_linears) and not roles & set(layout.bf16_roles):
        return "fp8"
    if any(re.search(p, name) for p in layout.f32):
        return "F32"
    return "BF16"


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
    cfg = text_config(config)
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


# Names for what every TP rank holds whole (the decision is ``tp_split``): routers, the MLA
# ``fused_qkv_a_proj`` (DeepSeekV2FusedQkvAProjLinear, disable_tp), the DSA indexer (``wq_b``
# ReplicatedLinear, ``wk_weights_proj`` disable_tp, kpool parameters; vllm/models/glm5next/
# nvidia/attention.py), the KDA ``f_a`` / ``g_a`` shards of ``in_proj_qkvbfg_a``
# (replicated_shard_ids (4, 5), vllm/models/glm5next/common/kda.py), the MTP ``eh_proj``
# (nn.Linear), vision towers (conservative: vLLM can run the encoder data-parallel,
# ``mm_encoder_tp_mode="data"``). mHC mixing parameters (``hc_attn_fn`` ...) are plain
# full-size parameters on every rank (vllm/models/glm5next/nvidia/model.py).
_REPLICA_LABELS = (
    ("indexer", re.compile(r"\.indexer(\.|$)")),
    ("mla_a_proj", re.compile(r"\.(q_a_proj|kv_a_proj_with_mqa)$")),
    ("kda_a_proj", re.compile(r"\.(f_a_proj|g_a_proj)$")),
    ("mtp_eh_proj", _EH_PROJ),
    ("router", _ROUTER),
    ("vision", _VISION),
)
_MHC_PARAM = re.compile(r"(^|\.)(attn_hc|ffn_hc|hc_head)\.|\.hc_(attn|ffn|head)_")


def tp_replicated_role(name: str, shape: tuple[int, ...]) -> str | None:
    """Why tensor ``name`` (a weight, or an output tensor such as ``x.weight_packed``) is held
    whole by every TP rank, or None when ``tp_split`` splits it across ranks. 0-D / 1-D
    tensors (norms, biases, scalars, global scales, ``e_score_correction_bias``) and mHC
    parameters are replicated; indexer parameters without a Linear (kpool) too."""
    if len(shape) < 2:
        return "vector"
    if _MHC_PARAM.search(name):
        return "mhc"
    module = name.rsplit(".", 1)[0]
    if module.endswith(".indexer"):
        return "indexer"
    if tp_split(module) != "replicated":
        return None
    return next((label for label, pat in _REPLICA_LABELS if pat.search(module)), "replicated")

# ---- calibration (layer-streamed forward through the transformers classes) ---------------

FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""transformers >= 5 keeps routed experts in memory as two 3-D parameters [E, 2I, H] (gate
rows then up rows) and [E, H, I] (``DeepseekV3Experts``, ``GlmMoeDsaExperts``,
``Glm5NextTextExperts``, ``Qwen3MoeExperts``); on disk they are per expert."""

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""On-disk per-expert Linears: ``<block>.experts.<E>.{gate_proj,up_proj,down_proj}``
(docs/formats.md §A.3.1, §A.3.3)."""

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
scales on it as ``<layer>.self_attn.k_scale`` (docs/formats.md §B.4)."""

_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")

_KV_SCALE = re.compile(
    rf"^(?P<attn>(?:.+\.)?layers\.(?P<layer>\d+)\.(?:{'|'.join(ATTENTION_CHILDREN)}))"
    r"\.(?:k_proj\.(?=k_)|v_proj\.(?=v_)|attn\.)?(?P<kv>[kv])_scale$")


@dataclass(frozen=True)
class KVScaleName:
    """What a KV-cache scale tensor's name says: decoder layer, ``"k"`` or ``"v"``, and the
    attention module it belongs to (``model.language_model.layers.3.self_attn``)."""

    layer: int
    kv: str
    attention: str


def kv_scale_of(name: str) -> KVScaleName | None:
    """The KV-cache scale a tensor name holds, whatever the prefix before ``layers.N``.

    Layouts (docs/formats.md §B.4): compressed-tensors ``<attn>.k_scale`` / ``<attn>.v_scale``,
    ModelOpt ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale``, vLLM's remapped
    ``<attn>.attn.k_scale``; ``<attn>`` is ``<prefix>layers.N.<child>`` with ``child`` one of
    :data:`ATTENTION_CHILDREN` and any prefix (``model.``, ``model.language_model.``,
    ``language_model.model.``, none). Vision-tower blocks are not decoder layers (None), nor
    is anything else (weights, ``input_scale``, ``k_proj.weight_scale``).
    """
    if _VISION.search(name):
        return None
    m = _KV_SCALE.match(name)
    return KVScaleName(int(m["layer"]), m["kv"], m["attn"]) if m else None



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


# ---- config vs checkpoint layout (pre-flight) ---------------------------------------------
_TEXT_LAYER = re.compile(r"^(?P<pre>(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.)(\d+)\.(.+)$")
_LAYER_EXPERT = re.compile(r"^(?P<block>mlp|block_sparse_moe|moe)\.experts\.(?P<e>\d+)\.(?P<part>.+)$")
_ROUTER_WEIGHT = re.compile(r"^(?:mlp|block_sparse_moe|moe)\.(?:gate|router)\.weight$")
MTP_REQUIRED_PARTS = MTP_EXTRA_TENSORS[:4]
"""The MTP tensors every DeepSeek / GLM release has and engines build the draft from
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``: vLLM's ``DeepSeekMultiTokenPredictorLayer``
and ``SharedHead``); the shared head and embedding duplicate the main ones and are not
required. Pre-flight and ``quantize check`` both read this one list."""


def _spans(ids) -> str:
    """Sorted integers as compact ranges: 0-3, 7, 9-10."""
    ids, out = sorted(ids), []
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


def moe_layer_indices(config: dict) -> set[int] | None:
    """Decoder layers (< num_hidden_layers) that the config makes MoE, or None when the config
    does not say: ``first_k_dense_replace`` (DeepSeek-V3, GLM-4.5: layers from k on) or
    ``mlp_layer_types`` (GLM-5: ``"sparse"`` entries)."""
    cfg = text_config(config)
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or num_routed_experts(config) is None:
        return None
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == n:
        return {i for i, t in enumerate(types) if t == "sparse"}
    k = cfg.get("first_k_dense_replace")
    if isinstance(k, int):
        return set(range(k, n))
    return None


def check_layout(config: dict, shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, str, str | None]]:
    """Does the checkpoint have the layers, MTP layers and experts its config declares?

    Checks (text model only; vision towers are skipped): decoder layers
    ``0 .. num_hidden_layers + num_nextn_predict_layers - 1`` all present and none beyond
    (warning); each MTP layer has :data:`MTP_REQUIRED_PARTS`; in every layer with routed
    experts, expert ids are exactly ``0 .. n_routed_experts - 1``, every expert has the same
    tensors with the same shapes, and the router has ``n_routed_experts`` rows; MoE / dense
    placement agrees with ``first_k_dense_replace`` / ``mlp_layer_types``.

    Args:
        config: the source config.json.
        shapes: every stored tensor name (scales included) -> shape, or None where the
            shape is unknown (its shard header is unreadable): presence is still checked.

    Returns:
        ``(level, message, tensor)`` triples, level ``error`` / ``warning`` / ``info``
        (a single info when the config has no ``num_hidden_layers`` to compare against).
    """
    cfg = text_config(config)
    n = cfg.get("num_hidden_layers")
    where = "text_config." if cfg is not config else ""
    if "num_hidden_layers" in cfg and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        return [("info", f"config.json {where}num_hidden_layers is {n!r} ({type(n).__name__}, not "
                 "a non-negative integer): layers, MTP layers and experts not checked against it",
                 None)]
    if not isinstance(n, int):
        return [("info", "config.json has no num_hidden_layers: layers, MTP layers and experts "
                 "not checked against it", None)]
    k = cfg.get("num_nextn_predict_layers") or 0
    k = k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else 0
    n_exp = num_routed_experts(config)
    out: list[tuple[str, str, str | None]] = []
    layers: dict[int, dict[str, tuple[int, ...]]] = {}
    prefix: dict[int, str] = {}
    for name, shape in shapes.items():
        m = _TEXT_LAYER.match(name)
        if m and not _VISION.search(name):
            layers.setdefault(int(m[2]), {})[m[3]] = shape
            prefix[int(m[2])] = m["pre"]
    want = set(range(n + k))
    declared = (f"{n} decoder layer(s) ({_spans(range(n)) or 'none'}, num_hidden_layers={n}) and "
                f"{k} MTP layer(s) ({_spans(range(n, n + k))}, num_nextn_predict_layers={k})"
                if k else None)
    lost = want - set(layers)
    if lost and declared is None:
        out.append(("error", f"config.json declares num_hidden_layers={n} but the checkpoint has "
                    f"no tensors for layer(s) {_spans(lost)}", None))
    elif lost:
        gone = [f"{what} layer(s) {_spans(ids)}" for what, ids in
                (("decoder", {i for i in lost if i < n}), ("MTP", {i for i in lost if i >= n})) if ids]
        out.append(("error", f"config.json declares {declared} but the checkpoint has no tensors "
                    f"for {' and '.join(gone)}", None))
    if set(layers) - want:
        out.append(("warning", f"checkpoint has layer(s) {_spans(set(layers) - want)} beyond the "
                    + (declared or f"{n} decoder layer(s) ({_spans(range(n)) or 'none'}, "
                       f"num_hidden_layers={n}) and no MTP layer")
                    + " config.json declares; they are converted as stored", None))
    for j, layer in enumerate(range(n, n + k)):
        lacking = [p for p in MTP_REQUIRED_PARTS if p not in layers.get(layer, {})]
        if layer in layers and lacking:
            out.append(("error", f"MTP layer {layer} (num_hidden_layers + {j}) lacks "
                        f"{', '.join(lacking)}", f"{prefix[layer]}{layer}.{lacking[0]}"))
    moe = moe_layer_indices(config)
    for layer, parts in sorted(layers.items()):
        experts: dict[int, dict[str, tuple[int, ...]]] = {}
        block = None
        for part, shape in parts.items():
            m = _LAYER_EXPERT.match(part)
            if m:
                block = m["block"]
                experts.setdefault(int(m["e"]), {})[m["part"]] = shape
        where = f"layer {layer}"
        if moe is not None and layer < n and (layer in moe) != bool(experts):
            say = "MoE" if layer in moe else "dense"
            out.append(("error", f"config.json makes {where} {say} but the checkpoint has "
                        f"{'no' if layer in moe else len(experts)} routed experts there", None))
        if not experts:
            continue
        if n_exp is not None and set(experts) != set(range(n_exp)):
            lost, odd = set(range(n_exp)) - set(experts), set(experts) - set(range(n_exp))
            msg = f"{where} has {len(experts)} routed experts, config.json declares {n_exp}"
            msg += f"; missing expert(s) {_spans(lost)}" if lost else ""
            msg += f"; unexpected expert(s) {_spans(odd)}" if odd else ""
            out.append(("error", msg, None))
        all_parts = sorted(set().union(*experts.values()))
        for part in all_parts:
            seen = {e: p[part] for e, p in experts.items() if part in p}
            if len(seen) != len(experts):
                lacking = sorted(set(experts) - set(seen))
                out.append(("error", f"{where}: expert(s) {_spans(lacking)} lack "
                            f"{block}.experts.N.{part}, which the other experts have",
                            f"{prefix[layer]}{layer}.{block}.experts.{lacking[0]}.{part}"))
            seen = {e: s for e, s in seen.items() if s is not None}
            if not seen:
                continue
            common = max(set(seen.values()), key=list(seen.values()).count)
            odd = sorted(e for e, s in seen.items() if s != common)
            if odd:
                out.append(("error", f"{where}: {block}.experts.N.{part} of expert(s) "
                            f"{_spans(odd)} is {list(seen[odd[0]])}, the other experts' "
                            f"{list(common)}", f"{prefix[layer]}{layer}.{block}.experts.{odd[0]}.{part}"))
        for part, shape in parts.items():
            if _ROUTER_WEIGHT.match(part) and n_exp is not None and shape and shape[0] != n_exp:
                out.append(("error", f"{where}: router {part} has {shape[0]} rows but config.json "
                            f"declares {n_exp} routed experts", f"{prefix[layer]}{layer}.{part}"))
    return out


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
        the decoder layers that keep a per-token record (every layer :func:`attention_layers`
        does not make KDA / linear attention).
    """
    cfg = text_config(config)
    layers = sum(1 for a in attention_layers(config) if a.kind is not AttnKind.KDA)
    if cfg.get("kv_lora_rank"):
        return {"kind": "mla", "latent": int(cfg["kv_lora_rank"]),
                "rope": int(cfg["qk_rope_head_dim"]), "layers": layers}
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    return {"kind": "mha", "kv_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(head_dim), "layers": layers}
