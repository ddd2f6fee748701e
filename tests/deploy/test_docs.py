"""The documentation site builds with every warning an error (broken links and anchors, pages
missing from the nav), and the README stays a front door: short, undated, and every link in it
leads somewhere, two clicks from deploying with the chart and from configuring an alias."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

from tests.deploy.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
CHART_README_URL = "https://github.com/ratchet/ratchet/blob/main/helm/ratchet/README.md"

# [text](target) with a target that is not a URL; images included.
RELATIVE_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)
# `some/path.py` in code spans: a file or folder of this repository the text names.
NAMED_PATH = re.compile(r"`([A-Za-z_.][\w.\-]*/[\w./\-]*)`")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of `config` into `site`, as CI runs it."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
        # Material's banner about its successor is not a warning of ours.
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def anchors_of(page: Path) -> set[str]:
    """The heading ids Python-Markdown's toc gives a page (what mkdocs serves as #anchors)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slugify(re.sub(r"[`*]", "", title), "-") for title in HEADING.findall(text)}


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    built = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    warnings = [line for line in built.stderr.splitlines() if "WARNING" in line]
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "reference" / "settings" / "index.html").exists()


def test_docs_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    """Strict link checking is on: a link to a missing page or anchor stops the build."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[gone](gone.md) [x](index.md#nope)\n")
    config = (ROOT / "mkdocs.yml").read_text()
    config = config[: config.index("\nnav:")] + "\nnav:\n  - index.md\n"
    (tmp_path / "mkdocs.yml").write_text(config)
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "gone.md" in built.stderr and "#nope" in built.stderr


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    text = README.read_text()
    # Measurements and the commits they ran at live in docs/results/, not here.
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), "a dated measurement in the README"
    assert not re.findall(r"`[0-9a-f]{7,40}`", text), "a commit hash in the README"


def test_every_readme_link_leads_somewhere() -> None:
    for target in RELATIVE_LINK.findall(README.read_text()):
        path, _, anchor = target.partition("#")
        page = ROOT / path
        assert page.exists(), f"README links {target}, which does not exist"
        if anchor and page.suffix == ".md":
            assert anchor in anchors_of(page), f"README links {target}: no such heading"


def test_two_clicks_to_the_chart_and_to_an_alias() -> None:
    """README -> docs/deploying.md -> the chart's README; README -> configuring an alias."""
    readme_links = set(RELATIVE_LINK.findall(README.read_text()))
    assert "docs/deploying.md" in readme_links
    assert CHART_README_URL in (DOCS / "deploying.md").read_text()
    assert "docs/configuration.md#configuring-an-alias" in readme_links
    assert "configuring-an-alias" in anchors_of(DOCS / "configuration.md")


def test_every_repository_path_the_docs_name_exists() -> None:
    """A module that moves takes its mentions along: `learner/round.py` in a page must exist."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    top_folders = {path.split("/")[0] for path in tracked if "/" in path}
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    missing = []
    for page in pages:
        for named in NAMED_PATH.findall(page.read_text()):
            path = named.rstrip("/")
            # Only paths into this repository's folders; not run outputs (bench/results/).
            if path.split("/")[0] not in top_folders or path.startswith("bench/results"):
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {named}")
    assert not missing, "\n".join(missing)
