"""The Hugging Face Hub, through ``huggingface_hub`` only: stream a source shard by shard
within a disk budget, and publish a build behind its eval gate.

Download (``--src ORG/NAME[@REVISION]``): the revision is resolved to a commit and the file
list (sizes, LFS sha256) read with one ``model_info`` call; the small files (config, index,
tokenizer, license, code) are downloaded; every shard header is read with an HTTP range
request (or from the cache), so the whole job is planned and validated before any weight is
fetched. Shards are then downloaded into the Hugging Face cache in the background, in the order
the converter reads them and as far ahead as the disk budget allows (:class:`HubShards`),
hashed as the bytes arrive (``quantize.hub.stream``: sha256 equal to the Hub's LFS sha256),
checked (header identical to the planned one), and deleted once no later shard reads them; a
shard that was already in the cache is the user's, checked by one read, and never deleted. ``HF_TOKEN``, ``HF_HOME``/``HF_HUB_CACHE``, ``HF_ENDPOINT`` and
``HF_HUB_OFFLINE`` act as they do for every ``huggingface_hub`` program; offline, the source
is the cached snapshot and nothing is deleted.

Which shards this build downloaded (and may delete) is written to ``<out>/.spark-quant-hub.json``
before each download, so an interrupted run resumes without re-downloading a shard still in the
cache (a partial one is resumed from its last byte) and still deletes what it fetched; the file
is removed when the last shard is done. Ranks of one run each keep their own
``.spark-quant-hub.rank<R>.json`` (see :class:`HubShards`).
"""

import errno
import json
import logging
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from formats.checkpoint import (
    INDEX_NAME,
    PICKLE_SUFFIXES,
    SINGLE_NAME,
    WEIGHT_SUFFIXES,
    write_json_atomic,
)
from formats.shards import TensorInfo, read_header, sha256_file
from formats.sources import ShardFiles, Source, open_source
from quantize.base.errors import SourceError
from quantize.hub.retry import MAX_RETRIES, RETRY_STATUS
from quantize.hub.retry import install as install_retries

__all__ = ["REPO_REF", "STATE_NAME", "HubShards", "hub_errors", "open_hub_source", "parse_repo_ref"]

REPO_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(@(?P<rev>[\w./-]+))?$")
STATE_NAME = ".spark-quant-hub.json"
SMALL_FILE_MAX = 64 * 2**20  # non-weight files up to this size are fetched and carried
HEADER_WORKERS = 8
SPARE = 2**30
"""Bytes of the download cache's filesystem left free by the read-ahead (other programs)."""

log = logging.getLogger("spark_quant.hub")


def parse_repo_ref(text: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; the revision is None when absent.

    Raises:
        SourceError: the text is not a Hub repo id.
    """
    m = REPO_REF.match(text)
    if not m:
        raise SourceError(f"{text!r} is not a Hub repo id (ORG/NAME or ORG/NAME@REVISION)")
    return m["repo"], m["rev"]


@contextmanager
def hub_errors(repo: str, revision: str | None, error: type = SourceError):
    """Turn huggingface_hub and HTTP errors into ``error`` (a SparkQuantError) that says what
    to do."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo}@{revision or 'main'} on {constants.ENDPOINT}"
    try:
        yield
    except GatedRepoError:
        raise error(f"{where} is gated: accept its terms on the Hub and set HF_TOKEN to a "
                          "token of that account") from None
    except RepositoryNotFoundError:
        raise error(f"{where}: repository not found, or private and HF_TOKEN is missing "
                          "or has no access") from None
    except RevisionNotFoundError:
        raise error(f"{where}: revision {revision!r} not found") from None
    except RemoteEntryNotFoundError as e:
        raise error(f"{where}: file missing on the Hub ({e})") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        raise error(f"{where}: not available offline (HF_HUB_OFFLINE=1) in the cache "
                          f"{constants.HF_HUB_CACHE}: {e}") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in RETRY_STATUS:
            raise error(f"{where}: Hub request failed (HTTP {status}) after {MAX_RETRIES} retries "
                        f"with exponential backoff; gave up: {e}. Re-run the same command later: "
                        "it resumes") from None
        raise error(f"{where}: Hub request failed: {e}") from None
    except (httpx2.TransportError, ConnectionError) as e:
        raise error(f"{where}: cannot reach the Hub ({e}); set HF_HUB_OFFLINE=1 to use the "
                          "cache only") from None


def _is_weight(path: str) -> bool:
    return path.endswith(WEIGHT_SUFFIXES) or path.endswith(PICKLE_SUFFIXES)


class HubShards(ShardFiles):
    """Shards of one Hub commit: headers known up front, files fetched into the Hugging Face
    cache ahead of the converter within a disk budget, and deleted after their last read
    (unless kept or already cached).

    Once the converter says what it will read (:meth:`will_read`), a background thread
    downloads those shards in that order (``quantize.hub.stream``: hashed as the bytes
    arrive) while at most ``budget`` bytes of shards this run downloaded are on disk at once; a
    shard the converter asks for is fetched at once whatever the budget. ``trace`` records
    ``(event, shard, bytes held)`` for each download start / end and each deletion.

    Several processes (``--workers``, torchrun ranks) share one cache folder: each fetches
    the shards it reads (a lock per blob, the one ``hf_hub_download`` takes, so a shard read by
    two ranks is downloaded once), and a shard is deleted by the last rank that reads it, from
    what every rank has recorded in its ``.spark-quant-hub.rank<R>.json`` in the output
    folder (:meth:`gather_ranks` sums and removes those files at the end). A rank reads only
    shards of its ``orders`` entry (``Source.read_order``: its own, their scale sidecars and
    the fused-group partners it takes an amax from), so no rank reads a shard after its last
    reader deleted it; the read-ahead skips a shard released before it got to it.
    """

    shared = True  # several processes may each open it (--workers, torchrun)

    def __init__(self, repo: str, commit: str, snapshot: Path, listing: dict[str, dict],
                 headers: dict[str, dict[str, TensorInfo]], state: Path, keep: bool,
                 budget: int | None = None, run_id: str | None = None):
        super().__init__(snapshot)
        self.check_on_open = False
        self.root = snapshot.parent.parent  # models--org--name/
        self.repo, self.commit, self.listing, self.headers = repo, commit, listing, headers
        self.state, self.keep = Path(state), keep
        self.budget_limit = budget  # --source-budget (bytes); None: what the free disk allows
        self.budget: int | None = budget
        self.run_id = run_id or uuid.uuid4().hex
        self.fetched: set[str] = set()  # shards this build downloaded (may delete)
        for f in self._state_files():
            data = json.loads(f.read_text())
            if data.get("repo") == repo and data.get("commit") == commit:
                self.fetched |= set(data.get("fetched", []))
        self._mine_at_start = set(self.fetched)
        self.downloaded_bytes = 0
        self.peak_bytes = 0  # most source-shard bytes on disk at once during this run
        self._setup()

    # ---- pickling (--workers): the plan travels, the threads are made afresh -------------
    def __getstate__(self):
        keep = ("folder", "check_on_open", "seen", "root", "repo", "commit", "listing",
                "headers", "state", "keep", "budget_limit", "budget", "run_id", "fetched")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.fetched = set(self.fetched)
        self._mine_at_start = set(self.fetched)
        self.downloaded_bytes = self.peak_bytes = 0
        self._setup()

    def _setup(self) -> None:
        self._ready: dict[str, Path] = {}
        self._errors: dict[str, BaseException] = {}
        self._cv = threading.Condition()
        self._order: list[str] = []
        self._demand = -1  # highest index in _order the converter has asked for
        self._held: dict[str, int] = {}  # shards this run downloaded, on disk: bytes
        self._thread: threading.Thread | None = None
        self._stop = False
        self.rank, self.world = 0, 1
        self._readers: dict[str, set[int]] = {}
        self._released: set[str] = set()
        self.trace: list[tuple[str, str, int]] = []
        self.idle = threading.Event()  # the read-ahead waits for the budget, or is done

    def header(self, shard: str) -> dict[str, TensorInfo]:
        return self.headers[shard]

    def identity(self, shard: str) -> list:
        """[size, sha256] from the Hub listing: the same bytes whether or not on disk."""
        m = self.listing[shard]
        return [m["size"], m.get("sha256") or m.get("blob_id")]

    def _on_disk(self, shard: str) -> bool:
        return (self.folder / shard).exists()

    # ---- state files ---------------------------------------------------------------
    def _state_files(self) -> list[Path]:
        return sorted(self.state.parent.glob(self.state.stem + "*.json"))

    def _rank_state(self, rank: int) -> Path:
        return self.state.with_name(f"{self.state.stem}.rank{rank}.json")

    def _save_state(self) -> None:
        if self.world == 1:
            write_json_atomic({"repo": self.repo, "commit": self.commit,
                               "fetched": sorted(self.fetched)}, self.state)
            return
        write_json_atomic({"repo": self.repo, "commit": self.commit, "run": self.run_id,
                           "fetched": sorted(self.fetched), "released": sorted(self._released),
                           "downloaded_bytes": self.downloaded_bytes,
                           "peak_bytes": self.peak_bytes}, self._rank_state(self.rank))

    def _lock(self, name: str):
        """The inter-process lock ``hf_hub_download`` uses for a blob (or ours for the
        state), in ``<HF_HUB_CACHE>/.locks/models--org--name/``."""
        from filelock import FileLock

        d = self.root.parent / ".locks" / self.root.name
        d.mkdir(parents=True, exist_ok=True)
        return FileLock(str(d / f"{name}.lock"))

    def set_disk_budget(self, free_bytes: int) -> None:
        """``free_bytes``: free disk for downloads under the cache once the predicted output
        is reserved (``quantize.inspect.budget.check_free_disk``); the budget is that plus
        the bytes this build already downloaded, less :data:`SPARE`, at most --source-budget,
        divided among the ranks."""
        held = sum(self.listing[s]["size"] for s in self.fetched if self._on_disk(s))
        auto = max(0, free_bytes + held - SPARE)
        self.budget = auto if self.budget_limit is None else min(auto, self.budget_limit)

    def to_fetch(self) -> dict[str, int]:
        return {s: self.listing[s]["size"] for s in self.headers if not self._on_disk(s)}

    # ---- the plan and the background fetch -------------------------------------------
    def will_read(self, orders: list[list[str]], rank: int, todo: list[str]) -> None:
        """``orders``: every rank's shards in the order its stream first reads them;
        ``todo``: this rank's, without the shards an earlier run finished. Starts the
        background download of ``todo``; shards of ``orders[rank]`` not in ``todo`` are
        released at once (never read in this run)."""
        self.rank, self.world = rank, len(orders)
        self._readers = {}
        for r, order in enumerate(orders):
            for s in order:
                self._readers.setdefault(s, set()).add(r)
        if self.world > 1:
            self.budget = None if self.budget is None else self.budget // self.world
            with self._lock(f"spark-quant-{self.commit}"):
                self._save_state()
        self._order = list(todo)
        for s in orders[rank]:
            if s not in todo:
                self.release(s)
        self._thread = threading.Thread(target=self._prefetch, name="hub-fetch", daemon=True)
        self._thread.start()

    def _prefetch(self) -> None:
        for i, shard in enumerate(self._order):
            size = self.listing[shard]["size"]
            with self._cv:
                while not self._stop and i > self._demand and self.budget is not None \
                        and self._held and sum(self._held.values()) + size > self.budget:
                    self.idle.set()  # waiting for the converter to release a shard
                    self._cv.wait()
                if self._stop:
                    self.idle.set()
                    return
                if shard in self._released:  # the converter is done with it without a read
                    continue
                self.idle.clear()
            try:
                p = self._fetch(shard)
            except BaseException as e:  # raised in the converter when it asks for the shard
                with self._cv:
                    self._errors[shard] = e
                    self._cv.notify_all()
                self.idle.set()
                return
            with self._cv:
                self._ready[shard] = p
                late = shard in self._released
                self._cv.notify_all()
            if late:  # released while it downloaded: that release found nothing to delete
                self.release(shard)
        self.idle.set()

    def path(self, shard: str) -> Path:
        """The snapshot path of ``shard``, downloaded and verified (waiting for the
        background download when it is planned, else fetching it here).

        Raises:
            SourceError: the download fails, or the file's header or sha256 differs from what
                the Hub listed (the bad file is deleted).
        """
        if shard not in self._order or self._thread is None:
            with self._cv:
                if shard in self._ready:
                    return self._ready[shard]
            p = self._fetch(shard)
            with self._cv:
                self._ready[shard] = p
            return p
        with self._cv:
            self._demand = max(self._demand, self._order.index(shard))
            self._cv.notify_all()
            while shard not in self._ready:
                if shard in self._errors:
                    raise self._errors[shard]
                if self._thread is not None and not self._thread.is_alive() \
                        and shard not in self._ready:
                    if self._errors:  # an earlier shard's error stopped the thread
                        raise next(iter(self._errors.values()))
                    break
                self._cv.wait(1.0)
            if shard in self._ready:
                return self._ready[shard]
        return self._fetch(shard)

    def _note(self, event: str, shard: str) -> None:
        with self._cv:
            held = sum(self._held.values())
            self.trace.append((event, shard, held))
            cached = sum(self.listing[s]["size"] for s in self.headers
                         if s not in self._held and s not in self.fetched and self._on_disk(s))
            self.peak_bytes = max(self.peak_bytes, held + cached)

    def _fetch(self, shard: str) -> Path:
        """Download (or find in the cache) and verify ``shard``; return its snapshot path."""
        from quantize.hub.stream import Mismatch, blob_name, fetch_to_cache

        entry = self.listing[shard]
        name = blob_name(entry)
        with self._lock(name):
            ours = shard in self.fetched or self._fetched_elsewhere(shard)
            if self._on_disk(shard):
                if not ours:  # the user's cached copy: checked by reading it once
                    self._verify_cached(shard)
                elif shard not in self._held:
                    with self._cv:
                        self._held[shard] = entry["size"]
                self._note("cached", shard)
                return self.folder / shard
            with self._cv:
                self.fetched.add(shard)
                self._held[shard] = entry["size"]
            self._state_saved()  # before the bytes arrive: a crash mid-download stays ours
            self.downloaded_bytes += entry["size"]
            self._note("start", shard)
            for attempt in (1, 2):
                try:
                    with hub_errors(self.repo, self.commit):
                        p = fetch_to_cache(self.repo, self.commit, shard, entry, self.root)
                    break
                except Mismatch as e:
                    log.warning("Hub: shard %s: %s; downloading it again", shard, e)
                    if attempt == 2:
                        self._dropped(shard)
                        what = ("sha256 differs from the Hub's LFS sha256" if entry.get("sha256")
                                else "git blob id differs from the Hub's blob id")
                        raise SourceError(
                            f"shard {shard} of {self.repo}@{self.commit}: {what} {name} ({e}; "
                            "twice in a row); deleted it, run again to download it afresh",
                            shard=shard) from None
                except OSError as e:  # a full or read-only cache: name the shard and the fix
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                        raise
                    raise SourceError(f"cannot download shard {shard} of {self.repo} into the "
                                      f"cache {self.root}: {e}; free space there (or point "
                                      "HF_HOME at another disk) and rerun with --resume",
                                      shard=shard) from None
            self._check_header(shard, p)
            self._note("done", shard)
            return p

    def _fetched_elsewhere(self, shard: str) -> bool:
        """Another rank of this run recorded ``shard`` as downloaded by this build."""
        if self.world == 1:
            return False
        for f in self._state_files():
            data = json.loads(f.read_text())
            if data.get("commit") == self.commit and shard in data.get("fetched", []):
                with self._cv:
                    self.fetched.add(shard)
                return True
        return False

    def _state_saved(self) -> None:
        if self.world > 1:
            with self._lock(f"spark-quant-{self.commit}"):
                self._save_state()
        else:
            self._save_state()

    def _check_header(self, shard: str, p: Path) -> None:
        local = read_header(p)
        want = self.headers[shard]
        bad = sorted(n for n in set(local) | set(want)
                     if n not in local or n not in want
                     or (local[n].dtype, local[n].shape) != (want[n].dtype, want[n].shape))
        if bad:
            self._delete(shard)
            raise SourceError(f"shard {shard} of {self.repo}@{self.commit}: header differs from "
                              f"the one planned from the Hub (e.g. {bad[0]}); deleted it, run "
                              "again to download it afresh", shard=shard)

    def _verify_cached(self, shard: str) -> None:
        """A shard found in the cache (not downloaded by this build): header as planned and
        sha256 equal to the Hub's, from one read of the file."""
        p = self.folder / shard
        self._check_header(shard, p)
        sha = self.listing[shard].get("sha256")
        if sha and sha256_file(p) != sha:
            self._delete(shard)
            raise SourceError(f"shard {shard} of {self.repo}@{self.commit}: sha256 differs from "
                              f"the Hub's LFS sha256 {sha}; deleted it, run again to download "
                              "it afresh", shard=shard)

    def _dropped(self, shard: str) -> None:
        with self._cv:
            self._held.pop(shard, None)
            self._cv.notify_all()

    def _delete(self, shard: str) -> None:
        """Remove the snapshot entry and, when no other snapshot links to it, its blob."""
        pointer = self.folder / shard
        if pointer.exists() or pointer.is_symlink():
            blob = pointer.resolve()
            pointer.unlink()
            others = [p for p in self.root.glob("snapshots/*/**/*")
                      if p.is_symlink() and p.resolve() == blob]
            if blob != pointer and blob.is_file() and not others:
                blob.unlink()
        self._dropped(shard)  # off the budget once its bytes are gone

    def release(self, shard: str) -> None:
        with self._cv:
            self._ready.pop(shard, None)
            self._released.add(shard)  # the read-ahead no longer fetches it
        if self.world == 1:
            if shard in self.fetched and not self.keep and self._on_disk(shard):
                self._delete(shard)
                self._note("delete", shard)
            elif self.keep and shard in self._held:  # kept: stays on disk, within the budget
                pass
            return
        with self._lock(f"spark-quant-{self.commit}"):
            self._released.add(shard)
            self._save_state()
            others = {}
            for f in self._state_files():
                data = json.loads(f.read_text())
                if data.get("run") == self.run_id:
                    others[f.name] = data
            fetched = self.fetched.union(*(d.get("fetched", []) for d in others.values()))
            released = {r for r in self._readers.get(shard, ())
                        if shard in others.get(self._rank_state(r).name, {}).get("released", [])}
            last = released >= self._readers.get(shard, {self.rank})
            if last and shard in fetched and not self.keep and self._on_disk(shard):
                self._delete(shard)
                self._note("delete", shard)
            else:
                self._dropped(shard)  # this rank no longer holds it; its last reader deletes it

    def finish(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self.world == 1:
            self.state.unlink(missing_ok=True)
        else:
            with self._lock(f"spark-quant-{self.commit}"):
                self._save_state()

    def close(self) -> None:
        """Stop the background download (after an error)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def gather_ranks(self) -> None:
        """After a run of several ranks: add every rank's downloaded bytes and peak (their sum
        bounds the bytes on disk at once), delete what no rank deleted, remove the rank files."""
        runs = []
        for f in self._state_files():
            data = json.loads(f.read_text())
            if data.get("run") == self.run_id:
                runs.append(data)
                f.unlink()
        if not runs:
            return
        self.downloaded_bytes = sum(d.get("downloaded_bytes", 0) for d in runs)
        self.peak_bytes = sum(d.get("peak_bytes", 0) for d in runs)
        fetched = set().union(*(d.get("fetched", []) for d in runs))
        if not self.keep:
            for s in sorted(fetched):
                if self._on_disk(s):
                    self._delete(s)
        self.state.unlink(missing_ok=True)


def _remote_headers(api, repo: str, commit: str, shards: list[str],
                    snapshot: Path) -> dict[str, dict[str, TensorInfo]]:
    """Headers of ``shards``: read locally when cached, else one range request each."""
    def one(shard: str) -> dict[str, TensorInfo]:
        if (snapshot / shard).exists():
            return read_header(snapshot / shard)
        meta = api.parse_safetensors_file_metadata(repo, shard, revision=commit)
        return {n: TensorInfo(n, shard, t.dtype, tuple(int(d) for d in t.shape))
                for n, t in meta.tensors.items()}

    with ThreadPoolExecutor(HEADER_WORKERS) as pool:
        return dict(zip(shards, pool.map(one, shards)))


def _open_offline(repo: str, revision: str | None) -> tuple[Source, dict]:
    """The cached snapshot of ``repo@revision`` as a plain local source (nothing deleted)."""
    from huggingface_hub import metadata_load, snapshot_download

    with hub_errors(repo, revision):
        folder = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    try:
        source = open_source(folder)
    except SourceError as e:
        raise SourceError(f"offline (HF_HUB_OFFLINE=1) and the cached snapshot of {repo} is "
                          f"incomplete: {e}", shard=e.shard) from None
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "blob": p.resolve().name}
             for p in sorted(folder.rglob("*")) if p.is_file()}
    card = metadata_load(folder / "README.md") if (folder / "README.md").is_file() else None
    info = {"repo": repo, "revision": revision or "main", "commit": folder.name,
            **{k: (card or {}).get(k) for k in ("license", "license_name", "license_link")},
            "offline": True, "files": files}
    return source, info


def open_hub_source(ref: str, out: Path, *, keep_source: bool = False, budget: int | None = None
                    ) -> tuple[Source, dict, HubShards | None]:
    """Plan a conversion of the Hub repo ``ref`` (``ORG/NAME[@REVISION]``) without fetching
    any weight yet.

    Returns:
        (source, info, shards): ``source`` for ``convert``; ``info`` for the manifest (repo,
        revision, commit, license from the repo card, and every file's size, git blob id and
        LFS sha256); ``shards`` the fetcher (None offline), whose ``peak_bytes`` and
        ``downloaded_bytes`` report what the run did. ``budget``: most bytes of downloaded
        shards on disk at once (None: the free disk left after the predicted build).

    Raises:
        SourceError: naming the repo, revision, file or shard (not found, gated, no network,
            incomplete offline cache, missing shard file).
    """
    from huggingface_hub import HfApi, constants, hf_hub_download

    repo, revision = parse_repo_ref(ref)
    if constants.is_offline_mode():
        source, info = _open_offline(repo, revision)
        return source, info, None
    install_retries()
    api = HfApi()
    with hub_errors(repo, revision):
        model = api.model_info(repo, revision=revision, files_metadata=True)
        listing = {s.rfilename: {"size": s.size, "blob_id": s.blob_id,
                                 "sha256": s.lfs.sha256 if s.lfs else None}
                   for s in model.siblings or []}
        if "config.json" not in listing:
            raise SourceError(f"{repo}@{model.sha} has no config.json", key="config.json")
        # The user's revision (not the commit) for the first file, so the cache records the
        # branch -> commit ref that a later offline run resolves.
        snapshot = Path(hf_hub_download(repo, "config.json", revision=revision)).parent
        if snapshot.name != model.sha:
            raise SourceError(f"{repo}@{revision} moved to {snapshot.name} while starting "
                              f"(listed {model.sha}); run again or pin @COMMIT")
        small = [f for f, m in listing.items() if not _is_weight(f) and f != "config.json"
                 and not Path(f).name.startswith(".") and (m["size"] or 0) <= SMALL_FILE_MAX]
        for f in small:
            hf_hub_download(repo, f, revision=model.sha)
        if INDEX_NAME in listing:
            weight_map = json.loads((snapshot / INDEX_NAME).read_text()).get("weight_map") or {}
            shards = sorted(set(weight_map.values()))
        elif SINGLE_NAME in listing:
            shards = [SINGLE_NAME]
        else:
            raise SourceError(f"{repo}@{model.sha} has no {INDEX_NAME} or {SINGLE_NAME}")
        missing = [s for s in shards if s not in listing]
        if missing:
            raise SourceError(f"{repo}@{model.sha}: the index names shard files the repo does "
                              f"not have: {', '.join(missing)}", shard=missing[0])
        if shards == [SINGLE_NAME]:
            hf_hub_download(repo, SINGLE_NAME, revision=model.sha)
        headers = _remote_headers(api, repo, model.sha, shards, snapshot)
    shard_files = HubShards(repo, model.sha, snapshot, listing, headers, Path(out) / STATE_NAME,
                            keep=keep_source or shards == [SINGLE_NAME], budget=budget)
    source = open_source(snapshot, shard_files)
    card = model.card_data
    info = {"repo": repo, "revision": revision or "main", "commit": model.sha,
            **{k: getattr(card, k, None) for k in ("license", "license_name", "license_link")},
            "files": dict(sorted(listing.items()))}
    return source, info, shard_files
