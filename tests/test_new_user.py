"""The first hour of a new user (issue 19): what each refused or misused command prints, and
its exit code. Every test runs the ``quantize`` command (``quantize.cli.main``)."""

import pytest

from formats.engines import mixed_moe_schemes
from quantize.cli import main


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---- item 4: the routed-expert scheme rule of `quantize check`, applied to the plan ----------

MOE_TP3 = (
    "error: recipe weight-only at TP=3 mixes ['nvfp4', 'unquantized'] in the routed experts of "
    "model.language_model.layers.1.mlp.experts (and 3 more MoE layer(s)): "
    "model.language_model.layers.1.mlp.experts.0.down_proj.weight -> bf16 (K=64 does not split "
    "over TP=3); engines load one scheme per MoE layer, so this build would fail its final "
    "check: choose a --tp that every expert projection splits over, or a recipe that gives "
    "these experts one target\n")


def test_mixed_moe_schemes_rule():
    assert mixed_moe_schemes({
        "m.layers.1.mlp.experts.0.gate_proj": "nvfp4",
        "m.layers.1.mlp.experts.0.down_proj": "unquantized",
        "m.layers.2.mlp.experts.0.gate_proj": "nvfp4",
        "m.layers.2.mlp.experts.1.down_proj": "nvfp4",
        "m.layers.2.mlp.shared_experts.down_proj": "unquantized",
    }) == {"m.layers.1.mlp.experts": ["nvfp4", "unquantized"]}


@pytest.mark.parametrize("cmd", ["nvfp4", "preflight", "recipe show"])
def test_tp3_mixed_experts_refused_before_any_byte(cmd, glm5_next_src, tmp_path, capsys):
    out = tmp_path / "out"
    args = {"nvfp4": ["nvfp4", "--src", glm5_next_src, "--out", out, "--device", "cpu", "--quiet"],
            "preflight": ["preflight", glm5_next_src, "--out", out],
            "recipe show": ["recipe", "show", "--src", glm5_next_src, "--summary"]}[cmd]
    rc, stdout, err = run(capsys, *args, "--tp", "3")
    assert (rc, stdout, err) == (1, "", MOE_TP3)
    assert not out.exists()
