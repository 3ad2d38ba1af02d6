"""Forcing one interleaving of the ranks of a Hub conversion, by events instead of timing.

:class:`GatedShards` is ``quantize.hub.download.HubShards`` with gates: each gate
``(rank, shard, other)`` holds the first read of ``shard`` by ``rank`` (``path``) until rank
``other`` has released that shard (``release`` returned there). The ranks are separate
processes (``--workers``, torchrun), so the events are files in the folder named by
``$SPARK_QUANT_TEST_GATES``, and the gates travel in the pickled shard files. :func:`main`
runs ``quantize ARGS`` with ``open_hub_source`` building :class:`GatedShards`:

    python tests/hub_gates.py RANK:SHARD:OTHER[,...] -- nvfp4 --src ORG/NAME ...
"""

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from quantize.hub import download

GATE_ENV = "SPARK_QUANT_TEST_GATES"
WAIT = 120.0
"""Seconds a gate waits for its event before failing the run (an event that never comes)."""


class GatedShards(download.HubShards):
    gates: tuple[tuple[int, str, int], ...] = ()

    def __getstate__(self):
        return {**super().__getstate__(), "gates": self.gates}

    def __setstate__(self, state):
        self.gates = tuple(state.pop("gates"))
        super().__setstate__(state)

    def _event(self, rank: int, shard: str) -> Path:
        return Path(os.environ[GATE_ENV]) / f"released.{rank}.{shard}"

    def path(self, shard: str) -> Path:
        opened = self.__dict__.setdefault("_opened", set())
        for rank, s, other in self.gates:
            if rank == self.rank and s == shard and shard not in opened:
                event, end = self._event(other, shard), time.monotonic() + WAIT
                while not event.exists():  # the outcome never depends on how long this takes
                    if time.monotonic() > end:
                        raise RuntimeError(f"gate: rank {rank} waited {WAIT:g}s for rank {other} "
                                           f"to release {shard}")
                    time.sleep(0.02)
                (Path(os.environ[GATE_ENV]) / f"passed.{rank}.{shard}").touch()
        opened.add(shard)
        return super().path(shard)

    def release(self, shard: str) -> None:
        super().release(shard)
        self._event(self.rank, shard).touch()


def main(argv: list[str]) -> int:
    """``argv``: ``RANK:SHARD:OTHER[,...]``, ``--``, then the arguments of ``quantize``."""
    # pickled by this module's name, not __main__'s
    from tests.hub_gates import GatedShards as gated

    spec, args = argv[0], argv[argv.index("--") + 1:]
    gated.gates = tuple((int(r), s, int(o)) for r, s, o in (g.split(":") for g in spec.split(",")))
    download.HubShards = gated  # what open_hub_source builds

    from quantize.cli import main as cli

    return cli(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
