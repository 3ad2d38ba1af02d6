"""Decide what every source tensor becomes, and predict the bytes written. Pure: reads only
names, shapes, dtypes and the config.

Order of precedence, one place:

1. not a 2-D Linear weight -> kept as stored;
2. a sensitive module (``archs.sensitive_role``) -> kept (FP8 -> bf16);
3. the recipe's first matching rule (by name or ``role:``); a recipe that gives the members
   of a fused group different targets is refused (:class:`RecipeError` naming the group);
4. a target the per-TP-shard shape cannot carry on the engine (``formats.engines``
   alignment rows: NVFP4 K % 16, SGLang MoE K % 256, MXFP8 K % 32, block-FP8 partitions
   % 128) -> kept in high precision, with the reason;
5. a fused group whose member was kept by 2 or 4 is kept whole, so engines never see a
   half-quantized fused GEMM (vLLM "Detected some but not all shards of ... are
   quantized", docs/formats.md §A.2.3);
6. a plan whose routed experts of one MoE layer end in more than one scheme is refused
   (:class:`RecipeError`; the rule ``formats.engines.mixed_moe_schemes`` that ``quantize check``
   applies to the build);
7. a plan that quantizes a Linear the engine builds unquantized for this model (an ``error``
   row of ``formats.engines.MODEL_RULES``, e.g. GLM-5.3-Flash MLA / indexer / KDA on vLLM) is
   refused (:class:`RecipeError`; ``formats.engines.model_rules_broken``, which ``quantize
   check`` applies to the build).
"""

from dataclasses import dataclass

import torch

from formats import get_writer
from formats.engines import (
    ENGINES,
    MOE_ONE_SCHEME,
    align_violations,
    mixed_moe_schemes,
    model_rules_broken,
)
from formats.sources import LogicalTensor, Source
from quantize import archs
from quantize.base.errors import RecipeError, SourceError
from quantize.plan.recipe import Recipe, Target

__all__ = ["Decision", "plan_tensors", "arch_assumption", "module_of", "dropped_tensors", "predict_outputs", "unplaced",
           "unplaced_note", "UNPLACED",
           "predicted_bytes", "fp8_passthrough", "explain", "kv_scale_anchor"]


@dataclass(frozen=True)
class Decision:
    """Target of one logical tensor, why, its fused group id (if any) and its roles."""

    name: str
    target: Target
    reason: str
    group: str | None = None
    members: tuple[str, ...] = ()
    roles: frozenset[str] = frozenset()


def module_of(name: str) -> str | None:
    """Module name of a Linear-style weight (``x.y.weight`` -> ``x.y``), else None."""
    return name[: -len(".weight")] if name.endswith(".weight") and len(name) > len(".weight") else None


UNPLACED = "no recipe rule matches"
"""Reason of a Linear weight no rule of the recipe matches (kept unquantized, in ``ignore``)."""


def _kept(t: LogicalTensor) -> Target:
    # An FP8 weight cannot be written "as is" into an unquantized slot: it is dequantized.
    return Target.BF16 if t.is_fp8 else Target.KEEP


def _kind(target: Target) -> str:
    """What an engine sees: the quantized format, or "unquantized" for bf16 / keep."""
    return target.value if target.quantized else "unquantized"


def dropped_tensors(source: Source) -> set[str]:
    """Logical tensors not written: ``lm_head.weight`` when ``tie_word_embeddings`` is true and
    it equals the embedding bit for bit (the loader ties the head to embed_tokens; FC-23).

    A stored head that differs is what transformers uses (it declines to tie differing
    tensors), so it is kept and the converter clears the tie flag. A header-only descriptor
    has no data to compare: its head is taken as the duplicate.
    """
    if not tied_embeddings(source.config) or "lm_head.weight" not in source.tensors:
        return set()
    emb = next((n for n in source.tensors if n.endswith("embed_tokens.weight")), None)
    if emb is None:
        return set()
    if not source.has_data:
        return {"lm_head.weight"}
    a, b = source.read("lm_head.weight"), source.read(emb)
    same = (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8)))
    return {"lm_head.weight"} if same else set()


def tied_embeddings(config: dict) -> bool:
    """``tie_word_embeddings`` from the top-level or text config."""
    cfg = archs.text_config(config)
    return bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))


def plan_tensors(source: Source, recipe: Recipe, *, tp: int = 1, engine: str = "vllm",
                 allow_unknown_arch: bool = False) -> dict[str, Decision]:
    """Decide every logical tensor of ``source``.

    Args:
        tp: tensor-parallel size the build will be served with (per-shard alignment).
        engine: whose alignment rules apply (``formats.engines.ENGINES``).
        allow_unknown_arch: plan a ``model_type`` the architecture map does not know
            (``archs.unknown_arch``: an unknown one, or none in a model's config) from tensor
            names alone (``archs.NAME_ONLY_RULES``; :func:`arch_assumption` states the result).

    Returns:
        logical tensor name -> Decision, for every tensor the source has.

    Raises:
        SourceError: a config count or size of the wrong type (``archs.config_type_errors``,
            ``key`` names it), or the config's ``model_type`` is not in ``archs.KNOWN_MODEL_TYPES``
            (or a model's config has none, ``archs.missing_model_type``) and
            ``allow_unknown_arch`` is false (``key`` ``model_type``; the message names the known
            ones and the flag).
        RecipeError: the recipe splits a fused group (names the group and each member's
            target), or the routed experts of one MoE layer would mix schemes at this TP
            (names the layer, one expert weight, its target and why), or the plan quantizes
            a Linear ``engine`` builds unquantized for this model (``formats.engines.MODEL_RULES``
            error rows; names the count per role, the first tensor and the engine source).
    """
    config = source.config
    if bad := archs.config_type_errors(config):
        raise SourceError(bad[0][1], key=bad[0][0])
    if archs.unknown_arch(config) is not None and not allow_unknown_arch:
        raise SourceError(archs.unknown_arch_message(archs.unknown_model_type(config)), key="model_type")
    names = set(source.tensors)
    modules = {m for n in names if (m := module_of(n)) is not None}
    out: dict[str, Decision] = {}
    wanted: dict[str, Target] = {}  # what the recipe asked, before feasibility
    for t in source.tensors.values():
        mod = module_of(t.name)
        if mod is None or len(t.shape) != 2 or 0 in t.shape:
            why = (f"not a Linear weight ({len(t.shape)}-D)" if mod is not None and len(t.shape) > 2
                   else "not a Linear weight")
            out[t.name] = Decision(t.name, _kept(t), why)
            continue
        grp = archs.fused_group_of(mod, modules)
        gid, members = grp if grp else (None, ())
        roles = archs.module_roles(mod, modules, config)
        role = archs.sensitive_role(mod, t.shape, config, names)
        if role:
            out[t.name] = Decision(t.name, _kept(t), f"sensitive: {role}", gid, members, roles)
            continue
        target = recipe.resolve(mod, roles)
        if target is Target.KEEP and t.is_fp8:
            target = Target.BF16
        wanted[t.name] = target
        reason = (f"recipe {recipe.name}" if recipe.places(mod, roles)
                  else f"recipe {recipe.name}: {UNPLACED}")
        if target.quantized:
            bad = align_violations(engine, target.value, t.shape, archs.tp_split(mod), tp,
                                   "routed_expert" in roles)
            if bad:
                target, reason = _kept(t), bad[0]
        out[t.name] = Decision(t.name, target, reason, gid, members, roles)
    _refuse_split_groups(out, wanted, recipe)
    # A fused group is quantized whole (one format) or not at all.
    for d in list(out.values()):
        if d.group is None or not d.target.quantized:
            continue
        odd = [m for m in d.members if out[m + ".weight"].target is not d.target]
        if odd:
            why = out[odd[0] + ".weight"].reason
            out[d.name] = Decision(d.name, _kept(source.tensors[d.name]),
                                   f"fused group {d.group}: {odd[0]} is not {d.target.value} ({why})",
                                   d.group, d.members, d.roles)
    _refuse_mixed_moe(out, source, recipe, tp, engine, wanted)
    _refuse_model_rules(out, config, recipe, engine)
    return out


def arch_assumption(config: dict, decisions: dict[str, Decision]) -> str | None:
    """The one line stating what a plan of an unknown ``model_type`` assumed
    (``archs.unknown_arch``; None for a known one): the name-only rules, then the Linear
    weights kept high precision per sensitive role and those quantized per target and role,
    counted from ``decisions``."""
    what = archs.unknown_arch(config)
    if what is None:
        return None
    kept: dict[str, int] = {}
    quant: dict[str, dict[str, int]] = {}
    other = 0
    for d in decisions.values():
        if d.reason.startswith("sensitive: "):
            role = d.reason[len("sensitive: "):]
            kept[role] = kept.get(role, 0) + 1
        elif d.target.quantized:
            role = "/".join(sorted(d.roles)) or "no role"
            per = quant.setdefault(d.target.value, {})
            per[role] = per.get(role, 0) + 1
        elif not d.reason.startswith("not a Linear weight"):
            other += 1

    def counts(c: dict[str, int]) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(c.items())) or "none"

    q = "; ".join(f"{t}: {counts(c)}" for t, c in sorted(quant.items())) or "none"
    return (f"{what}; planned from tensor names alone "
            f"(--allow-unknown-arch): {archs.NAME_ONLY_RULES}. High precision: {counts(kept)}; "
            f"quantized: {q}; other Linear weights left unquantized by the recipe or alignment: {other}")


def unplaced(decisions: dict[str, Decision]) -> list[str]:
    """Weights no recipe rule places, sorted: 2-D Linear weights no rule matches and N-D
    (N > 2) ``.weight`` tensors, which are no Linear (e.g. a vision tower's Conv). Both are
    written unquantized and their modules listed in ``ignore``."""
    return sorted(n for n, d in decisions.items()
                  if d.reason.endswith(UNPLACED) or d.reason.startswith("not a Linear weight ("))


def unplaced_note(decisions: dict[str, Decision]) -> str | None:
    """The converter's summary note for :func:`unplaced` (None when every weight is placed)."""
    names = unplaced(decisions)
    if not names:
        return None
    return (f"{len(names)} weight(s) no recipe rule places, written unquantized and listed in "
            f"ignore: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")


def _refuse_mixed_moe(out: dict[str, Decision], source: Source, recipe: Recipe, tp: int,
                      engine: str, wanted: dict[str, Target]) -> None:
    """The final ``quantize check`` rule on routed experts (``formats.engines.mixed_moe_schemes``)
    applied to the plan, so a plan that would fail it is refused before any shard is written.
    The advice is what can help: another ``--tp`` only when the expert loads unsplit (TP=1);
    else the engines whose alignment rows it meets at this TP, or a recipe change."""
    kinds = {m: _kind(d.target) for n, d in out.items()
             if (m := module_of(n)) is not None and len(source.tensors[n].shape) == 2}
    mixed = mixed_moe_schemes(kinds)
    if not mixed:
        return
    prefix, found = next(iter(mixed.items()))
    minority = min(found, key=lambda k: sum(
        1 for m, v in kinds.items() if v == k and m.startswith(prefix + ".")))
    d = next(d for n, d in sorted(out.items())
             if n.startswith(prefix + ".") and kinds.get(module_of(n)) == minority)
    more = f" (and {len(mixed) - 1} more MoE layer(s))" if len(mixed) > 1 else ""
    advice = ("choose a --tp that every expert projection splits over, or a recipe that gives "
              "these experts one target")
    asked = wanted.get(d.name)
    if asked is not None and asked.quantized and not d.target.quantized:
        shape, split = source.tensors[d.name].shape, archs.tp_split(module_of(d.name))
        unsplit = align_violations(engine, asked.value, shape, split, 1, True)
        if unsplit:
            ok = [e for e in ENGINES if e != engine
                  and not align_violations(e, asked.value, shape, split, tp, True)]
            advice = (f"no --tp helps ({unsplit[0].split(' (')[0]} even at TP=1): "
                      + (f"serve it with --engine {' or '.join(ok)}, or " if ok else "")
                      + f"use a recipe that gives these experts one target {engine} loads at this "
                      f"shape (bf16 keeps them all unquantized)")
    raise RecipeError(
        f"recipe {recipe.name} at TP={tp} mixes {found} in the routed experts of {prefix}{more}: "
        f"{d.name} -> {d.target.value} ({d.reason}); {MOE_ONE_SCHEME}, so this build would fail "
        f"its final check: {advice}", key=prefix)


def _refuse_model_rules(out: dict[str, Decision], config: dict, recipe: Recipe, engine: str) -> None:
    """The ``quantize check`` model rule (``formats.engines.model_rules_broken``, ``error``
    rows) applied to the plan: a quantized Linear the engine builds unquantized is refused
    before any shard is written."""
    hits: dict = {}
    model_type = str(config.get("model_type", ""))
    for n, d in sorted(out.items()):
        if not d.target.quantized:
            continue
        for r in model_rules_broken(engine, model_type, d.roles):
            if r.level == "error":
                hits.setdefault(r, []).append(d)
    if not hits:
        return
    r, ds = next(iter(hits.items()))
    more = "".join(f", {len(v)} {k.role}" for k, v in list(hits.items())[1:])
    raise RecipeError(
        f"recipe {recipe.name} quantizes {len(ds)} {r.role}{more} Linear(s) of {model_type} that "
        f"{engine} cannot load: {ds[0].name} -> {ds[0].target.value}; {r.source}. Choose a recipe "
        f"that keeps them bf16 (spark-mixed)", tensor=ds[0].name)


def _refuse_split_groups(out: dict[str, Decision], wanted: dict[str, Target], recipe: Recipe) -> None:
    seen = set()
    for d in out.values():
        if d.group is None or d.group in seen:
            continue
        seen.add(d.group)
        asked = {m: wanted[m + ".weight"] for m in d.members if m + ".weight" in wanted}
        if len({_kind(t) for t in asked.values()}) > 1:
            detail = ", ".join(f"{m.rsplit('.', 1)[-1]} -> {t.value}" for m, t in asked.items())
            raise RecipeError(f"recipe {recipe.name} splits fused group {d.group} ({detail}); engines "
                              "run these as one GEMM, so give every member the same target",
                              key=d.group)


def fp8_passthrough(source: Source, name: str):
    """The scale sidecar (``TensorInfo``) when ``name`` is stored as 128x128 block FP8 whose
    bytes can pass through to an ``fp8-block`` target untouched, else None."""
    t = source.tensors[name]
    if (t.is_fp8 and source.layout is not None and source.layout.block == (128, 128)
            and t.scale.dtype in ("F32", "BF16")):  # an F8_E8M0 scale is re-quantized
        return t.scale
    return None


def kv_scale_anchor(source: Source, attention: str) -> str | None:
    """The logical tensor whose output shard carries ``attention``'s FP8 KV scales: the
    block's first tensor by name, or None when the source has no tensor under it."""
    return next((n for n in sorted(source.tensors) if n.startswith(attention + ".")), None)


def predict_outputs(source: Source, decisions: dict[str, Decision], fmt: str, *,
                    scheme: str = "w4a16", kv_scales: dict[str, str] | None = None) -> dict[str, dict]:
    """Output tensors of every logical tensor, from headers only.

    Args:
        scheme: ``w4a16`` or ``w4a4`` (NVFP4 modules also get the writer's input scale).
        kv_scales: attention block -> safetensors dtype of its FP8 KV scales (calibrated
            builds); they are predicted with the block's :func:`kv_scale_anchor`.

    Returns:
        logical name -> {output tensor name: (safetensors dtype, shape)}; dropped tensors
        (:func:`dropped_tensors`) map to {}. The converter writes exactly these (it checks).
    """
    writer = get_writer(fmt)
    dropped = dropped_tensors(source)
    out = {}
    for name, d in decisions.items():
        t = source.tensors[name]
        if name in dropped:
            out[name] = {}
            continue
        if d.target is Target.KEEP:
            out[name] = {name: (t.dtype, t.shape)}
        elif d.target is Target.BF16:
            out[name] = {name: ("BF16", t.shape)}
        else:
            scale = fp8_passthrough(source, name) if d.target is Target.FP8_BLOCK else None
            out[name] = writer.output_specs(module_of(name), d.target.value, t.shape,
                                            scale.dtype if scale is not None else "F32", scheme)
    for attn, dtype in (kv_scales or {}).items():
        anchor = kv_scale_anchor(source, attn)
        if anchor is not None and anchor in out:
            out[anchor] = {**out[anchor], **writer.kv_scale_specs(attn, dtype)}
    return out


def predicted_bytes(source: Source, decisions: dict[str, Decision], fmt: str) -> dict[str, int]:
    """Bytes the build will hold for each logical tensor (all its output tensors), from
    headers only; the sum equals the build's ``metadata.total_size`` to the byte."""
    from formats.shards import DTYPE_BYTES

    def nbytes(dtype, shape):
        n = DTYPE_BYTES[dtype]
        for s in shape:
            n *= s
        return n

    return {name: sum(nbytes(dt, sh) for dt, sh in outs.values())
            for name, outs in predict_outputs(source, decisions, fmt).items()}


def explain(source: Source, recipe: Recipe, fmt: str = "compressed-tensors", *, tp: int = 1,
            engine: str = "vllm", summary_only: bool = False, allow_unknown_arch: bool = False) -> str:
    """The table behind ``quantize recipe show``: every tensor's target, reason and predicted
    output bytes, then totals per target and the resulting build size (tensor bytes, the
    ``metadata.total_size`` the build will have).

    Raises:
        RecipeError: from :func:`plan_tensors`.
    """
    decisions = plan_tensors(source, recipe, tp=tp, engine=engine, allow_unknown_arch=allow_unknown_arch)
    sizes = predicted_bytes(source, decisions, fmt)
    lines = []
    if not summary_only:
        lines.append(f"{'tensor':<72} {'source':<22} {'target':<10} {'bytes':>14}  reason")
        for name in sorted(decisions):
            t, d = source.tensors[name], decisions[name]
            src = f"{'fp8' if t.is_fp8 else t.dtype.lower()} {'x'.join(map(str, t.shape))}"
            lines.append(f"{name:<72} {src:<22} {d.target.value:<10} {sizes[name]:>14,}  {d.reason}")
    bytes_in = sum(i.nbytes for i in source.infos.values())
    by_target: dict[str, list[int]] = {}
    for name, d in decisions.items():
        agg = by_target.setdefault(d.target.value, [0, 0, 0])
        agg[0] += 1
        agg[1] += source.tensors[name].numel
        agg[2] += sizes[name]
    total = sum(sizes.values())
    lines.append(f"recipe {recipe.name}, format {fmt}, engine {engine}, TP {tp}: "
                 f"{len(decisions)} tensors from {source.folder.name}")
    for target, (count, numel, nbytes) in sorted(by_target.items()):
        lines.append(f"  {target:<10} {count:>7} tensors {numel / 1e9:>9.3f} G params "
                     f"{nbytes / 2**30:>10.2f} GiB")
    lines.append(f"  source {bytes_in:,} bytes ({bytes_in / 2**30:.2f} GiB) -> build {total:,} bytes "
                 f"({total / 2**30:.2f} GiB, {total / 1e9:.1f} GB)")
    if (assumed := arch_assumption(source.config, decisions)) is not None:
        lines.append(f"note: {assumed}")
    return "\n".join(lines)
