"""The model card of a build: rendered from ``model_cards/nvfp4.md`` through huggingface_hub's
``ModelCard`` / ``ModelCardData``, and validated against ``model_cards/metadata.toml`` before
anything is uploaded (FC-33: a bad card must stop the run before the first shard is sent).

Inputs are read from the build folder; ``model_cards/README.md`` documents the structures of
``eval/report.json`` (eval gate, issue 8) and ``plan.json`` (fit table, issue 4).
"""

import json
import re
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

import yaml

from eval.report import scope_text
from formats.manifest import MANIFEST_NAME, PROGRESS_NAME, has_ledger
from quantize.base.errors import CardError, OutputError
from quantize.base.redact import redact, unlocal

__all__ = ["CARDS", "TEMPLATE", "REPORT", "PLAN", "load_build", "read_gate", "render_card",
           "validate_card"]

CARDS = Path(__file__).resolve().parents[2] / "model_cards"
TEMPLATE = CARDS / "nvfp4.md"
REPORT = Path("eval") / "report.json"
PLAN = Path("plan.json")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_INDEX = re.compile(r"\.\d+(?=\.|$)")
_BECAME = {"nvfp4": "NVFP4 (e2m1, e4m3 block scale / 16, f32 global scale)",
           "bf16": "BF16 (dequantized from the source)", "keep": "kept as in the source"}


def _schema() -> dict:
    return tomllib.loads((CARDS / "metadata.toml").read_text())


def load_build(build: Path) -> dict:
    """The finished build's manifest, config, eval report and fit plan (None when absent).

    Raises:
        OutputError: no manifest (the build is not finished), a resume ledger still present,
            or a file the manifest lists is missing or has another size.
    """
    build = Path(build)
    if not (build / MANIFEST_NAME).is_file() or has_ledger(build):
        raise OutputError(f"{build} is not a finished build (no {MANIFEST_NAME}, or an "
                          f"unfinished {PROGRESS_NAME}); finish it with `quantize nvfp4 "
                          "--resume` first", key=MANIFEST_NAME)
    manifest = json.loads((build / MANIFEST_NAME).read_text())
    for rel, meta in manifest.get("files", {}).items():
        p = build / rel
        if not p.is_file() or p.stat().st_size != meta["bytes"]:
            raise OutputError(f"{rel} in {build} is missing or changed since the build "
                              f"(manifest: {meta['bytes']} bytes)", key=rel)
    report, plan = build / REPORT, build / PLAN
    return {"manifest": manifest,
            "config": json.loads((build / "config.json").read_text()),
            "report": json.loads(report.read_text()) if report.is_file() else None,
            "plan": json.loads(plan.read_text()) if plan.is_file() else None}


def read_gate(report: dict | None) -> tuple[bool, str]:
    """(release, verdict) from ``eval/report.json``'s ``gate``.

    ``release`` is True only for a gate that passed on a release-wide run (``gate.release``:
    finished, no ``--limit``, a baseline, the default suites); a missing report, a failed or
    unfinished run, and a partial one are not. ``verdict`` reads after "eval gate" ("passed",
    "failed: kl.mean_kl 8.99 (limit <= 0.35)", "incomplete: the evaluation did not finish
    (...)", "passed on a partial run, not a release gate
    (--limit 5: ...)", "not run: no eval report (eval/report.json)").
    """
    if report is None:
        return False, f"not run: no eval report ({REPORT})"
    gate = report.get("gate") or {}
    if gate.get("passed") is not True:
        why = gate.get("reason") or "no verdict"
        return False, why if why.startswith("incomplete") else f"failed: {why}"
    if gate.get("release") is True:
        return True, "passed"
    why = (report.get("scope") or {}).get("not_release") or ["the report records no release scope"]
    return False, f"passed on a partial run, not a release gate ({'; '.join(why)})"


def _sig(x):
    """A float at 4 significant digits (ints and the rest unchanged)."""
    return float(f"{x:.4g}") if isinstance(x, float) else x


def _recipe_rows(targets: dict[str, str]) -> list[dict]:
    """Group tensors by name with layer / expert indices replaced by ``*``."""
    groups: dict[str, Counter] = defaultdict(Counter)
    for name, target in targets.items():
        groups[_INDEX.sub(".*", name.removesuffix(".weight"))][target] += 1
    rows = []
    for group, count in groups.items():
        became = " / ".join(f"{_BECAME.get(t, t)}" + (f" ({n})" if len(count) > 1 else "")
                            for t, n in count.most_common())
        rows.append({"group": group, "became": became, "count": sum(count.values())})
    return rows


def _task_n(report: dict, task: str) -> str:
    n = ((report or {}).get("scope") or {}).get("n", {}).get(task)
    return f"{n['n']} {n['unit']}" if n else ""


def _eval_results(report: dict | None) -> list:
    from huggingface_hub import EvalResult

    out = []
    for task, metrics in sorted(((report or {}).get("results") or {}).items()):
        if not isinstance(metrics, dict):
            continue
        ds = metrics.get("dataset") or {}
        for metric, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            out.append(EvalResult(task_type="text-generation", task_name=task,
                                  dataset_type=ds.get("type", task), dataset_name=ds.get("name", task),
                                  dataset_config=ds.get("config"), dataset_split=ds.get("split"),
                                  metric_type=metric, metric_value=_sig(value)))
    return out


def render_card(build: Path, repo_id: str, *, base_model: str | None = None,
                license: str | None = None, forced: str | None = None, info: dict | None = None):
    """Render the card of ``build`` for ``repo_id`` (a ``huggingface_hub.ModelCard``).

    ``base_model`` / ``license`` override what the manifest (Hub source repo and its card's
    license, or the demo's) or the carried source ``README.md`` say. ``forced``: the gate
    verdict overridden by ``--force``, stated in the card. ``info``: ``load_build(build)``.
    """
    from huggingface_hub import ModelCard, ModelCardData, metadata_load

    build = Path(build)
    info = info or load_build(build)
    man, cfg = info["manifest"], info["config"]
    src = man.get("source", {})
    carried = metadata_load(build / "README.md") if (build / "README.md").is_file() else None
    carried = carried or {}
    base = base_model or src.get("repo") or src.get("base_model")
    lic = license or src.get("license") or carried.get("license")
    schema = _schema()
    opts = man.get("options", {})
    modelopt = opts.get("format") == "modelopt"
    # the layout tag names the build's own format (schema tags list compressed-tensors)
    tags = [("modelopt" if modelopt and t == "compressed-tensors" else t) for t in schema["tags"]]
    tags += [cfg["model_type"]] if cfg.get("model_type") else []
    extra = {k: src.get(k) or carried.get(k) for k in ("license_name", "license_link")
             if (src.get(k) or carried.get(k)) and not license}
    results = _eval_results(info["report"])
    if results:  # model_name only names the model-index entry
        extra.update(eval_results=results, model_name=repo_id.split("/")[-1])
    data = ModelCardData(base_model=base, license=lic, tags=tags, library_name="transformers",
                         pipeline_tag="text-generation", base_model_relation="quantized", **extra)
    _, verdict = read_gate(info["report"])
    summary = man.get("summary", {})
    files = man.get("files", {})
    plan = info["plan"] or {}
    fit = [r for r in plan.get("fit", []) if isinstance(r, dict)]
    source_files = src.get("files") or {}
    source_weights = sum(m.get("size") or 0 for f, m in source_files.items()
                         if f.endswith(".safetensors"))
    size_rows = [{"what": "source weights (tensor bytes)", "bytes": summary.get("bytes_in", 0)},
                 {"what": "this build: weights (tensor bytes)", "bytes": summary.get("bytes_out", 0)},
                 {"what": "this build: all files", "bytes": sum(m["bytes"] for m in files.values())}]
    if source_weights:
        size_rows.insert(1, {"what": "source safetensors files", "bytes": source_weights})
    for row in size_rows:
        row["human"] = (f"{row['bytes'] / 2**30:.2f} GiB" if row["bytes"] >= 2**30
                        else f"{row['bytes'] / 2**20:.1f} MiB")
    card = ModelCard.from_template(
        data, template_path=str(TEMPLATE),
        title=f"{repo_id.split('/')[-1]}", base_model=base or "unknown", repo_id=repo_id,
        tool_version=man.get("version", "?"), format_name=cfg.get("quantization_config", {}).get("format", "?"),
        modelopt=modelopt, w4a4=opts.get("scheme") == "w4a4",
        forced=forced, recipe=man.get("options", {}).get("recipe", "?"),
        recipe_sha256=man.get("options", {}).get("recipe_sha256", ""),
        scheme=man.get("options", {}).get("scheme", "?"),
        recipe_rows=_recipe_rows(man.get("targets", {})),
        ignore_count=len(summary.get("ignore", [])), notes=summary.get("notes", []),
        size_rows=size_rows, fit_rows=fit, fit_columns=list(fit[0]) if fit else [],
        gate_line=verdict if info["report"] is not None else None,
        gate_scope=scope_text(info["report"]["scope"]) if (info["report"] or {}).get("scope") else None,
        eval_rows=[{"task": r.task_name, "metric": r.metric_type, "value": r.metric_value,
                    "n": _task_n(info["report"], r.task_name)} for r in results],
        commit=src.get("commit"), layout=src.get("layout", "?"), source_note=src.get("demo"),
        source_files=bool(source_files),
        license=lic, license_given=bool(license))
    card.content = re.sub(r"\n{3,}", "\n\n", card.content)  # blank runs left by template tags
    card.content = unlocal(redact(card.content))  # no token nor local path reaches a published card
    return card


def _front_matter(text: str) -> dict:
    m = re.match(r"^---\r?\n(.*?)\r?\n---\r?\n", text, re.S)
    if not m:
        raise CardError("the card has no YAML front matter (--- ... ---)", key="metadata")
    try:
        meta = yaml.safe_load(m[1])
    except yaml.YAMLError as e:
        raise CardError(f"card metadata is not valid YAML: {e}", key="metadata") from None
    if not isinstance(meta, dict):
        raise CardError("card metadata is not a YAML mapping", key="metadata")
    return meta


def validate_card(text: str) -> dict:
    """Check a card's metadata locally; returns it as a dict.

    Checks (``model_cards/metadata.toml``): required keys present; ``license`` a Hub license
    identifier (``other`` with ``license_name`` and ``license_link``); ``base_model`` one or more
    Hub repo ids; ``base_model_relation`` allowed; ``tags`` a list of strings; ``model-index``
    parseable by huggingface_hub (a list of models with results, each with task, dataset and
    numeric metrics).

    Raises:
        CardError: listing every problem; ``key`` is the first offending field.
    """
    from huggingface_hub import ModelCardData

    meta = _front_matter(text)
    schema = _schema()
    problems: list[tuple[str, str]] = []
    for key in schema["required"]:
        if meta.get(key) in (None, "", []):
            problems.append((key, f"{key}: missing"))
    lic = meta.get("license")
    if lic is not None and lic not in schema["licenses"]:
        problems.append(("license", f"license: {lic!r} is not a Hub license identifier (see "
                                    "https://huggingface.co/docs/hub/repositories-licenses)"))
    if lic == "other" and not (meta.get("license_name") and meta.get("license_link")):
        problems.append(("license", "license: 'other' needs license_name and license_link"))
    base = meta.get("base_model")
    if base is not None:
        ids = base if isinstance(base, list) else [base]
        bad = [b for b in ids if not (isinstance(b, str) and _REPO_ID.match(b))]
        if bad:
            problems.append(("base_model", f"base_model: {bad[0]!r} is not a Hub repo id ORG/NAME"))
    rel = meta.get("base_model_relation")
    if rel is not None and rel not in schema["base_model_relations"]:
        problems.append(("base_model_relation", f"base_model_relation: {rel!r} is not one of "
                                                f"{schema['base_model_relations']}"))
    tags = meta.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) and t for t in tags)):
        problems.append(("tags", "tags: must be a list of strings"))
    if "model-index" in meta:
        mi = meta["model-index"]
        try:
            if not isinstance(mi, list) or not mi:
                raise TypeError("must be a non-empty list of models")
            ModelCardData(**{"model-index": mi})
            for model in mi:
                for r in model["results"]:
                    for m in r["metrics"]:
                        if isinstance(m["value"], bool) or not isinstance(m["value"], int | float):
                            raise TypeError(f"metric {m.get('type')} value {m['value']!r} is not a number")
        except (TypeError, KeyError, ValueError) as e:
            problems.append(("model-index", f"model-index: invalid ({e})"))
    if problems:
        raise CardError("model card metadata is invalid:\n  " + "\n  ".join(p for _, p in problems),
                        key=problems[0][0])
    return meta
