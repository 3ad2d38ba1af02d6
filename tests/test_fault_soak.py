"""scripts/fault_soak.py in a small configuration: a 64-shard source, one seeded kill -9 point
per stage with ``--workers 2``, a changed source shard, a Hub download and an upload killed;
every resumed build byte-identical (sha256 of every file) to the uninterrupted one. Kill points
are events of the run (a file opened, written, renamed; a kernel call), never times."""

import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import fault_soak  # noqa: E402


def test_small_soak_resumes_byte_identical(tmp_path, capsys):
    a = fault_soak.parse(["--shards", "64", "--points", "1", "--single", "0", "--workers", "2",
                          "--faults", "kill,source,download,upload", "--seed", "1"])
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
    for partial in ("none", "half", "corrupt"):
        r = by[("download", f"kill -9, {partial} partial")]
        assert (r.rc, r.resume_rc, r.equal) == (str(-signal.SIGKILL), "0", "yes"), r
    ups = [r for r in rows if r.stage == "upload"]
    assert [r.point.split(" #")[0] for r in ups] == ["LFS PUT", "preupload call", "commit call"]
    for r in ups:
        assert r.rc == str(-signal.SIGKILL) and r.resume_rc == "0", r
        assert r.equal.startswith("yes;") and r.equal.endswith("each weights + card: yes"), r
    assert all(r.ok for r in rows), fault_soak.render([r for r in rows if not r.ok])
