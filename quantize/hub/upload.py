"""``quantize upload``: publish a finished build to the Hub behind its eval gate.

Order, so that nothing reaches the Hub before every check has passed:

1. the build is finished (manifest present, no resume ledger, files as the manifest lists);
2. the eval gate (``eval/report.json``) passed as a release gate (a finished run on every
   problem, against a baseline, with the default suites: ``gate.release``), or ``--force``
   (stated in the card);
3. the card is rendered and its metadata checked locally (``quantize.hub.card.validate_card``);
4. ``--dry-run`` stops here and returns the card and the file plan (a gate that would refuse
   the upload without ``--force`` does not stop a dry run, which sends nothing: the plan says
   it would refuse, and the card is the one ``--force`` would publish);
5. the Hub checks the card (``ModelCard.validate``, ``/api/validate-yaml``) — FC-33;
6. ``create_repo`` (``--private``), ``create_branch`` (``--revision``), then the build's files
   and the card as ``README.md`` in one ``HfApi.create_commit``: the blobs are uploaded first
   (LFS objects, or Xet chunks with ``hf_xet``, already stored are not sent again when a
   re-run resumes an interrupted upload) and the one commit makes weights and card appear
   together, so a repo never shows weights without their card nor a card without weights.

Every Hub call retries 429 / 5xx with bounded backoff (``quantize.hub.retry``); a file over
:data:`HUB_FILE_LIMIT` is refused before any byte is sent.

The build's own ``README.md`` (the source's card, carried by the converter) is not uploaded:
the rendered card replaces it. Hidden files (resume ledgers, caches) are not uploaded.
"""

from dataclasses import dataclass, field
from pathlib import Path

from quantize.base.errors import CardError, GateFailed, OutputError
from formats.manifest import EVAL_FOLDER, MANIFEST_NAME
from formats.shards import sha256_file
from quantize.hub.card import PLAN, load_build, read_gate, render_card, validate_card
from quantize.hub.download import hub_errors
from quantize.hub.retry import install as install_retries

__all__ = ["Upload", "upload_build", "file_plan", "HUB_FILE_LIMIT", "check_file_sizes"]

HUB_FILE_LIMIT = 50 * 10**9
"""Largest file the Hub accepts (50 GB, its documented per-file limit; docs/faults.md)."""


def check_file_sizes(files: list[tuple[str, int]], limit: int | None = None) -> None:
    """Refuse files over the Hub's per-file limit before anything is sent.

    Raises:
        OutputError: naming each file and its size, with the fix (smaller shards).
    """
    limit = HUB_FILE_LIMIT if limit is None else limit
    big = [(rel, n) for rel, n in files if n > limit]
    if big:
        listed = ", ".join(f"{rel} ({n / 1e9:.1f} GB)" for rel, n in big)
        raise OutputError(f"{len(big)} file(s) exceed the Hub's per-file limit of "
                          f"{limit / 1e9:g} GB: {listed}; nothing was uploaded. Re-shard the "
                          "build into smaller files (convert from a source with smaller shards)",
                          key=big[0][0])


@dataclass
class Upload:
    """What an upload did (or, with ``dry_run``, would do)."""

    repo_id: str
    revision: str
    card: str
    files: list[tuple[str, int]]
    forced: str | None = None
    commit_url: str | None = None
    notes: list[str] = field(default_factory=list)
    refused: str | None = None  # dry run: why the upload would be refused without --force

    def render(self) -> str:
        total = sum(n for _, n in self.files) + len(self.card.encode())
        lines = [f"file plan for {self.repo_id} (revision {self.revision}): {len(self.files) + 1} "
                 f"files, {total / 2**20:.1f} MiB"]
        lines += [f"  {n:>14,}  {rel}" for rel, n in self.files]
        lines.append(f"  {len(self.card.encode()):>14,}  README.md (rendered card, committed with the weights)")
        if self.refused:
            lines.append(f"  without --force: would refuse: {self.refused}")
        elif self.forced:
            lines.append(f"  --force: {self.forced}")
        lines += [f"  note: {n}" for n in self.notes]
        if self.commit_url:
            lines.append(f"committed: {self.commit_url}")
        return "\n".join(lines)


def file_plan(build: Path) -> list[tuple[str, int]]:
    """(relative path, bytes) of every build file that is uploaded, sorted."""
    build = Path(build)
    out = []
    for p in sorted(build.rglob("*")):
        rel = p.relative_to(build)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts) \
                and str(rel) != "README.md" and not p.name.endswith(".tmp"):
            out.append((rel.as_posix(), p.stat().st_size))
    return out


def _check_repo_id(repo_id: str) -> None:
    """Raises OutputError: ``repo_id`` is not ``ORG/NAME`` as the Hub spells repo ids
    (huggingface_hub's ``validate_repo_id``), before the card names it or any call is made."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
        if repo_id.count("/") != 1:
            raise HFValidationError("it must be ORG/NAME (your user or organization, a slash, the model name)")
    except HFValidationError as e:
        raise OutputError(f"--repo {repo_id!r} is not a Hub repo id: {e}", key="repo") from None


def check_build_files(build: Path, manifest: dict, files: list[tuple[str, int]]) -> None:
    """What an upload sends is the build the manifest describes: every file the manifest lists
    has its sha256 (read from disk: a flipped byte after the build is caught here, not by the
    user of the published repo), and nothing else is sent but what quantize writes into a
    finished build (its manifest, ``eval/``, ``plan.json``).

    Raises:
        OutputError: naming the first file whose sha256 differs, or the files the manifest
            does not list (nothing is uploaded).
    """
    listed = manifest.get("files", {})
    own = {MANIFEST_NAME, PLAN.as_posix()}
    extra = [rel for rel, _ in files
             if rel not in listed and rel not in own and not rel.startswith(EVAL_FOLDER + "/")]
    if extra:
        raise OutputError(f"{build} holds {len(extra)} file(s) its manifest does not list ({', '.join(extra[:3])}"
                          f"{', ...' if len(extra) > 3 else ''}): an upload sends only the build's own "
                          "files; move them out of the folder (nothing was uploaded)", key=extra[0])
    for rel, meta in sorted(listed.items()):
        if sha256_file(build / rel) != meta.get("sha256"):
            raise OutputError(f"{rel} in {build} is not the file the build wrote (its sha256 differs "
                              f"from the manifest's); `quantize verify {build}` shows what changed: "
                              "rebuild, or restore the file (nothing was uploaded)", key=rel)


def _advice(report: dict | None) -> str:
    """What to do about a gate that does not allow a release."""
    if report is None:
        return "Run `quantize eval BUILD --baseline SRC` first"
    if report.get("complete") is False:
        return "Re-run `quantize eval` to the end"
    if (report.get("gate") or {}).get("passed"):
        return ("Re-run `quantize eval` as a release gate (every problem, no --limit; --baseline; "
                "the default suites)")
    return ("The build failed its checks (see eval/report.md): fix the build (recipe, calibration) "
            "and evaluate it again")


def upload_build(build: str | Path, repo_id: str, *, private: bool = False,
                 revision: str | None = None, dry_run: bool = False, force: bool = False,
                 base_model: str | None = None, license: str | None = None) -> Upload:
    """Publish ``build`` to the Hub model repo ``repo_id``.

    Args:
        build: a finished ``quantize nvfp4`` output folder.
        repo_id: ``ORG/NAME``; created if missing (``private`` applies then).
        revision: branch to commit to (created from ``main`` if missing); default ``main``.
        dry_run: check and render only; nothing is sent, so a gate that does not allow the
            upload refuses nothing: ``refused`` says what would be refused without ``force``,
            and the card is the one ``force`` would publish.
        force: publish although the eval gate is missing, failed, unfinished or partial
            (stated in the card).
        base_model, license: override what the build's provenance says.

    Returns:
        Upload with the card text, the file plan and (unless ``dry_run``) the commit URL.

    Raises:
        OutputError: the build is unfinished or changed. GateFailed: gate missing, failed,
        unfinished or not a release gate, without ``force`` or ``dry_run`` (the message says
        which and what to do). CardError: card metadata invalid, locally or per the Hub (nothing
        uploaded). OutputError: the Hub refused or could not be reached (the message says
        which; re-running resumes).
    """
    build = Path(build)
    _check_repo_id(repo_id)
    info = load_build(build)
    passed, verdict = read_gate(info["report"])
    refusal = (None if passed or force else
               f"eval gate {verdict}. {_advice(info['report'])}, or pass --force to publish anyway "
               "(the card will say so)")
    if refusal and not dry_run:
        raise GateFailed(f"refusing to upload {build}: {refusal}", key="gate")
    forced = None if passed else verdict
    card = render_card(build, repo_id, base_model=base_model, license=license, forced=forced,
                       info=info)
    text = str(card)
    validate_card(text)
    up = Upload(repo_id, revision or "main", text, file_plan(build), forced, refused=refusal)
    check_file_sizes(up.files)
    check_build_files(build, info["manifest"], up.files)
    if dry_run:
        return up

    from huggingface_hub import CommitOperationAdd, HfApi

    install_retries()
    with hub_errors(repo_id, revision, OutputError):
        try:
            card.validate(repo_type="model")
        except ValueError as e:
            raise CardError(f"the Hub rejected the card's metadata (nothing was uploaded): {e}",
                            key="metadata") from None
        api = HfApi()
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(build / rel))
               for rel, _ in up.files]
        ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=text.encode()))
        commit = api.create_commit(repo_id=repo_id, operations=ops, revision=revision,
                                   commit_message="Upload NVFP4 build and model card (spark-quant)")
    up.commit_url = commit.commit_url
    return up
