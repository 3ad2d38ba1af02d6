"""The release gate: suite results against the versioned thresholds in ``eval/thresholds``.

Every check is a record ``{"name", "value", "op", "limit", "passed", "severity", "by",
"detail"}``: ``value op limit`` must hold; ``by`` is how far past the limit a failed value
is (positive, in the value's unit). A check of severity ``fail`` that does not pass fails
the gate; ``warn`` is reported only.

With ``--limit`` a check may rest on too few samples to decide (:func:`too_few_samples`): when
one sample moves its value by more than its bound, a single sample would pass or fail it, so
the check is reported with severity ``not gated`` and does not count (``gate_passed``).

A gate that passed is a *release* gate only when its run covered what a release claims
(:func:`release_scope`): it finished, every problem was scored (no ``--limit``), a baseline
was compared, and the default suites ran. ``quantize upload`` refuses anything else
without ``--force``.
"""

import hashlib
import tomllib
from pathlib import Path

__all__ = ["DEFAULT_THRESHOLDS", "NOT_GATED", "RELEASE_SUITES", "load_thresholds", "gate_checks",
           "gate_passed", "release_scope", "skipped_without_baseline", "degenerate_text", "too_few_samples"]

DEFAULT_THRESHOLDS = Path(__file__).with_name("thresholds") / "v1.toml"
SEVERITIES = ("fail", "warn")
NOT_GATED = "not gated"
"""Severity of a ``fail`` check that a ``--limit`` run has too few samples to decide."""
RELEASE_SUITES = {"in-process": ("kl", "gsm8k", "passkey"), "endpoint": ("gsm8k", "passkey")}
"""Suites a release gate must have run, by how the build was reached (``kl`` needs logits)."""


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def load_thresholds(path: str | Path | None = None) -> dict:
    """Parse and check a thresholds TOML; adds ``_file``, ``_sha256`` and ``_defaulted``.

    Every section and key must be one that ``v1.toml`` has, with a value of the same kind
    (a number for bounds, ``"fail"`` / ``"warn"`` for ``*severity``). A key the file leaves
    out takes v1's value; those keys are listed in ``_defaulted`` (``"kl.max_mean_kl"``) and
    recorded in the report, so a partial file is a stated override, never a crash after the
    run.

    Raises:
        ValueError: the file is missing or not valid TOML, has no integer ``version``, or a
            section / key is unknown or of the wrong type (the message names file and key).
    """
    p = Path(path) if path else DEFAULT_THRESHOLDS
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"thresholds file {p}: cannot read it ({e.strerror or e})") from None
    try:
        t = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"thresholds file {p}: not valid TOML ({e})") from None
    if not isinstance(t.get("version"), int) or isinstance(t.get("version"), bool):
        raise ValueError(f"thresholds file {p}: needs an integer 'version'")
    defaulted = []
    if p.resolve() != DEFAULT_THRESHOLDS.resolve():
        ref = load_thresholds()
        for sec in t:
            if sec != "version" and sec not in ref:
                raise ValueError(f"thresholds file {p}: unknown section [{sec}] (known: "
                                 f"{', '.join(k for k in ref if k != 'version' and not k.startswith('_'))})")
        for sec, keys in ref.items():
            if sec == "version" or sec.startswith("_"):
                continue
            got = t.setdefault(sec, {})
            if not isinstance(got, dict):
                raise ValueError(f"thresholds file {p}: '{sec}' must be a table [{sec}]")
            for key in got:
                if key not in keys:
                    raise ValueError(f"thresholds file {p}: unknown key {sec}.{key} (known: "
                                     f"{', '.join(keys)})")
            for key, default in keys.items():
                if key not in got:
                    got[key] = default
                    defaulted.append(f"{sec}.{key}")
                elif _kind(got[key]) != _kind(default):
                    raise ValueError(f"thresholds file {p}: {sec}.{key} must be a {_kind(default)}, "
                                     f"got {got[key]!r}")
    for sec, keys in t.items():
        for key, value in (keys.items() if isinstance(keys, dict) else ()):
            if key.endswith("severity") and value not in SEVERITIES:
                raise ValueError(f"thresholds file {p}: {sec}.{key} must be 'fail' or 'warn', "
                                 f"got {value!r}")
    t["_file"], t["_sha256"], t["_defaulted"] = str(p), hashlib.sha256(raw).hexdigest(), defaulted
    return t


def degenerate_text(d: dict) -> str:
    """``3 of 9 completions degenerate (repeat 2, control 1)`` for a degenerate summary."""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(d["reasons"].items()))
    return f"{d['degenerate']} of {d['n']} completions degenerate" + (f" ({reasons})" if reasons else "")


def _check(name, value, op, limit, severity, detail=""):
    ok = value <= limit if op == "<=" else value >= limit
    by = 0.0 if ok else abs(value - limit)
    return {"name": name, "value": value, "op": op, "limit": limit, "passed": bool(ok),
            "severity": severity, "by": by, "detail": detail}


def too_few_samples(n: int, bound: float, limit: int | None, unit: str = "samples") -> str | None:
    """Why a ``--limit`` run cannot decide a check of ``n`` samples against ``bound``, or None.

    One sample moves a rate or an accuracy over ``n`` samples by ``1 / n``. When that step is
    larger than the check's bound (the threshold file's: ``min_drop`` for a paired drop,
    whose own allowance grows with the noise, ``max_mean_drop``, ``max_rate``...), a single
    sample decides the check, so it is not gated. A run without ``limit`` is always gated (its
    sets are the whole sets). Returns e.g. ``"--limit 2: too few samples (5 prompts: one moves
    the value by 0.2, more than its bound 0.1)"``."""
    if limit is None or n <= 0 or 1 / n <= bound:
        return None
    return (f"--limit {limit}: too few samples ({n} {unit}: one moves the value by {1 / n:.3g}, more "
            f"than its bound {bound:g})")


def _decide(check: dict, n: int, bound: float, limit: int | None, unit: str) -> dict:
    """``check`` as gated, or, when :func:`too_few_samples` says so for a ``fail`` check,
    with severity :data:`NOT_GATED` and the reason in ``not_gated``."""
    why = too_few_samples(n, bound, limit, unit) if check["severity"] == "fail" else None
    if why:
        check["severity"], check["not_gated"] = NOT_GATED, why
    return check


def _passkey_n(summary: dict) -> int:
    """Prompts behind a passkey grid summary (``eval.passkey.grid_summary``)."""
    return len(summary["lengths"]) * len(summary["depths"]) * summary["trials"]


def _drop_check(name, paired, z, min_drop, severity):
    """Build accuracy may fall below baseline by at most max(min_drop, z * paired se)."""
    allowed = max(min_drop, z * paired["se"])
    return _check(name, -paired["delta"], "<=", allowed, severity,
                  f"baseline {paired['base_acc']:.4f} -> build {paired['test_acc']:.4f} on "
                  f"n={paired['n']} (paired se {paired['se']:.4f}, allowed drop "
                  f"max({min_drop}, {z} x se))")


def _garbage_checks(prefix: str, d: dict, td: dict, limit: int | None = None) -> list[dict]:
    """Broken-output checks of one degenerate summary (:func:`eval.degenerate.degenerate_summary`):
    ``degenerate.rate``, ``degenerate.empty.rate``, ``degenerate.same.rate``, all of
    ``[degenerate] severity`` (each decided over ``d["n"]`` completions, :func:`_decide`)."""
    out = [_check(f"{prefix}degenerate.rate", d["rate"], "<=", td["max_rate"], td["severity"],
                  degenerate_text(d))]
    if "empty_rate" in d:
        out.append(_check(f"{prefix}degenerate.empty.rate", d["empty_rate"], "<=", td["max_empty_rate"],
                          td["severity"], f"{d['empty']} of {d['n']} completions empty"))
    if "same_rate" in d:
        same = d["same"]
        out.append(_check(f"{prefix}degenerate.same.rate", d["same_rate"], "<=", td["max_same_rate"],
                          td["severity"],
                          f"{same['prompts']} different prompts of {d['n']} got the same completion "
                          f"{same['text']!r}" if same["prompts"] >= 2 else
                          f"no two different prompts of {d['n']} got the same completion"))
    return [_decide(c, d["n"], c["limit"], limit, "completions") for c in out]


def gate_checks(suites: dict, t: dict, limit: int | None = None) -> list[dict]:
    """Checks for whatever ``suites`` holds (see :func:`eval.suite.run_eval` for the layout).

    ``limit``: the run's ``--limit``; a ``fail`` check with too few samples to decide is then
    of severity :data:`NOT_GATED` (:func:`too_few_samples`; KL rests on ``--kl-tokens``, not
    on the limit, and is always gated)."""
    checks = []
    kl = suites.get("kl")
    if kl:
        s = t["kl"]["severity"]
        checks.append(_check("kl.mean_kl", kl["mean_kl"], "<=", t["kl"]["max_mean_kl"], s,
                             f"{kl['tokens']} tokens, nats/token"))
        checks.append(_check("kl.top1_agree", kl["top1_agree"], ">=", t["kl"]["min_top1_agree"], s))
        checks.append(_check("kl.ppl_ratio", kl["ppl_test"] / kl["ppl_ref"], "<=",
                             t["kl"]["max_ppl_ratio"], s,
                             f"perplexity {kl['ppl_ref']:.3f} -> {kl['ppl_test']:.3f}"))
    g = suites.get("gsm8k", {}).get("paired")
    if g:
        tg = t["gsm8k"]
        for f in ("flexible-extract", "strict-match"):
            sev = tg["flexible_severity" if f == "flexible-extract" else "strict_severity"]
            checks.append(_decide(_drop_check(f"gsm8k.{f}.drop", g[f], tg["z"], tg["min_drop"], sev),
                                  g[f]["n"], tg["min_drop"], limit, "problems"))
    m = suites.get("mc", {}).get("paired")
    if m:
        checks.append(_decide(_drop_check("mc.acc.drop", m, t["mc"]["z"], t["mc"]["min_drop"],
                                          t["mc"]["severity"]), m["n"], t["mc"]["min_drop"], limit, "problems"))
    pk = suites.get("passkey")
    if pk and pk.get("baseline"):
        checks.append(_decide(_check("passkey.mean.drop", pk["baseline"]["mean"] - pk["build"]["mean"], "<=",
                                     t["passkey"]["max_mean_drop"], t["passkey"]["severity"],
                                     f"largest length at 100 % over all depths: "
                                     f"{pk['baseline']['max_length_all_depths_100']} -> "
                                     f"{pk['build']['max_length_all_depths_100']}"),
                              _passkey_n(pk["build"]), t["passkey"]["max_mean_drop"], limit, "prompts"))
    kv = suites.get("kv_parity", {}).get("dtypes", {})
    tk, tg, td = t["kv_parity"], t["gsm8k"], t["degenerate"]
    for d in ("fp8", "nvfp4"):
        r = kv.get(d)
        if not r:
            continue
        sev = tk[f"{d}_severity"]
        kls = []
        if "kl" in r:
            kls.append(r["kl"]["mean_kl"])
            checks.append(_check(f"kv_parity.{d}.mean_kl", r["kl"]["mean_kl"], "<=",
                                 tk[f"{d}_max_mean_kl"], sev,
                                 f"vs the same build with bf16 KV; scales {r['scales']}"))
        for b in r.get("kl_by_length", []):  # each context length on its own tokens
            kls.append(b["mean_kl"])
            checks.append(_check(f"kv_parity.{d}.kl@{b['length']}", b["mean_kl"], "<=",
                                 tk[f"{d}_max_mean_kl"], sev,
                                 f"context {b['from']}..{b['length']} tokens ({b['tokens']} predictions), "
                                 f"top-1 {b['top1_agree']:.3f}, vs bf16 KV"))
        if kls:
            checks.append(_check(f"kv_parity.{d}.collapse", max(kls), "<=", tk["collapse_max_kl"],
                                 tk["collapse_severity"],
                                 f"largest KL vs bf16 KV over the mean and every context length; "
                                 f"{d}_severity does not soften it"))
        base_pk = kv.get("bf16", {}).get("passkey")
        if "passkey" in r and base_pk:
            n_pk = _passkey_n(r["passkey"]) if "depths" in r["passkey"] else 0
            checks.append(_decide(_check(f"kv_parity.{d}.passkey.drop", base_pk["mean"] - r["passkey"]["mean"],
                                         "<=", tk["max_passkey_drop"], sev),
                                  n_pk, tk["max_passkey_drop"], limit, "prompts"))
            for L, b_acc, acc in zip(r["passkey"]["lengths"], base_pk.get("length_mean", []),
                                     r["passkey"].get("length_mean", [])):
                checks.append(_decide(_check(f"kv_parity.{d}.passkey.drop@{L}", b_acc - acc, "<=",
                                             tk["max_passkey_drop"], sev,
                                             f"mean over depths at {L} tokens: bf16 KV {b_acc:.3f} -> {d} {acc:.3f}"),
                                      n_pk // max(1, len(r["passkey"]["lengths"])), tk["max_passkey_drop"],
                                      limit, "prompts"))
        gp = r.get("gsm8k_paired")
        if gp:
            checks.append(_decide(_drop_check(f"kv_parity.{d}.gsm8k.flexible-extract.drop", gp["flexible-extract"],
                                              tg["z"], tg["min_drop"], sev),
                                  gp["flexible-extract"]["n"], tg["min_drop"], limit, "problems"))
            checks.append(_decide(_drop_check(f"kv_parity.{d}.gsm8k.strict-match.drop", gp["strict-match"],
                                              tg["z"], tg["min_drop"], tg["strict_severity"]),
                                  gp["strict-match"]["n"], tg["min_drop"], limit, "problems"))
    for d, r in kv.items():  # broken output fails whatever the dtype's severity
        if r.get("degenerate", {}).get("n"):
            checks += _garbage_checks(f"kv_parity.{d}.", r["degenerate"], td, limit)
    dg = suites.get("degenerate")
    if dg and dg["build"]["n"]:
        checks += _garbage_checks("", dg["build"], td, limit)
        if dg.get("baseline") and dg["baseline"]["n"]:
            checks.append(_decide(_check("degenerate.increase", dg["build"]["rate"] - dg["baseline"]["rate"],
                                         "<=", td["max_increase"], td["severity"],
                                         f"baseline rate {dg['baseline']['rate']:.3f}"),
                                  min(dg["build"]["n"], dg["baseline"]["n"]), td["max_increase"], limit,
                                  "completions"))
    return checks


def gate_passed(checks: list[dict]) -> bool:
    """True when no ``fail``-severity check failed (a :data:`NOT_GATED` one does not count)."""
    return all(c["passed"] for c in checks if c["severity"] == "fail")


_NEEDS_BASELINE = {"kl": ["kl.*"], "gsm8k": ["gsm8k.flexible-extract.drop", "gsm8k.strict-match.drop"],
                   "mc": ["mc.acc.drop"], "passkey": ["passkey.mean.drop"],
                   "degenerate": ["degenerate.increase"]}


def skipped_without_baseline(suites: dict) -> list[str]:
    """Checks a run without a baseline could not make, for the suites in ``suites``."""
    return [c for s, names in _NEEDS_BASELINE.items() if s in suites for c in names]


def release_scope(requested: list[str], done: list[str], limit: int | None, baseline: str | None,
                  backend: str) -> dict:
    """Whether a run is wide enough for its gate to stand for a release.

    Args:
        requested: suites asked for; done: suites finished (``kv-parity`` spelled so).
        limit: ``--limit`` (None = every problem). baseline: what the build was compared to.
        backend: ``"in-process"`` or ``"endpoint"`` (picks :data:`RELEASE_SUITES`).

    Returns:
        ``{"release": bool, "not_release": [why, ...]}``; ``release`` is True when
        ``not_release`` is empty.
    """
    why = []
    if limit is not None:
        why.append(f"--limit {limit}: only the first {limit} problems of each set were scored")
    if baseline is None:
        why.append("no baseline: no accuracy drop could be measured")
    missing = [s for s in RELEASE_SUITES[backend] if s not in requested]
    if missing:
        why.append(f"suite(s) {', '.join(missing)} not run (a release gate runs "
                   f"{', '.join(RELEASE_SUITES[backend])})")
    left = [s for s in requested if s not in done]
    if left:
        why.append(f"the evaluation did not finish ({', '.join(left)} not done)")
    return {"release": not why, "not_release": why}
