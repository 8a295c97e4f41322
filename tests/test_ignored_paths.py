"""No tracked path of the project is hidden by an ignore file a contributor commonly has.

GitHub's Python, Rust and Maven templates ignore `target/` (Rust's `target` at any depth), and many
global excludes files copy them: a package folder with such a name would have its new files left out
of `git status` and `git add -A`, and skipped by ripgrep and fd. Each template (tests/gitignore_templates/,
copied unchanged) is applied with `git check-ignore --no-index` to every tracked path, from an empty
repository so that only the template's patterns count.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = sorted((Path(__file__).parent / "gitignore_templates").glob("*.gitignore"))


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the project's git checkout (the paths git tracks)")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [p for p in out.decode().split("\0") if p]


def _hidden(template: Path, paths: list[str], empty_repo: Path) -> list[str]:
    result = subprocess.run(
        [
            "git",
            "-c",
            f"core.excludesFile={template}",
            "check-ignore",
            "--no-index",
            "--stdin",
            "-v",
        ],
        cwd=empty_repo,
        input="\n".join(paths) + "\n",
        capture_output=True,
        text=True,
    )
    assert result.returncode in (0, 1), result.stderr  # 1: nothing matched
    return result.stdout.splitlines()


def test_the_four_templates_are_here():
    assert [t.stem for t in TEMPLATES] == ["Maven", "Node", "Python", "Rust"]


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.stem)
def test_no_tracked_path_is_ignored_by_a_common_template(template, tracked, tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert "spec_cli/cli.py" in tracked
    assert _hidden(template, tracked, tmp_path) == []


def test_the_check_sees_a_folder_the_templates_hide(tmp_path):
    """The check itself: a package folder named `target` is reported by the three that ignore it."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    hidden = {t.stem for t in TEMPLATES if _hidden(t, ["spec_cli/target/loading.py"], tmp_path)}
    assert hidden == {"Python", "Rust", "Maven"}
