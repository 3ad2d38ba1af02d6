"""Degenerate-output detector: the quiet failures a score can hide.

Broken NVFP4 builds load and then emit byte soup; fp8 KV with bad scales or NVFP4 KV emit
"!!!!" (docs/eval.md §7). A completion is degenerate when, after stripping
surrounding whitespace, it is non-empty and

- ``repeat``: it ends in one short unit (1..:data:`MAX_PERIOD` characters, not all
  whitespace) repeated back to back over at least :data:`MIN_RUN` characters and at least
  half of the text ("!!!!!!!!", "the the the the", "1111");
- ``invalid-utf8``: it holds a run of 3 or more U+FFFD replacement characters (the
  tokenizer decoded bytes that are not UTF-8), or they make up 5 % or more of it;
- ``control``: 10 % or more of its characters are control / unassigned / private-use code
  points (Unicode category C) other than tab, newline and carriage return.

Sentence-level loops of ordinary text ("The answer is 18. The answer is 18.") are not
flagged: small models do that at their best.
"""

import unicodedata

__all__ = ["MAX_PERIOD", "MIN_RUN", "degenerate_reason", "degenerate_summary"]

MAX_PERIOD = 8
MIN_RUN = 16


def _tail_run(text: str, period: int) -> int:
    """Length of the longest suffix of ``text`` that is periodic with ``period``."""
    n = len(text)
    i = n - period - 1
    while i >= 0 and text[i] == text[i + period]:
        i -= 1
    return n - (i + 1)


def degenerate_reason(text: str) -> str | None:
    """Why ``text`` is degenerate (``"repeat"``, ``"invalid-utf8"``, ``"control"``), or None."""
    t = text.strip()
    if not t:
        return None
    if "\ufffd" * 3 in t or t.count("\ufffd") >= 0.05 * len(t):
        return "invalid-utf8"
    ctrl = sum(1 for c in t if c not in "\t\n\r" and unicodedata.category(c)[0] == "C")
    if ctrl >= 0.1 * len(t):
        return "control"
    for p in range(1, MAX_PERIOD + 1):
        if t[-p:].isspace():
            continue
        run = _tail_run(t, p)
        if run >= max(MIN_RUN, 2 * p) and run >= 0.5 * len(t):
            return "repeat"
    return None


def degenerate_summary(texts: list[str], examples: int = 3) -> dict:
    """Rate of degenerate completions with counts per reason and a few examples.

    Returns:
        ``{"n", "degenerate", "rate", "reasons": {reason: count}, "examples": [str]}``
        (examples cut to 80 characters).
    """
    reasons: dict[str, int] = {}
    ex = []
    for t in texts:
        r = degenerate_reason(t)
        if r:
            reasons[r] = reasons.get(r, 0) + 1
            if len(ex) < examples:
                ex.append(t.strip()[:80])
    bad = sum(reasons.values())
    return {"n": len(texts), "degenerate": bad, "rate": bad / len(texts) if texts else 0.0,
            "reasons": reasons, "examples": ex}
