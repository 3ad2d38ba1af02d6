"""Peak memory of layer-streamed calibration is one layer plus activations, not the model:
flat from 4 to 16 decoder layers."""

import subprocess
import sys

from tiny_models import build_tiny

PROBE = """
import sys, torch
from calibrate import calibrate_sequences
from calibrate.data import CalibSet

def peak_rss():  # VmHWM is reset by exec, unlike ru_maxrss
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024

g = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, 256, (1, 32), generator=g) for _ in range(2)]
calibrate_sequences(sys.argv[1], CalibSet(seqs, {}), progress=False)
print(peak_rss())
"""


def peak_rss(src) -> int:
    r = subprocess.run([sys.executable, "-c", PROBE, str(src)], capture_output=True, text=True, check=True)
    return int(r.stdout.strip().splitlines()[-1])


def test_peak_rss_flat_in_depth(tmp_path):
    # one layer: 4 x 512^2 attention (GQA: q, o full; k, v half) + 3 x 512 x 2048 MLP
    # = 3.7 M parameters = 15 MiB in float32; 16 layers would be 240 MiB
    kw = dict(hidden=512, inter=2048, reference=False)
    small, _ = build_tiny(tmp_path / "l4", "llama", n_layers=4, **kw)
    deep, _ = build_tiny(tmp_path / "l16", "llama", n_layers=16, **kw)
    layer_bytes = (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 2048) * 4
    p4, p16 = peak_rss(small), peak_rss(deep)
    # 12 more layers (180 MiB of float32 weights) may add less than two layers
    assert p16 - p4 < 2 * layer_bytes, (p4, p16, layer_bytes)
