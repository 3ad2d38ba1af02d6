"""Keep access tokens out of everything spark-quant writes or prints.

Used wherever we write text a user may share: the console (``quantize.cli`` wraps stdout
and stderr, which covers logging, progress bars and error messages), the build manifest
(``formats.manifest.write_manifest``), verify / pre-flight reports, and model cards
(render the card, then pass it through :func:`redact` before writing it).

What is masked: the values of the token environment variables huggingface_hub reads
(``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN``), any value registered with
:func:`register_secret` (a token passed on the command line), anything shaped like a
Hugging Face token (``hf_`` + 20 or more letters/digits), ``Bearer`` credentials and the
password part of ``scheme://user:password@host`` URLs.
"""

import io
import os
import re

__all__ = ["MASK", "TOKEN_ENV_VARS", "register_secret", "redact", "redact_obj",
           "RedactingStream", "unlocal", "unlocal_obj"]

MASK = "***"
TOKEN_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
_MIN_SECRET = 8  # shorter values would mask ordinary words
_registered: set[str] = set()
_PATTERNS = (
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), MASK),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1" + MASK),
    (re.compile(r"(://[^/\s:@]+:)[^@\s/]+@"), r"\1" + MASK + "@"),
)


def register_secret(value: str | None) -> None:
    """Mask ``value`` (e.g. a ``--token`` argument) in everything redacted from now on."""
    if value and len(value) >= _MIN_SECRET:
        _registered.add(value)


def _secrets() -> list[str]:
    env = [os.environ.get(v) for v in TOKEN_ENV_VARS]
    found = {s for s in env if s and len(s) >= _MIN_SECRET} | _registered
    return sorted(found, key=len, reverse=True)  # longest first: no partial leftovers


def redact(text: str) -> str:
    """``text`` with every known secret and token-shaped string replaced by ``***``."""
    for s in _secrets():
        text = text.replace(s, MASK)
    for pat, repl in _PATTERNS:
        text = pat.sub(repl, text)
    return text


def _map_strings(obj, fn):
    """A copy of a JSON-like object (dict / list / str / numbers) with ``fn`` applied to every
    string, keys included."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_map_strings(v, fn) for v in obj]
    return obj


def redact_obj(obj):
    """A copy of a JSON-like object (dict / list / str / numbers) with :func:`redact` applied
    to every string, keys included."""
    return _map_strings(obj, redact)


# An absolute POSIX path: a "/" that no word, dot, colon, slash or dash precedes (so never a
# URL, a repo id ``org/name``, a relative ``../x`` or a ratio ``K/TP``), then its components.
_ABS_PATH = re.compile(r"(?<![\w.:/~-])(?:/[^\s/'\"`()\[\]{},;|<>]+)+/?")


def unlocal(text: str) -> str:
    """``text`` with every absolute local path replaced by its last component (``/home/u/x/y``
    -> ``y``; ``/`` alone stays). For files that are published (manifest, model card, eval
    report, ``plan.json``), which name sources by repo id and folder name, never by where
    they lie on one machine (the console keeps full paths)."""
    def name(m: re.Match) -> str:
        parts = [p for p in m[0].split("/") if p]
        return parts[-1] if parts else m[0]

    return _ABS_PATH.sub(name, text)


def unlocal_obj(obj):
    """A copy of a JSON-like object with :func:`unlocal` applied to every string, keys included."""
    return _map_strings(obj, unlocal)


class RedactingStream(io.TextIOBase):
    """A text stream that redacts each write before passing it on to ``inner``.

    Each ``write`` call is redacted on its own; callers that print a token split over two
    writes are not covered (print, logging and tqdm write whole strings).
    """

    def __init__(self, inner):
        self.inner = inner

    def write(self, s: str) -> int:
        self.inner.write(redact(s))
        return len(s)

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self):
        return getattr(self.inner, "encoding", "utf-8")
