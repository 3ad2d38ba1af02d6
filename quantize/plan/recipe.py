"""Recipes: ordered first-match rules, module name -> target. Data, not code.

A rule's ``match`` is an exact module name, a regex prefixed ``re:`` matched with
``re.match`` (anchored at the start), the convention of compressed-tensors ``targets`` /
``ignore`` (compressed_tensors/utils/match.py), or ``role:<name>`` for a role from
``quantize.archs.ROLES`` (``role:kda`` covers every Linear of a KDA block whatever its
name), so presets stay free of architecture names. Presets ship as TOML in
``quantize/plan/recipes``.
"""

import hashlib
import re
import tomllib
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from pathlib import Path

from quantize.archs import ROLES
from quantize.base.errors import RecipeError

__all__ = ["DEFAULT_RECIPE", "MODEL_RECIPES", "default_recipe", "Target", "Rule", "Recipe", "load_recipe", "preset_names"]


class Target(str, Enum):
    """What a tensor becomes. Values are the names used in recipe files."""

    NVFP4 = "nvfp4"  # packed e2m1 + e4m3 block scales [N, K/16] + fp32 global scale
    FP8_BLOCK = "fp8-block"  # e4m3 + fp32 128x128 block scale; FP8-block sources pass through
    MXFP8 = "mxfp8"  # e4m3 + e8m0 scale per 32 along K
    BF16 = "bf16"  # dequantized / cast to bfloat16, listed as ignored
    KEEP = "keep"  # bytes exactly as in the source (FP8 sources: dequantized to bf16)

    @property
    def quantized(self) -> bool:
        """True for targets written in a quantized layout (not in ``ignore``)."""
        return self in (Target.NVFP4, Target.FP8_BLOCK, Target.MXFP8)


@dataclass(frozen=True)
class Rule:
    """``match`` (exact module name or ``re:`` regex) -> ``target``."""

    match: str
    target: Target

    def __post_init__(self):
        if self.match.startswith("role:") and self.match[5:] not in ROLES:
            raise RecipeError(f"rule {self.match!r}: unknown role (valid: {', '.join(ROLES)})",
                              key=self.match)
        if self.match.startswith("re:"):
            try:
                re.compile(self.match[3:])
            except re.error as e:
                raise RecipeError(f"recipe rule match {self.match!r} is not a valid regex ({e})",
                                  key=self.match) from None

    def matches(self, module: str, roles: frozenset[str] = frozenset()) -> bool:
        if self.match.startswith("role:"):
            return self.match[5:] in roles
        if self.match.startswith("re:"):
            return re.match(self.match[3:], module) is not None
        return module == self.match


@dataclass(frozen=True)
class Recipe:
    """An ordered list of rules; the first rule that matches a module decides its target.
    A module no rule matches is kept."""

    name: str
    rules: tuple[Rule, ...]
    description: str = ""
    sha256: str = ""

    def places(self, module: str, roles: frozenset[str] = frozenset()) -> bool:
        """True when a rule matches ``module`` (else :meth:`resolve` keeps it by default)."""
        return any(rule.matches(module, roles) for rule in self.rules)

    def resolve(self, module: str, roles: frozenset[str] = frozenset()) -> Target:
        """Target of ``module`` (with its ``archs.module_roles``): first matching rule, else keep."""
        for rule in self.rules:
            if rule.matches(module, roles):
                return rule.target
        return Target.KEEP


DEFAULT_RECIPE = "weight-only"
MODEL_RECIPES = {"glm5_next": "spark-mixed"}
"""The preset recommended for a ``model_type`` (its ``--recipe`` default): GLM-5.3-Flash keeps
MLA and KDA in BF16, which vLLM's glm5next model builds without a quant_config
(``formats.engines.MODEL_RULES``), so a weight-only plan is refused for ``--engine vllm``."""


def default_recipe(config: dict) -> str:
    """The ``--recipe`` default for a source: :data:`MODEL_RECIPES` by its top-level
    ``model_type``, else :data:`DEFAULT_RECIPE`."""
    return MODEL_RECIPES.get(str(config.get("model_type")), DEFAULT_RECIPE)


def preset_names() -> list[str]:
    """Names of the presets shipped in the package."""
    return sorted(p.name[:-5] for p in resources.files("quantize.plan.recipes").iterdir()
                  if p.name.endswith(".toml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a preset by name (``weight-only``) or a TOML file by path.

    Raises:
        RecipeError: unknown preset (listing the valid names), unreadable TOML, or a rule
            with a missing key, unknown target or bad regex.
    """
    p = Path(name_or_path)
    if p.suffix == ".toml" and not p.is_file():
        raise RecipeError(f"recipe file {p}: no such file", key=str(name_or_path))
    if p.suffix == ".toml":
        text = p.read_text()
    elif str(name_or_path) in preset_names():
        text = resources.files("quantize.plan.recipes").joinpath(f"{name_or_path}.toml").read_text()
    else:
        raise RecipeError(f"unknown recipe {str(name_or_path)!r}: give a .toml file or one of "
                          f"{', '.join(preset_names())}", key=str(name_or_path))
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"recipe {name_or_path}: {e}", key=str(name_or_path)) from None
    rules = []
    if not isinstance(data.get("rule", []), list):
        raise RecipeError(f"recipe {name_or_path}: 'rule' must be an array of tables "
                          "([[rule]] with match and target)", key="rule")
    for i, r in enumerate(data.get("rule", [])):
        if not isinstance(r, dict) or "match" not in r or "target" not in r:
            raise RecipeError(f"recipe {name_or_path}: rule {i} needs 'match' and 'target'",
                              key=f"rule[{i}]")
        if r["target"] not in {t.value for t in Target}:
            raise RecipeError(f"recipe {name_or_path}: rule {i} has unknown target "
                              f"{r['target']!r} (valid: {', '.join(t.value for t in Target)})",
                              key=f"rule[{i}].target")
        try:
            rules.append(Rule(str(r["match"]), Target(r["target"])))
        except RecipeError as e:  # the rule's own message, with the file it is in
            raise RecipeError(f"recipe {name_or_path}: rule {i}: {e}", key=e.key) from None
    return Recipe(str(data.get("name", p.stem)), tuple(rules), str(data.get("description", "")),
                  hashlib.sha256(text.encode()).hexdigest())
