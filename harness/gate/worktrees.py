"""Git revisions as checkouts the gate can run: each a detached worktree of the repository, removed
when the gate ends, however it ends."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from harness.gate.files import GateError


def git(repo: Path, *args: str) -> str:
    try:
        proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=120, check=False)
    except FileNotFoundError:
        raise GateError("git is not installed; the gate checks revisions out with it") from None
    if proc.returncode != 0:
        raise GateError(f"git {' '.join(args)} failed in {repo}: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc.stdout.strip()


def toplevel(path: Path) -> Path:
    return Path(git(path, "rev-parse", "--show-toplevel"))


def resolve(repo: Path, rev: str) -> str:
    """The full commit sha ``rev`` names in ``repo``; a GateError naming it if none."""
    if not rev or rev.startswith("-"):
        raise GateError(f"{rev!r} is not a revision")
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except GateError:
        raise GateError(f"{rev!r} names no commit in {repo} (fetch it first, e.g. "
                        f"`git fetch origin {rev}`, or check out with full history)") from None


@contextlib.contextmanager
def checkouts(repo: Path, shas: dict[str, str]) -> Iterator[dict[str, Path]]:
    """One detached worktree per entry of ``shas`` (name -> commit), in a temporary directory;
    all removed on exit (and pruned from the repository's worktree list)."""
    root = Path(tempfile.mkdtemp(prefix="packbench-gate-"))
    made: list[Path] = []
    try:
        trees = {}
        for name, sha in shas.items():
            tree = root / name
            git(repo, "worktree", "add", "--detach", "--quiet", str(tree), sha)
            made.append(tree)
            trees[name] = tree
        yield trees
    finally:
        for tree in made:
            with contextlib.suppress(GateError):
                git(repo, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(GateError):
            git(repo, "worktree", "prune")
