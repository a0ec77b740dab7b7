"""README.md and docs/*.md stand alone: every relative link resolves to a file of the repository, every #anchor to
a heading of its target (GitHub's slugs), and the text names no internal issue numbers, machines lent to the
project or temporary paths."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than '-' and '_' removed,
    each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug, with GitHub's -1, -2 ... suffixes on repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def prose(path: Path) -> str:
    """The Markdown text without code blocks and inline code (links inside code are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", path.read_text()))


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # no URLs, mailto


def test_slugs_follow_github():
    assert github_slug("Evaluation harnesses (lm-eval)") == "evaluation-harnesses-lm-eval"
    assert github_slug("Using `cp_attention`") == "using-cp_attention"
    assert github_slug("CP × TP: the layout") == "cp--tp-the-layout"
    assert github_slug("Multi-node: context parallel across nodes × tensor parallel") == \
        "multi-node-context-parallel-across-nodes--tensor-parallel"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
        elif file and not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


INTERNAL = [
    (re.compile(r"\bissue\s+#?\d+", re.I), "an internal issue number"),
    (re.compile(r"\bmust\s+\d+\b", re.I), "an internal requirement number"),
    (re.compile(r"\blent\b", re.I), "a machine lent to the project"),
    (re.compile(r"\b(?:our|this|the first|other|another)\s+sessions?\b", re.I), "a work session"),
    (re.compile(r"\bother engineers\b", re.I), "the people sharing a machine"),
    (re.compile(r"(?<![\w.])/tmp/"), "a temporary path"),
    (re.compile(r"\bthe lead\b", re.I), "a note to a colleague"),
]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_internal_matters(doc):
    text = doc.read_text()
    found = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r} ({what})"
             for pattern, what in INTERNAL for m in pattern.finditer(text)]
    assert not found, f"{doc.relative_to(ROOT)}: " + "; ".join(found)
