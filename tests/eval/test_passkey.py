"""Passkey prompts, scoring and the grid summary."""

import pytest
from transformers import AutoTokenizer

from eval.passkey import (
    QUESTION,
    TASK,
    grid_summary,
    heatmap_png,
    make_prompts,
    prompts_sha256,
    score,
)


@pytest.fixture(scope="module")
def tok(demo_src):
    return AutoTokenizer.from_pretrained(demo_src)


def test_prompts_sized_and_needle_at_depth(tok):
    ps = make_prompts(tok, [200, 600], [0, 50, 100], 2)
    assert [(p["length"], p["depth"], p["trial"]) for p in ps][:3] == [(200, 0, 0), (200, 0, 1), (200, 50, 0)]
    for p in ps:
        assert p["length"] - 24 <= p["tokens"] <= p["length"], p["tokens"]
        assert p["prompt"].startswith(TASK) and p["prompt"].endswith(QUESTION)
        assert p["prompt"].count(str(p["key"])) == 2 and 10000 <= p["key"] <= 99999
    first, last = ps[0]["prompt"], ps[4]["prompt"]
    assert first[len(TASK):].startswith(f"The pass key is {ps[0]['key']}.")  # depth 0
    assert last[: -len(QUESTION)].endswith(f"{ps[4]['key']} is the pass key. ")  # depth 100
    mid = ps[2]["prompt"]
    pos = mid.index("The pass key is") / len(mid)
    assert 0.35 < pos < 0.65
    # identical prompts for identical settings (baseline and build see the same grid)
    again = make_prompts(tok, [200, 600], [0, 50, 100], 2)
    assert prompts_sha256(again) == prompts_sha256(ps)
    assert len({p["key"] for p in ps}) == len(ps)
    essays = make_prompts(tok, [300], [50], 1, filler="essays")
    assert "The grass is green" not in essays[0]["prompt"] and 276 <= essays[0]["tokens"] <= 300
    with pytest.raises(ValueError, match="too short"):
        make_prompts(tok, [40], [0], 1)
    with pytest.raises(ValueError, match="depth"):
        make_prompts(tok, [200], [120], 1)


def test_score_first_integer():
    assert score(" 48213. The pass key is", 48213) == 1
    assert score(" 4821", 48213) == 0
    assert score(" is 48213", 48213) == 1
    assert score("!!!!", 48213) == 0


def test_grid_summary_and_heatmap(tmp_path):
    recs = [{"length": L, "depth": d, "tokens": L - 3, "correct": c}
            for L, d, c in [(1024, 0, 1), (1024, 50, 1), (1024, 100, 1), (2048, 0, 1), (2048, 50, 1),
                            (2048, 100, 1), (4096, 0, 1), (4096, 50, 0), (4096, 100, 1)]]
    recs += [{**recs[-2], "correct": 1}]  # a second trial in (4096, 50)
    s = grid_summary(recs)
    assert s["lengths"] == [1024, 2048, 4096] and s["depths"] == [0, 50, 100]
    assert s["grid"][2] == [1.0, 0.5, 1.0]
    assert s["max_length_all_depths_100"] == 2048
    assert s["worst_cell"] == {"acc": 0.5, "length": 4096, "depth": 50}
    assert s["mean"] == pytest.approx(8.5 / 9)
    assert s["mean_tokens"] == [1021, 2045, 4093]
    heatmap_png(s, tmp_path / "h.png", "test")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
