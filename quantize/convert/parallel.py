"""Several processes converting one checkpoint: shards divided among ranks, rank 0 finishes.

Two ways in, one code path:

- ``torchrun --nproc-per-node N -m quantize.cli nvfp4 ...`` (or several nodes sharing the
  output folder): :func:`init_from_env` joins the torch.distributed group that torchrun
  describes (gloo: only small Python objects are exchanged, never tensors).
- ``convert(..., workers=N)`` on one machine: :func:`spawn_local` starts N processes that form
  a gloo group through a file in a temporary folder, and returns rank 0's result.

Each rank converts the output shards :func:`assign_shards` gives it and keeps its own resume
ledger; rank 0 writes the index, config and manifest after every rank has finished.

Worker processes share the machine without oversubscribing it (docs/architecture.md,
"Parallel CPU conversion"): each owns ``cores // workers`` cores (its CPU affinity), and
OpenMP, MKL and OpenBLAS are told that many threads through the environment before torch
loads in the child, so every thread of the worker (the reader's and the quantizer's kernels
alike) runs teams of that size; inductor compiles in the worker's own thread (no pool of
compile processes per worker). The compiled kernels come from inductor's on-disk cache, shared
by every worker: rank 0 warms it, the others wait and then load what it compiled.
"""

import contextlib
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from quantize.base.errors import OutputError

__all__ = ["MIN_BYTES_PER_WORKER", "World", "assign_shards", "available_memory", "core_slices",
           "current_world", "default_workers", "init_from_env", "spawn_local", "usable_cores",
           "worker_env"]

TIMEOUT = timedelta(hours=24)
"""How long a rank waits for the others (a rank with little work waits for the slowest)."""

CORES_PER_WORKER = 16
"""Cores one ``--workers auto`` worker saturates the disk with (see :func:`default_workers`)."""

MIN_BYTES_PER_WORKER = 2 * 2**30
"""The default worker count gives each worker at least this much source: starting a worker
(torch import, loading the compiled kernels) costs seconds, more than a small checkpoint takes."""

WORKER_BASE_BYTES = 2**30
"""Memory of one worker besides its shards (torch, the compiled kernels, the allocator's slack)."""

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""Thread-pool sizes read once, when the library loads: set in a worker's environment before
torch initialises there."""


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


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def available_memory() -> int | None:
    """Bytes of memory available to new processes (``MemAvailable`` of /proc/meminfo), or
    None where the system does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_workers(cores: int, memory: int | None, shard_bytes: list[int]) -> int:
    """The worker count ``--workers auto`` uses for a CPU conversion:
    ``min(cores // 16, shards, source bytes // 2 GiB, (memory - 2 GiB) // (1 GiB + 3 x the largest
    shard))``, at least 1.

    :data:`CORES_PER_WORKER` (16) cores a worker: measured on the H200 machine's 16 cores
    (``scripts/bench_convert.py --device cpu --size-gb 2.4``, 2026-12-01), one process with its
    16 OpenMP threads converts at 0.633 G elements/s, 0.96x a plain read + write of the same
    bytes, so a further worker on those cores can only add its start-up.
    One shard at least a worker (workers divide the shards). :data:`MIN_BYTES_PER_WORKER` of
    source a worker, so a small checkpoint stays in one process. A worker holds about three
    source shards' worth of tensors in flight (queued, in hand, being written) plus
    :data:`WORKER_BASE_BYTES`; 2 GiB of ``memory`` stay free for the rest of the machine.

    Args:
        cores: CPU cores this process may use. memory: available bytes, or None (not limiting).
        shard_bytes: size of each source shard, bytes.
    """
    if not shard_bytes:
        return 1
    n = min(cores // CORES_PER_WORKER, len(shard_bytes), sum(shard_bytes) // MIN_BYTES_PER_WORKER)
    if memory is not None:
        n = min(n, (memory - 2 * 2**30) // (WORKER_BASE_BYTES + 3 * max(shard_bytes)))
    return max(1, int(n))


def core_slices(cores: list[int], workers: int) -> list[list[int]]:
    """The cores each of ``workers`` processes owns: ``len(cores) // workers`` consecutive ones
    each (at least one; with more workers than cores, they share cores round-robin)."""
    per = max(1, len(cores) // workers)
    return [[cores[(r * per + i) % len(cores)] for i in range(per)] for r in range(workers)]


def worker_env(threads: int) -> dict[str, str]:
    """Environment of a worker that owns ``threads`` cores: OpenMP / MKL / OpenBLAS pools of
    that size, and inductor compiling in the calling thread (``TORCHINDUCTOR_COMPILE_THREADS=1``:
    a pool of compile processes per worker would start as many processes as there are cores,
    for four small graphs). The inductor cache folder is inherited, so every worker reads the
    same compiled kernels."""
    env = {k: str(threads) for k in THREAD_ENV}
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    return env


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


@contextlib.contextmanager
def _pinned(cores: list[int]):
    """This thread runs on ``cores`` inside the block, and a process it starts inherits them
    from its first instruction: the worker's OpenMP runtime, initialized when torch loads
    there (before :func:`_child` runs), counts only the worker's cores. libgomp keeps that
    count from its start and sizes its spin-waits by it: with fewer threads than the cores it
    counted, an idle thread spins for milliseconds after each parallel region before it
    sleeps, so a worker that counted all the parent's cores lets its teams (reader, quantizer,
    writer: one each) spin on the few cores they share (suspected in issue 18)."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _warm_in_turn(rank: int, warm) -> None:
    """``warm()`` on rank 0, then on the others: they load what rank 0 compiled from the
    shared cache instead of compiling the same kernels at once. Rank 0's error is raised on
    every rank after the barrier (no rank waits alone)."""
    err = None
    if rank == 0:
        try:
            warm()
        except Exception as e:
            err = e
    dist.barrier()
    if rank == 0:
        if err is not None:
            raise err
    else:
        warm()


STOP_WAIT_S = 10.0
"""How long an interrupted :func:`spawn_local` waits for its workers to stop on SIGTERM (each
unwinds as after Ctrl-C, so its ledger and semaphores are left in order) before it kills them."""


def _stop(signum, frame) -> None:
    """A worker's SIGTERM handler: unwind as a Ctrl-C would (the parent sends SIGTERM when it
    was interrupted, :func:`spawn_local`)."""
    raise KeyboardInterrupt


def _child(rank: int, size: int, store: str, cores: list[int], fn, kwargs: dict, results,
           parent: int, warm) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGTERM, _stop)  # SIGINT is ignored: it was at exec (spawn_local)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=size, timeout=TIMEOUT)
        try:
            if warm is not None:
                _warm_in_turn(rank, warm)
            results.put((rank, "ok", fn(**kwargs)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # handed to the parent, re-raised there with its own type
        results.put((rank, "err", e))


def spawn_local(workers: int, fn, kwargs: dict, warm=None):
    """Run ``fn(**kwargs)`` in ``workers`` processes forming one gloo group; return rank 0's
    result.

    Each process owns ``cores // workers`` of this process's cores (:func:`core_slices`, its
    CPU affinity from its start, :func:`_pinned`) and runs that many threads: torch's, and OpenMP / MKL / OpenBLAS pools sized
    through :func:`worker_env` before torch loads in it. ``warm`` (picklable, no arguments),
    when given, runs first on rank 0 and then on the others (compile the kernels once, into the
    inductor cache every worker shares).

    Ctrl-C (SIGINT to the whole process group) is this process's alone: the workers start with
    SIGINT ignored, and on KeyboardInterrupt here each is sent SIGTERM, on which it unwinds as
    after a Ctrl-C (:data:`STOP_WAIT_S`, then it is killed), before the KeyboardInterrupt goes
    on to the caller (the CLI prints the resume hint, formats.manifest.resume_hint).

    Raises:
        the lowest rank's exception, or OutputError when a process died without one;
        KeyboardInterrupt when interrupted (the workers have stopped).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    slices = core_slices(usable_cores(), workers)
    with tempfile.TemporaryDirectory(prefix="spark-quant-group-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_child, args=(r, workers, store, slices[r], fn, kwargs, results,
                                                  os.getpid(), warm),
                             name=f"spark-quant-rank{r}") for r in range(workers)]
        # a spawned child inherits this process's environment when it starts: set the thread
        # pools' sizes for it, and put ours back
        saved = {k: os.environ.get(k) for k in worker_env(1)}
        # and SIGINT ignored: an ignored signal stays ignored across exec, and Python installs
        # no KeyboardInterrupt handler for it then, so a Ctrl-C reaches only this process
        main = threading.current_thread() is threading.main_thread()
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            os.environ.update(worker_env(len(slices[0])))
            for r, p in enumerate(procs):
                with _pinned(slices[r]):
                    p.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, signal.default_int_handler if sigint is None else sigint)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
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
        except KeyboardInterrupt:
            for p in procs:
                if p.is_alive():
                    p.terminate()  # SIGTERM: the worker unwinds (_stop)
            deadline = time.monotonic() + STOP_WAIT_S
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            raise
        finally:
            for p in procs:
                p.join(timeout=5 if len(got) == workers else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
            results.close()
            results.join_thread()
    for rank in sorted(got):
        if got[rank][0] == "err":
            raise got[rank][1]
    return got[0][1]
