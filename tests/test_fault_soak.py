"""scripts/fault_soak.py in a small configuration: a 64-shard source, one seeded kill -9 point
per stage with ``--workers 2`` and a source shard changed three ways; every resumed build
byte-identical (sha256 of every file) to the uninterrupted one. Kill points
are events of the run (a file opened, written, renamed; a kernel call), never times. The Hub
download and upload kills of the full soak (``python scripts/fault_soak.py``) are left to its
own run: in CI they are covered by test_hub_download's and test_upload's kill-and-resume tests,
and they would double this test's time on 2 cores."""

import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import fault_soak  # noqa: E402


def test_small_soak_resumes_byte_identical(tmp_path, capsys):
    a = fault_soak.parse(["--shards", "64", "--points", "1", "--single", "0", "--workers", "2",
                          "--faults", "kill,source", "--seed", "1"])
    rows = fault_soak.soak_rows(a, tmp_path)
    with capsys.disabled():
        print("\n" + fault_soak.render(rows))
    by = {(r.stage, r.fault.split(" (")[0]): r for r in rows}
    assert by[("reference", "--workers 2 vs 1 process")].equal == "yes"
    for stage in fault_soak.STAGES:
        r = by[(stage, "kill -9")]
        assert (r.rc, r.resume_rc, r.equal) == (str(-signal.SIGKILL), "0", "yes"), r
        assert r.point.startswith(f"{stage} #"), r  # the point was reached
    for mode in ("truncate", "rewrite", "replace"):
        r = by[("read", f"source shard {mode}")]
        shard = r.point.split("(")[-1].rstrip(")")
        assert r.rc == "1" and r.message.startswith("error: ") and shard in r.message, r
        assert (r.resume_rc, r.equal) == ("0", "yes"), r
    assert all(r.ok for r in rows), fault_soak.render([r for r in rows if not r.ok])
