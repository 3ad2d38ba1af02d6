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
           "num_routed_experts", "mtp_layer_indices", "moe_layer_indices", "check_layout",
           "MTP_REQUIRED_PARTS"]


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

_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embed_in|wte|wpe|tok_embeddings|word_embeddings|"
                        r"embed_positions|position_embeddings)$")
_LM_HEAD = re.compile(r"(^|\.)(lm_head|embed_out|shared_head\.head|output)$")
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe|moe|feed_forward)\.(gate|router)$")
# Qwen2-MoE / Qwen3-Next shared-expert gate: [1, hidden], a scalar gate per token.
_SHARED_EXPERT_GATE = re.compile(r"\.shared_expert_gate$")
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

    A router is also recognised when its MoE block has ``experts.*`` siblings, for configs
    that do not state the expert count.

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
    if _SHARED_EXPERT_GATE.search(module):
        return "router"
    if _ROUTER.search(module):
        n_exp = num_routed_experts(config)
        block = module.rsplit(".", 1)[0]
        if ((n_exp is not None and shape[0] == n_exp)
                or f"{module}.e_score_correction_bias" in siblings
                or (n_exp is None and any(n.startswith(f"{block}.experts.") for n in siblings))):
            return "router"
    return None


# ---- config vs checkpoint layout (pre-flight) ---------------------------------------------
_TEXT_LAYER = re.compile(r"^(?P<pre>(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.)(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?P<block>mlp|block_sparse_moe|moe)\.experts\.(?P<e>\d+)\.(?P<part>.+)$")
_ROUTER_WEIGHT = re.compile(r"^(?:mlp|block_sparse_moe|moe)\.(?:gate|router)\.weight$")
MTP_REQUIRED_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
"""Tensors every DeepSeek / GLM MTP (NextN) layer has (DeepSeek-V3 README_WEIGHTS.md;
formats_spec.md A.3.1-A.3.3)."""


def _text(config: dict) -> dict:
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


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
    cfg = _text(config)
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
    cfg = _text(config)
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int):
        return [("info", "config.json has no num_hidden_layers: layers, MTP layers and experts "
                 "not checked against it", None)]
    k = cfg.get("num_nextn_predict_layers") or 0
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
    if want - set(layers):
        out.append(("error", f"config.json declares num_hidden_layers={n}"
                    + (f" + num_nextn_predict_layers={k}" if k else "")
                    + f" but the checkpoint has no tensors for layer(s) {_spans(want - set(layers))}",
                    None))
    if set(layers) - want:
        out.append(("warning", f"checkpoint has layer(s) {_spans(set(layers) - want)} beyond the "
                    f"{n + k} layers config.json declares; they are converted as stored", None))
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
            m = _EXPERT.match(part)
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
