"""Overlap reading, quantizing and writing: background stages joined by bounded queues.

A stage runs in its own thread and hands items over through a queue of fixed depth, so at
most ``depth`` items wait between two stages and memory stays bounded whatever the model
size. An exception in a stage (a bad tensor, a full disk, a KeyboardInterrupt) is re-raised,
with its own type, in the thread that consumes or feeds the stage; the other stages stop.
:class:`StageClock` adds up the seconds each kind of work takes, to find the stage that
bounds the throughput.
"""

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

__all__ = ["Producer", "Consumer", "StageClock"]

_DONE = object()
_POLL_S = 0.1


class _Stage:
    def __init__(self, depth: int):
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def _put(self, item) -> bool:
        """Put unless the stage was stopped; True when the item went in."""
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the thread and wait for it: it finishes the item in hand, drops the rest."""
        self.stop.set()
        self.thread.join()


class Producer(_Stage):
    """Runs ``make()`` (an iterable) in a background thread; iterate to receive its items.

    At most ``depth`` finished items wait in the queue; the thread blocks when it is full.
    """

    def __init__(self, make: Callable[[], Iterable], depth: int = 2, name: str = "producer"):
        super().__init__(depth)
        self.thread = threading.Thread(target=self._work, args=(make,), name=name, daemon=True)
        self.thread.start()

    def _work(self, make) -> None:
        try:
            for item in make():
                if not self._put(item):
                    return
        except BaseException as e:  # handed to the consumer, re-raised there
            self.error = e
        self._put(_DONE)

    def __iter__(self) -> Iterator:
        while True:
            item = self.q.get()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item


class Consumer(_Stage):
    """Calls ``work(item)`` in a background thread for every item given to :meth:`put`.

    :meth:`put` blocks while ``depth`` items wait; :meth:`finish` waits for the last one.
    Both re-raise the first exception ``work`` raised.
    """

    def __init__(self, work: Callable[[object], None], depth: int = 1, name: str = "consumer"):
        super().__init__(depth)
        self.thread = threading.Thread(target=self._work, args=(work,), name=name, daemon=True)
        self.thread.start()

    def _work(self, work) -> None:
        while True:
            try:
                item = self.q.get(timeout=_POLL_S)
            except queue.Empty:
                if self.stop.is_set():
                    return
                continue
            if item is _DONE or self.stop.is_set():
                return
            try:
                work(item)
            except BaseException as e:
                self.error = e
                self.stop.set()
                return

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, item) -> None:
        self._raise()
        if not self._put(item):
            self._raise()

    def finish(self) -> None:
        """Wait until every item is done; re-raise a stage error."""
        if self._put(_DONE):
            self.thread.join()
        self._raise()


class StageClock:
    """Seconds spent per kind of work (``read``, ``quantize``, ``write``...), summed over
    the threads that do it: ``seconds`` wall time, ``cpu_seconds`` the CPU time of the
    thread doing it (its own work only, not the OpenMP workers it starts). Stages overlap, so
    the sum exceeds the wall time; the stage whose seconds come close to the wall time is the
    one that bounds the throughput, and the ``wait ...`` entries say how long a thread stood
    idle for another stage. Thread-safe."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float, cpu_seconds: float = 0.0) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
            self.cpu_seconds[stage] = self.cpu_seconds.get(stage, 0.0) + cpu_seconds

    @contextmanager
    def __call__(self, stage: str):
        """``with clock("read"): ...`` adds the block's wall and thread CPU seconds to ``stage``."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t0, time.thread_time() - c0)
