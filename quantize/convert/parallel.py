"""Several processes converting one checkpoint: shards divided among ranks, rank 0 finishes.

Two ways in, one code path:

- ``torchrun --nproc-per-node N -m quantize.cli nvfp4 ...`` (or several nodes sharing the
  output folder): :func:`init_from_env` joins the torch.distributed group that torchrun
  describes (gloo: only small Python objects are exchanged, never tensors).
- ``convert(..., workers=N)`` on one machine: :func:`spawn_local` starts N processes that form
  a gloo group through a file in a temporary folder, and returns rank 0's result.

Each rank converts the output shards :func:`assign_shards` gives it and keeps its own resume
ledger; rank 0 writes the index, config and manifest after every rank has finished.
"""

import multiprocessing as mp
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from quantize.base.errors import OutputError

__all__ = ["World", "assign_shards", "current_world", "init_from_env", "spawn_local"]

TIMEOUT = timedelta(hours=24)
"""How long a rank waits for the others (a rank with little work waits for the slowest)."""


class World:
    """This process's rank among ``size`` processes; collective calls are no-ops when alone."""

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def current_world() -> World:
    """The torch.distributed group if one is initialized, else a world of one."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def init_from_env() -> bool:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1, ``MASTER_ADDR``...).

    Returns:
        True when this process is now one rank of several.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    return True


def assign_shards(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Divide shards among ranks, largest first to the least loaded rank (ties: lower rank).

    Args:
        sizes: shard file name -> bytes. world_size: number of ranks.

    Returns:
        one sorted list of shard names per rank; every shard in exactly one list. The same
        inputs give the same lists on every rank.
    """
    loads = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda s: (-sizes[s], s)):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        out[r].append(name)
        loads[r] += sizes[name]
    return [sorted(x) for x in out]


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel kill this worker when the process that spawned it dies
    (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so a ``kill -9`` of ``quantize`` never leaves
    workers writing into the output folder; exit at once if the parent is already gone."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own clean-up still applies
        return
    if os.getppid() != parent:
        os._exit(1)


def _child(rank: int, size: int, store: str, threads: int, fn, kwargs: dict, results,
           parent: int) -> None:
    _die_with_parent(parent)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=size, timeout=TIMEOUT)
        try:
            results.put((rank, "ok", fn(**kwargs)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # handed to the parent, re-raised there with its own type
        results.put((rank, "err", e))


def spawn_local(workers: int, fn, kwargs: dict):
    """Run ``fn(**kwargs)`` in ``workers`` processes forming one gloo group; return rank 0's
    result. Each process gets ``cores // workers`` torch threads.

    Raises:
        the lowest rank's exception, or OutputError when a process died without one.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // workers)
    with tempfile.TemporaryDirectory(prefix="spark-quant-group-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_child, args=(r, workers, store, threads, fn, kwargs, results,
                                                  os.getpid()),
                             name=f"spark-quant-rank{r}") for r in range(workers)]
        for p in procs:
            p.start()
        got = {}
        try:
            while len(got) < workers:
                try:
                    rank, status, value = results.get(timeout=1.0)
                    got[rank] = (status, value)
                except Exception:  # queue.Empty: check that nobody died silently
                    dead = [p for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                    if dead:
                        raise OutputError(f"worker {dead[0].name} exited with code "
                                          f"{dead[0].exitcode} without a result; the output "
                                          "has no manifest (run again with --resume)") from None
        finally:
            for p in procs:
                p.join(timeout=5 if len(got) == workers else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    for rank in sorted(got):
        if got[rank][0] == "err":
            raise got[rank][1]
    return got[0][1]
