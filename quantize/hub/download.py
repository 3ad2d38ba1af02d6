"""The Hugging Face Hub, through ``huggingface_hub`` only: stream a source shard by shard
within a disk budget, and publish a build behind its eval gate.

Download (``--src ORG/NAME[@REVISION]``): the revision is resolved to a commit and the file
list (sizes, LFS sha256) read with one ``model_info`` call; the small files (config, index,
tokenizer, license, code) are downloaded; every shard header is read with an HTTP range
request (or from the cache), so the whole job is planned and validated before any weight is
fetched. Shards are then downloaded into the Hugging Face cache when the converter first reads
them, checked (header identical to the planned one, sha256 equal to the Hub's LFS sha256), and
deleted once no later shard reads them; a shard that was already in the cache is the user's and
is never deleted. ``HF_TOKEN``, ``HF_HOME``/``HF_HUB_CACHE``, ``HF_ENDPOINT`` and
``HF_HUB_OFFLINE`` act as they do for every ``huggingface_hub`` program; offline, the source
is the cached snapshot and nothing is deleted.

Which shards this build downloaded (and may delete) is written to ``<out>/.spark-quant-hub.json``
before each download, so an interrupted run resumes without re-downloading a shard still in the
cache and still deletes what it fetched; the file is removed when the last shard is done.
"""

import errno
import json
import re
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
    """Shards of one Hub commit: headers known up front, files fetched on first read into the
    Hugging Face cache and deleted after their last read (unless kept or already cached)."""

    def __init__(self, repo: str, commit: str, snapshot: Path, listing: dict[str, dict],
                 headers: dict[str, dict[str, TensorInfo]], state: Path, keep: bool):
        super().__init__(snapshot)
        self.check_on_open = False
        self.root = snapshot.parent.parent  # models--org--name/
        self.repo, self.commit, self.listing, self.headers = repo, commit, listing, headers
        self.state, self.keep = Path(state), keep
        self.fetched: set[str] = set()  # shards this build downloaded (may delete)
        if self.state.is_file():
            data = json.loads(self.state.read_text())
            if data.get("repo") == repo and data.get("commit") == commit:
                self.fetched = set(data.get("fetched", []))
        self._ready: dict[str, Path] = {}
        self.downloaded_bytes = 0
        self.peak_bytes = 0  # most source-shard bytes on disk at once during this run

    def header(self, shard: str) -> dict[str, TensorInfo]:
        return self.headers[shard]

    def identity(self, shard: str) -> list:
        """[size, sha256] from the Hub listing: the same bytes whether or not on disk."""
        m = self.listing[shard]
        return [m["size"], m.get("sha256") or m.get("blob_id")]

    def _on_disk(self, shard: str) -> bool:
        return (self.folder / shard).exists()

    def _save_state(self) -> None:
        write_json_atomic({"repo": self.repo, "commit": self.commit,
                           "fetched": sorted(self.fetched)}, self.state)

    def to_fetch(self) -> dict[str, int]:
        return {s: self.listing[s]["size"] for s in self.headers if not self._on_disk(s)}

    def path(self, shard: str) -> Path:
        """Download ``shard`` if it is not in the cache, verify it, return its snapshot path.

        Raises:
            SourceError: the download fails, or the file's header or sha256 differs from what
                the Hub listed (the bad file is deleted).
        """
        if shard in self._ready:
            return self._ready[shard]
        from huggingface_hub import hf_hub_download

        if not self._on_disk(shard):
            self.fetched.add(shard)
            self._save_state()  # before the bytes arrive: a crash mid-download stays ours
            self.downloaded_bytes += self.listing[shard]["size"]
        try:
            with hub_errors(self.repo, self.commit):
                p = Path(hf_hub_download(self.repo, shard, revision=self.commit))
        except OSError as e:  # a full or read-only download cache: name the shard and the fix
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                raise
            raise SourceError(f"cannot download shard {shard} of {self.repo} into the cache "
                              f"{self.root}: {e}; free space there (or point HF_HOME at another "
                              "disk) and rerun with --resume", shard=shard) from None
        self._verify(shard, p)
        self._ready[shard] = p
        on_disk = sum(self.listing[s]["size"] for s in self.headers if self._on_disk(s))
        self.peak_bytes = max(self.peak_bytes, on_disk)
        return p

    def _verify(self, shard: str, p: Path) -> None:
        local = read_header(p)
        want = self.headers[shard]
        bad = sorted(n for n in set(local) | set(want)
                     if n not in local or n not in want
                     or (local[n].dtype, local[n].shape) != (want[n].dtype, want[n].shape))
        sha = self.listing[shard].get("sha256")
        problem = None
        if bad:
            problem = f"header differs from the one planned from the Hub (e.g. {bad[0]})"
        elif sha and sha256_file(p) != sha:
            problem = f"sha256 differs from the Hub's LFS sha256 {sha}"
        if problem:
            self._delete(shard)
            raise SourceError(f"shard {shard} of {self.repo}@{self.commit}: {problem}; deleted "
                              "it, run again to download it afresh", shard=shard)

    def _delete(self, shard: str) -> None:
        """Remove the snapshot entry and, when no other snapshot links to it, its blob."""
        pointer = self.folder / shard
        if not pointer.exists() and not pointer.is_symlink():
            return
        blob = pointer.resolve()
        pointer.unlink()
        others = [p for p in self.root.glob("snapshots/*/**/*")
                  if p.is_symlink() and p.resolve() == blob]
        if blob != pointer and blob.is_file() and not others:
            blob.unlink()

    def release(self, shard: str) -> None:
        self._ready.pop(shard, None)
        if shard in self.fetched and not self.keep and self._on_disk(shard):
            self._delete(shard)

    def finish(self) -> None:
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


def open_hub_source(ref: str, out: Path, *, keep_source: bool = False
                    ) -> tuple[Source, dict, HubShards | None]:
    """Plan a conversion of the Hub repo ``ref`` (``ORG/NAME[@REVISION]``) without fetching
    any weight yet.

    Returns:
        (source, info, shards): ``source`` for ``convert``; ``info`` for the manifest (repo,
        revision, commit, license from the repo card, and every file's size, git blob id and
        LFS sha256); ``shards`` the fetcher (None offline), whose ``peak_bytes`` and
        ``downloaded_bytes`` report what the run did.

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
                            keep=keep_source or shards == [SINGLE_NAME])
    source = open_source(snapshot, shard_files)
    card = model.card_data
    info = {"repo": repo, "revision": revision or "main", "commit": model.sha,
            **{k: getattr(card, k, None) for k in ("license", "license_name", "license_link")},
            "files": dict(sorted(listing.items()))}
    return source, info, shard_files
