"""FC-04: peak memory of a conversion does not grow with the number of shards."""

import json
import subprocess
import sys

from quantize.data.fixtures import write_synthetic_fp8

PROBE = """
import sys
from quantize.convert.pipeline import convert

def peak_rss():  # VmHWM is reset by exec, unlike ru_maxrss
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024

convert(sys.argv[1], sys.argv[2], progress=False, device="cpu")
print(peak_rss())
"""


def peak_rss(src, out) -> int:
    r = subprocess.run([sys.executable, "-c", PROBE, str(src), str(out)], capture_output=True,
                       text=True, check=True)
    return int(r.stdout.strip().splitlines()[-1])


def test_fc04_peak_rss_flat_in_shard_count(tmp_path):
    # each shard: 2 experts x 3 x (1024 x 2048) FP8 = 12 MiB of FP8 (48 MiB dequantized)
    kw = dict(experts_per_shard=2, hidden=2048, inter=1024, fast=True)
    small = write_synthetic_fp8(tmp_path / "s3", n_shards=3, **kw)
    large = write_synthetic_fp8(tmp_path / "s9", n_shards=9, **kw)
    index = json.loads((small / "model.safetensors.index.json").read_text())
    shard_bytes = index["metadata"]["total_size"] / 3
    p3 = peak_rss(small, tmp_path / "o3")
    p9 = peak_rss(large, tmp_path / "o9")
    # 6 more shards of input (75 MiB of FP8, 300 MiB dequantized) may add less than one shard
    assert p9 - p3 < shard_bytes, (p3, p9, shard_bytes)
