"""``quantize upload``: publish a finished build to the Hub behind its eval gate.

Order, so that nothing reaches the Hub before every check has passed:

1. the build is finished (manifest present, no resume ledger, files as the manifest lists);
2. the eval gate (``eval/report.json``) passed as a release gate (a finished run on every
   problem, against a baseline, with the default suites: ``gate.release``), or ``--force``
   (stated in the card);
3. the card is rendered and its metadata checked locally (``quantize.hub.card.validate_card``);
4. ``--dry-run`` stops here and returns the card and the file plan;
5. the Hub checks the card (``ModelCard.validate``, ``/api/validate-yaml``) — FC-33;
6. ``create_repo`` (``--private``), ``create_branch`` (``--revision``), then the build's files
   with ``HfApi.upload_folder`` (huggingface_hub's large-folder path: with ``hf_xet`` it streams
   through Xet in several commits, and re-running after an interruption skips committed files
   and already-uploaded chunks; without it, LFS objects already stored are not sent again), and
   last the card as ``README.md``, so a repo never shows a card without its weights.

The build's own ``README.md`` (the source's card, carried by the converter) is not uploaded:
the rendered card replaces it. Hidden files (resume ledgers, caches) are not uploaded.
"""

from dataclasses import dataclass, field
from pathlib import Path

from quantize.base.errors import CardError, GateFailed, OutputError
from quantize.hub.card import load_build, read_gate, render_card, validate_card
from quantize.hub.download import hub_errors

__all__ = ["Upload", "upload_build", "file_plan"]


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

    def render(self) -> str:
        total = sum(n for _, n in self.files) + len(self.card.encode())
        lines = [f"file plan for {self.repo_id} (revision {self.revision}): {len(self.files) + 1} "
                 f"files, {total / 2**20:.1f} MiB"]
        lines += [f"  {n:>14,}  {rel}" for rel, n in self.files]
        lines.append(f"  {len(self.card.encode()):>14,}  README.md (rendered card, uploaded last)")
        if self.forced:
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
        dry_run: check and render only; nothing is sent.
        force: publish although the eval gate is missing, failed, unfinished or partial
            (stated in the card).
        base_model, license: override what the build's provenance says.

    Returns:
        Upload with the card text, the file plan and (unless ``dry_run``) the commit URL.

    Raises:
        OutputError: the build is unfinished or changed. GateFailed: gate missing, failed,
        unfinished or not a release gate, without ``force`` (the message says which and what to
        do). CardError: card metadata invalid, locally or per the Hub (nothing
        uploaded). OutputError: the Hub refused or could not be reached (the message says
        which; re-running resumes).
    """
    build = Path(build)
    info = load_build(build)
    passed, verdict = read_gate(info["report"])
    if not passed and not force:
        raise GateFailed(f"refusing to upload {build}: eval gate {verdict}. "
                         f"{_advice(info['report'])}, or pass --force to publish anyway (the card "
                         "will say so)", key="gate")
    forced = None if passed else verdict
    card = render_card(build, repo_id, base_model=base_model, license=license, forced=forced,
                       info=info)
    text = str(card)
    validate_card(text)
    up = Upload(repo_id, revision or "main", text, file_plan(build), forced)
    if dry_run:
        return up

    from huggingface_hub import HfApi

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
        api.upload_folder(repo_id=repo_id, folder_path=build, revision=revision,
                          allow_patterns=[rel for rel, _ in up.files],
                          commit_message="Upload NVFP4 build (spark-quant)")
        commit = api.upload_file(path_or_fileobj=text.encode(), path_in_repo="README.md",
                                 repo_id=repo_id, revision=revision,
                                 commit_message="Model card (spark-quant)")
    up.commit_url = commit.commit_url
    return up
