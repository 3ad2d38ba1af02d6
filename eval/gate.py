"""The release gate: suite results against the versioned thresholds in ``eval/thresholds``.

Every check is a record ``{"name", "value", "op", "limit", "passed", "severity", "by",
"detail"}``: ``value op limit`` must hold; ``by`` is how far past the limit a failed value
is (positive, in the value's unit). A check of severity ``fail`` that does not pass fails
the gate; ``warn`` is reported only.
"""

import hashlib
import tomllib
from pathlib import Path

__all__ = ["DEFAULT_THRESHOLDS", "load_thresholds", "gate_checks", "gate_passed"]

DEFAULT_THRESHOLDS = Path(__file__).with_name("thresholds") / "v1.toml"


def load_thresholds(path: str | Path | None = None) -> dict:
    """Parse a thresholds TOML; adds ``_file`` and ``_sha256`` for the report.

    Raises:
        ValueError: no integer ``version`` key.
    """
    p = Path(path) if path else DEFAULT_THRESHOLDS
    raw = p.read_bytes()
    t = tomllib.loads(raw.decode("utf-8"))
    if not isinstance(t.get("version"), int):
        raise ValueError(f"{p}: thresholds file needs an integer 'version'")
    t["_file"], t["_sha256"] = str(p), hashlib.sha256(raw).hexdigest()
    return t


def _check(name, value, op, limit, severity, detail=""):
    ok = value <= limit if op == "<=" else value >= limit
    by = 0.0 if ok else abs(value - limit)
    return {"name": name, "value": value, "op": op, "limit": limit, "passed": bool(ok),
            "severity": severity, "by": by, "detail": detail}


def _drop_check(name, paired, z, min_drop, severity):
    """Build accuracy may fall below baseline by at most max(min_drop, z * paired se)."""
    allowed = max(min_drop, z * paired["se"])
    return _check(name, -paired["delta"], "<=", allowed, severity,
                  f"baseline {paired['base_acc']:.4f} -> build {paired['test_acc']:.4f} on "
                  f"n={paired['n']} (paired se {paired['se']:.4f}, allowed drop "
                  f"max({min_drop}, {z} x se))")


def gate_checks(suites: dict, t: dict) -> list[dict]:
    """Checks for whatever ``suites`` holds (see :func:`eval.suite.run_eval` for the layout)."""
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
        checks.append(_drop_check("gsm8k.flexible-extract.drop", g["flexible-extract"], tg["z"],
                                  tg["min_drop"], tg["flexible_severity"]))
        checks.append(_drop_check("gsm8k.strict-match.drop", g["strict-match"], tg["z"],
                                  tg["min_drop"], tg["strict_severity"]))
    m = suites.get("mc", {}).get("paired")
    if m:
        checks.append(_drop_check("mc.acc.drop", m, t["mc"]["z"], t["mc"]["min_drop"],
                                  t["mc"]["severity"]))
    pk = suites.get("passkey")
    if pk and pk.get("baseline"):
        checks.append(_check("passkey.mean.drop", pk["baseline"]["mean"] - pk["build"]["mean"], "<=",
                             t["passkey"]["max_mean_drop"], t["passkey"]["severity"],
                             f"largest length at 100 % over all depths: "
                             f"{pk['baseline']['max_length_all_depths_100']} -> "
                             f"{pk['build']['max_length_all_depths_100']}"))
    kv = suites.get("kv_parity", {}).get("dtypes", {})
    tk = t["kv_parity"]
    for d in ("fp8", "nvfp4"):
        r = kv.get(d)
        if not r:
            continue
        if "kl" in r:
            checks.append(_check(f"kv_parity.{d}.mean_kl", r["kl"]["mean_kl"], "<=",
                                 tk[f"{d}_max_mean_kl"], tk[f"{d}_severity"],
                                 f"vs the same build with bf16 KV; scales {r['scales']}"))
        if "degenerate" in r:
            checks.append(_check(f"kv_parity.{d}.degenerate.rate", r["degenerate"]["rate"], "<=",
                                 t["degenerate"]["max_rate"], tk[f"{d}_severity"],
                                 f"{r['degenerate']['degenerate']}/{r['degenerate']['n']} completions "
                                 f"{r['degenerate']['reasons']}"))
        if "passkey" in r and "passkey" in kv.get("bf16", {}):
            checks.append(_check(f"kv_parity.{d}.passkey.drop",
                                 kv["bf16"]["passkey"]["mean"] - r["passkey"]["mean"], "<=",
                                 tk["max_passkey_drop"], tk[f"{d}_severity"]))
    dg = suites.get("degenerate")
    if dg and dg["build"]["n"]:
        td = t["degenerate"]
        checks.append(_check("degenerate.rate", dg["build"]["rate"], "<=", td["max_rate"],
                             td["severity"], f"{dg['build']['degenerate']}/{dg['build']['n']} "
                             f"completions {dg['build']['reasons']}"))
        if dg.get("baseline") and dg["baseline"]["n"]:
            checks.append(_check("degenerate.increase", dg["build"]["rate"] - dg["baseline"]["rate"],
                                 "<=", td["max_increase"], td["severity"],
                                 f"baseline rate {dg['baseline']['rate']:.3f}"))
    return checks


def gate_passed(checks: list[dict]) -> bool:
    """True when no ``fail``-severity check failed."""
    return all(c["passed"] for c in checks if c["severity"] == "fail")
