"""Documentation links resolve inside the repository, and nothing names a work period.

Every `*.md` path and every `docs/...` path cited in README.md, docs/, trtssd/, tests/ and scripts/
must exist in the checkout (a reader follows them); a path under /work/shared or any other place
outside the repository must not be cited at all. Text says what a thing is, not when it was done:
no "session <n>" or "issue <n>", and no docs/bench folder named `session*` or `*-s<n>`.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".toml", ".yaml", ".yml", ".cpp", ".h", ""}

# A relative repository path: docs/..., or any path ending in .md (markdown links included).
DOCS_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*[\w/])")
# Bare names (results.md, compare.md) are output files of a run, not citations: a path needs a folder.
MD_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.md)(?![\w])")
MD_LINK = re.compile(r"\]\(([^)\s#]+)")
WORK_PERIOD = re.compile(r"\b(session|issue)\s*#?\d", re.IGNORECASE)
OUTSIDE = re.compile(r"/work/shared")


def _files():
    roots = [REPO / "README.md", REPO / "docs", REPO / "trtssd", REPO / "tests", REPO / "scripts"]
    for root in roots:
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for p in paths:
            if not p.is_file() or "__pycache__" in p.parts or p.suffix not in TEXT_SUFFIXES:
                continue
            if p.name == Path(__file__).name:
                continue  # this file spells out the patterns it forbids
            if root.name == "docs" and "bench" in p.relative_to(root).parts and p.suffix != ".md":
                continue  # recorded run outputs (json, logs) hold machine paths, not citations
            yield p


def _text(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def _cited(text: str) -> set[str]:
    found = set(DOCS_PATH.findall(text)) | set(MD_PATH.findall(text))
    found |= {m for m in MD_LINK.findall(text) if m.endswith(".md") or m.startswith("docs/")}
    return found


def _resolves(cited: str, source: Path) -> bool:
    cited = cited.rstrip(".")
    if any(ch in cited for ch in "*{}$<>") or re.match(r"[A-Z_]+/", cited):
        return True  # a pattern or placeholder, not a path
    candidates = [REPO / cited, source.parent / cited]
    return any(c.exists() for c in candidates)


def missing_links(files) -> list[str]:
    missing = []
    for p in files:
        for cited in sorted(_cited(_text(p))):
            if not _resolves(cited, p):
                missing.append(f"{p.relative_to(REPO)}: {cited}")
    return missing


def test_every_cited_doc_path_exists():
    assert missing_links(list(_files())) == []


def test_a_missing_path_is_caught():
    page = REPO / "docs" / "_link_check_probe.md"
    page.write_text("See `docs/no-such-page.md` and [this](bench/no-such-folder/results.md) and `docs/bench/no-such-folder/`.\n")
    try:
        assert sorted(missing_links([page])) == [
            "docs/_link_check_probe.md: bench/no-such-folder/results.md",
            "docs/_link_check_probe.md: docs/bench/no-such-folder/",
            "docs/_link_check_probe.md: docs/no-such-page.md",
        ]
    finally:
        page.unlink()


def test_nothing_cites_paths_outside_the_repository():
    offenders = [str(p.relative_to(REPO)) for p in _files() if OUTSIDE.search(_text(p))]
    assert offenders == []


def test_no_work_period_wording():
    offenders = []
    for p in _files():
        for n, line in enumerate(_text(p).splitlines(), 1):
            if WORK_PERIOD.search(line):
                offenders.append(f"{p.relative_to(REPO)}:{n}: {line.strip()[:80]}")
    assert offenders == []


@pytest.mark.parametrize("pattern", [r"session", r".*-s\d+$"])
def test_no_docs_folder_is_named_after_a_work_period(pattern):
    folders = [d for d in (REPO / "docs").rglob("*") if d.is_dir()]
    assert [str(d.relative_to(REPO)) for d in folders if re.match(pattern, d.name, re.IGNORECASE)] == []
