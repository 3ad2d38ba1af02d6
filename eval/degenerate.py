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

Two failures of a whole set of completions are counted beside the per-text reasons
(:func:`degenerate_summary`), each gated on its own (docs/eval.md §7):

- ``empty``: the completion is empty after stripping whitespace (the model stopped at once,
  or emitted only its end-of-text marker);
- ``same``: one non-empty completion given to several *different* prompts (a model whose
  output no longer depends on its input: "!!!!" is caught above, a fluent constant reply
  such as "I cannot answer." only here). Its share is the count of the most common such
  completion over all completions.
"""

import unicodedata

__all__ = ["MAX_PERIOD", "MIN_RUN", "degenerate_reason", "degenerate_summary", "same_completion"]

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


def same_completion(texts: list[str], prompts: list[str] | None = None) -> dict:
    """The non-empty completion (stripped) given to the most different prompts.

    Args:
        texts: one completion per request. prompts: the request each came from (any
            hashable id, e.g. the prompt text); None = every completion answers its own
            prompt. Completions of one and the same prompt count once.

    Returns:
        ``{"text": str (cut to 80 characters) or None, "prompts": int}``: how many different
        prompts got that completion (0 when every completion is empty, 1 when no two
        different prompts share one); of equal counts, the completion seen first.
    """
    seen: dict[str, set] = {}
    for i, t in enumerate(texts):
        t = t.strip()
        if t:
            seen.setdefault(t, set()).add(prompts[i] if prompts is not None else i)
    if not seen:
        return {"text": None, "prompts": 0}
    text = max(seen, key=lambda k: len(seen[k]))  # ties: the first seen
    return {"text": text[:80], "prompts": len(seen[text])}


def degenerate_summary(texts: list[str], examples: int = 3, prompts: list[str] | None = None) -> dict:
    """Rate of degenerate completions with counts per reason and a few examples, the empty
    completions and the completion most shared between different prompts.

    Args:
        texts: completions. examples: how many degenerate ones to keep.
        prompts: the request of each completion (see :func:`same_completion`).

    Returns:
        ``{"n", "degenerate", "rate", "reasons": {reason: count}, "examples": [str],
        "empty", "empty_rate", "same": {"text", "prompts"}, "same_rate"}`` (examples cut to
        80 characters; rates are shares of ``n``, 0.0 for no text; ``same_rate`` counts only a
        completion shared by 2 or more different prompts, else 0.0).

    Raises:
        ValueError: ``prompts`` is not one per text.
    """
    if prompts is not None and len(prompts) != len(texts):
        raise ValueError(f"degenerate_summary: {len(prompts)} prompt ids for {len(texts)} completions")
    reasons: dict[str, int] = {}
    ex = []
    for t in texts:
        r = degenerate_reason(t)
        if r:
            reasons[r] = reasons.get(r, 0) + 1
            if len(ex) < examples:
                ex.append(t.strip()[:80])
    bad = sum(reasons.values())
    n = len(texts)
    empty = sum(1 for t in texts if not t.strip())
    same = same_completion(texts, prompts)
    shared = same["prompts"] if same["prompts"] >= 2 else 0
    return {"n": n, "degenerate": bad, "rate": bad / n if n else 0.0,
            "reasons": reasons, "examples": ex, "empty": empty, "empty_rate": empty / n if n else 0.0,
            "same": same, "same_rate": shared / n if n else 0.0}
