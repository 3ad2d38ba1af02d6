"""scripts/fault_soak.py in a small configuration: a 16-shard source, one seeded kill -9 point
per stage with ``--workers 2`` and a source shard changed three ways; every resumed build
byte-identical (sha256 of every file) to the uninterrupted one. Kill points
are events of the run (a file opened, written, renamed; a kernel call), never times.
16 shards, not 64: a faulted run's time is the imports of its three processes (about 23 s of
26 s at 64 shards on 2 cores), so more shards add little time and nothing to what is shown,
as long as each kill lands mid-run (asserted below: finished shards for the resume to keep and
missing ones for it to write). ``--jobs 2`` runs two faulted builds at a time (each its own
process group, output and counter), filling the core a lone build leaves idle while it
imports. The Hub
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
    # seed 1 at 16 shards (census of an uninterrupted --workers 2 build: read 352, quantize 48,
    # write 16, rename 40, manifest 8 events): kills at read #131, quantize #8, write #16,
    # rename #29, manifest #8; the source changed at reads #211 and #193 (workers' pre-flight)
    # and #322 (the conversion's own reading), as 64 shards put them
    a = fault_soak.parse(["--shards", "16", "--points", "1", "--single", "0", "--workers", "2",
                          "--faults", "kill,source", "--seed", "1", "--jobs", "2"])
    rows = fault_soak.soak_rows(a, tmp_path)
    with capsys.disabled():
        print("\n" + fault_soak.render(rows))
    by = {(r.stage, r.fault.split(" (")[0]): r for r in rows}
    assert by[("reference", "--workers 2 vs 1 process")].equal == "yes"
    for stage in fault_soak.STAGES:
        r = by[(stage, "kill -9")]
        assert (r.rc, r.resume_rc, r.equal) == (str(-signal.SIGKILL), "0", "yes"), r
        assert r.point.startswith(f"{stage} #"), r  # the point was reached
        if stage == "read":
            continue  # killed in pre-flight or at a shard's first read: maybe no --out yet
        on_disk = int(next(n for n in r.notes if n.endswith(" shards on disk")).split()[0])
        if stage == "quantize":  # mid-run: shards left to write
            assert on_disk < 16, r
        elif stage in ("write", "rename"):  # mid-run: shards to keep and shards to write
            assert 0 < on_disk < 16, r
        else:  # manifest, the finish: every shard written before the kill
            assert on_disk == 16, r
    for mode in ("truncate", "rewrite", "replace"):
        r = by[("read", f"source shard {mode}")]
        shard = r.point.split("(")[-1].rstrip(")")
        assert r.rc == "1" and r.message.startswith("error: ") and shard in r.message, r
        assert (r.resume_rc, r.equal) == ("0", "yes"), r
    assert all(r.ok for r in rows), fault_soak.render([r for r in rows if not r.ok])
