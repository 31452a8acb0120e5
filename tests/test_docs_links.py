"""Every relative link of the tracked Markdown files (README.md, RESULTS.md, docs/**) resolves to a
tracked file (and its heading), every "docs/algorithm.md section N" citation names a numbered
section of that page, and RESULTS.md is what `python -m exittrain report --results` makes of
results/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from exittrain.report import results_markdown, results_page

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
ALGORITHM = "docs/algorithm.md"
# the page's path, then: section 4, sections 4 and 5(d), sections 6-8, section 6.5, or § 7
_SECTION_REF = r"\d+(?:\.\d+)*(?:\([a-z]\))?"
_CITATION = re.compile(
    rf"docs/algorithm\.md[,:;]?\s*(?:§\s*|sections?\s+)({_SECTION_REF}(?:\s*(?:,|-|–|and|&|to)\s*{_SECTION_REF})*)",
    re.I,
)
_NUMBERED = re.compile(r"^#{2,6}\s+(\d+(?:\.\d+)*)\.?\s", re.M)


def tracked_files(root: Path) -> set[str]:
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return {p for p in out.decode().split("\0") if p}


def heading_slugs(markdown: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings (GitHub's rule: lower case, punctuation
    dropped, spaces to dashes, repeats numbered)."""
    slugs, seen = set(), {}
    for title in _HEADING.findall(_FENCE.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def broken_links(root: Path, tracked: set[str]) -> list[str]:
    """``FILE: TARGET (why)`` for every relative link of a tracked .md file that does not resolve."""
    dirs = {str(Path(p).parent) for p in tracked}
    dirs |= {str(parent) for d in list(dirs) for parent in Path(d).parents}
    bad = []
    for md in sorted(p for p in tracked if p.endswith(".md")):
        text = (root / md).read_text(encoding="utf-8")
        prose = _INLINE_CODE.sub("", _FENCE.sub("", text))
        for target in _LINK.findall(prose) + _REF_LINK.findall(prose):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            if path.startswith("/"):
                bad.append(f"{md}: {target} (an absolute path: link relative to the file)")
                continue
            rel = Path(md).parent / path if path else Path(md)
            resolved = Path(*[p for p in _normalise(rel.as_posix()).split("/") if p]) if path else Path(md)
            key = resolved.as_posix()
            if key.startswith(".."):
                bad.append(f"{md}: {target} (outside the repository)")
            elif key not in tracked and key.rstrip("/") not in dirs:
                bad.append(f"{md}: {target} (no tracked file {key})")
            elif anchor and key.endswith(".md") and anchor not in heading_slugs((root / key).read_text("utf-8")):
                bad.append(f"{md}: {target} (no heading '#{anchor}' in {key})")
    return bad


def numbered_sections(markdown: str) -> set[str]:
    """The numbers of the numbered headings (``## 4. Title``, ``### 6.5 Title``) outside fences."""
    return set(_NUMBERED.findall(_FENCE.sub("", markdown)))


def bad_section_citations(root: Path, tracked: set[str]) -> list[str]:
    """``FILE: CITATION (why)`` for every "docs/algorithm.md section N" of a tracked .py or .md file
    whose section N (or N.M) has no numbered heading in docs/algorithm.md."""
    page = root / ALGORITHM
    sections = numbered_sections(page.read_text(encoding="utf-8")) if page.is_file() else set()
    bad = []
    for name in sorted(p for p in tracked if p.endswith((".py", ".md"))):
        path = root / name
        if not path.is_file():  # tracked but deleted in the working tree
            continue
        for match in _CITATION.finditer(path.read_text(encoding="utf-8", errors="replace")):
            for number in re.findall(r"\d+(?:\.\d+)*", match.group(1)):
                if number not in sections:
                    bad.append(f"{name}: {' '.join(match.group(0).split())} (no section {number} in {ALGORITHM})")
    return bad


def _normalise(posix: str) -> str:
    parts: list[str] = []
    for part in posix.split("/"):
        if part in ("", "."):
            continue
        if part == ".." and parts and parts[-1] != "..":
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def test_every_relative_link_resolves_to_a_tracked_file():
    tracked = tracked_files(ROOT)
    assert "README.md" in tracked and "RESULTS.md" in tracked and ALGORITHM in tracked
    assert not broken_links(ROOT, tracked), "\n".join(broken_links(ROOT, tracked))


def test_algorithm_citations_name_existing_sections():
    tracked = tracked_files(ROOT)
    assert numbered_sections((ROOT / ALGORITHM).read_text(encoding="utf-8")), f"{ALGORITHM} has no numbered sections"
    assert not bad_section_citations(ROOT, tracked), "\n".join(bad_section_citations(ROOT, tracked))


def test_the_checker_sees_bad_section_citations(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / ALGORITHM).write_text(
        "# The algorithm\n\n## 1. Notation\n\n### 1.2 Trees\n\n## 2. The exit law\n\n```\n## 9. fenced\n```\n"
    )
    page = ALGORITHM  # never spelt out with a section here: this file's own text is scanned too
    (tmp_path / "m.py").write_text(
        f'"""See {page} section 1, {page} sections 1.2 and 2(d), {page}: section 1-2,\n'
        f'({page}\n    section 3), {page} section 1.3 and {page} §9."""\n'
    )
    (tmp_path / "untracked.py").write_text(f"{page} section 7\n")
    bad = bad_section_citations(tmp_path, {ALGORITHM, "m.py"})
    assert [b.split(" (")[0] for b in bad] == [
        f"m.py: {page} section 3", f"m.py: {page} section 1.3", f"m.py: {page} §9",
    ]


def test_the_checker_sees_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title here\n\n## A `code` part\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok too](docs/a.md#a-code-part) [up](docs/../README.md) [dir](docs/)\n"
        "[gone](docs/results/ablation/) [no anchor](docs/a.md#missing) [out](../shared/x.md)\n"
        "[abs](/etc/passwd) [web](https://example.com/x) `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n[ref]: untracked.md\n"
    )
    (tmp_path / "untracked.md").write_text("x")
    bad = broken_links(tmp_path, {"README.md", "docs/a.md"})
    assert [b.split(" (")[0] for b in bad] == [
        "README.md: docs/results/ablation/", "README.md: docs/a.md#missing", "README.md: ../shared/x.md",
        "README.md: /etc/passwd", "README.md: untracked.md",
    ]


def test_results_page_is_what_results_gives():
    page = (ROOT / "RESULTS.md").read_text(encoding="utf-8")
    fresh = results_markdown.render_page(results_page.load_results(ROOT / "results"),
                                         results_page.load_page(ROOT / "results"))
    assert page == fresh, "RESULTS.md is stale: run `python -m exittrain report --results` and commit it"
    assert "BENCHMARKS.md" not in (ROOT / "README.md").read_text(encoding="utf-8")
