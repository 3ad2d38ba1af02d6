"""Degenerate-output detector."""

from eval.degenerate import degenerate_reason, degenerate_summary


def test_flags_the_quiet_failures():
    assert degenerate_reason("!!!!!!!!!!!!!!!!!!!!!!!!") == "repeat"  # NVFP4-KV "!!!!"
    assert degenerate_reason("Answer: " + "the " * 12) == "repeat"  # a one-word cycle
    assert degenerate_reason("72 clips" + "ab" * 10) == "repeat"
    assert degenerate_reason("ok \ufffd\ufffd\ufffd bytes") == "invalid-utf8"
    assert degenerate_reason("x" * 30 + "\ufffd\ufffd") == "invalid-utf8"  # 2 of 32 chars >= 5 %
    assert degenerate_reason("a\x00b\x01c\x02d\x03e") == "control"


def test_leaves_ordinary_text_alone():
    for t in ["Natalia sold 48+24 = 72 clips.\n#### 72", "The answer is 18. " * 6, "", "   \n\n\n   ",
              " 12345.", "Paris, and the capital of Italy is Rome.\n\n", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
              "x" * 15, "tab\tand\nnewline"]:
        assert degenerate_reason(t) is None, repr(t)


def test_summary_counts_reasons():
    s = degenerate_summary(["fine text", "!" * 40, "\ufffd" * 4, "more fine text"])
    assert s["n"] == 4 and s["degenerate"] == 2 and s["rate"] == 0.5
    assert s["reasons"] == {"repeat": 1, "invalid-utf8": 1}
    assert s["examples"] == ["!" * 40, "\ufffd" * 4]
    assert degenerate_summary([])["rate"] == 0.0
