"""Write an FP8 release fixture in the exact on-disk layout of GLM-5.3-Flash (``glm5_next``),
GLM-5 (``glm_moe_dsa``) or DeepSeek-V3 (``deepseek_v3``).

    python scripts/make_glm_fixture.py --model-type glm5_next --size tiny --out /tmp/glm53-tiny
    python scripts/make_glm_fixture.py --model-type glm5_next --size full --out glm53.descriptor.json

``tiny`` writes real block-FP8 shards (seconds); ``full`` writes a header-only descriptor of
the full-size release (names, dtypes, shapes; no data) for ``quantize recipe show`` and
fit planning. Names and shapes come from the real transformers classes
(``quantize.data.fixtures.release_tensors``).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantize.data.fixtures import (  # noqa: E402
    RELEASE_MODEL_TYPES,
    write_release_descriptor,
    write_release_fixture,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-type", choices=RELEASE_MODEL_TYPES, default="glm5_next")
    p.add_argument("--size", choices=["tiny", "full"], default="tiny")
    p.add_argument("--out", required=True, help="folder (tiny) or .json file (full)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.size == "tiny":
        out = write_release_fixture(Path(a.out), a.model_type, seed=a.seed)
    else:
        out = write_release_descriptor(Path(a.out), a.model_type, "full")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
