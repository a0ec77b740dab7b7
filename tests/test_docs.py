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


# ---------------------------------------------------------------- docs/serving.md against `cpinfer serve`'s parser
SERVING = ROOT / "docs" / "serving.md"
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def _serve_parser():
    from cpinfer.cli import _subparser, build_parser

    return build_parser(), _subparser(build_parser(), "serve")


def _table(text: str, header: str) -> list[list[str]]:
    """The rows (cells) of the Markdown table whose header line starts with `header`."""
    start = text.index(header)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def _flags(cell: str) -> list[str]:
    """The options a table cell names in code spans (`--cp N` → --cp; not env vars or routes)."""
    return [m for span in re.findall(r"`([^`]*)`", cell) for m in FLAG.findall(span) if span.startswith("-")]


def _refused(parser, flag: str) -> bool:
    """Whether `cpinfer serve FLAG` leaves FLAG unparsed (cli.main then refuses it as an unrecognized argument);
    argparse would take a prefix of a real option as that option."""
    _, unknown = parser.parse_known_args(["serve", flag])
    return flag in unknown


def test_serving_doc_documents_what_serve_parses_and_refuses_what_it_says_is_unsupported():
    text = SERVING.read_text()
    top, serve = _serve_parser()
    known = set(serve._option_string_actions)
    supported = {f for row in _table(text, "| option | meaning |") for f in _flags(row[0])}
    same, renamed = _table(text, "| vLLM | cpinfer |"), _table(text[text.index("Renamed or different"):],
                                                                "| vLLM | cpinfer |")
    supported |= {f for row in same for f in _flags(row[0]) if row[1] == "the same"}
    supported |= {f for row in renamed for f in _flags(row[1])}
    missing = sorted(supported - known)
    assert not missing, f"docs/serving.md documents options `cpinfer serve` does not have: {missing}"
    undocumented = sorted(f for f in known if f not in set(FLAG.findall(text)) and f not in ("-h", "--help"))
    assert not undocumented, f"`cpinfer serve --help` has options docs/serving.md never names: {undocumented}"

    unsupported = re.search(r"Not supported \(refused as unknown options[^)]*\):(.*?)\n\n", text, re.S).group(1)
    refused = [f for f in _flags(unsupported)] + [f for row in renamed for f in _flags(row[0])]
    assert "--pipeline-parallel-size" in refused and "--swap-space" in refused  # the lists were read
    accepted = sorted(f for f in refused if f in known or not _refused(top, f))
    assert not accepted, f"docs/serving.md says these are refused, but `cpinfer serve` takes them: {accepted}"
    unexplained = sorted(f for f in refused if f not in serve.unsupported)
    assert not unexplained, f"refused without saying why (add them to serve.VLLM_UNSUPPORTED): {unexplained}"
    stale = sorted(f for f in serve.unsupported if f in known or not _refused(top, f))
    assert not stale, f"serve.VLLM_UNSUPPORTED names options `cpinfer serve` takes: {stale}"


def test_an_unsupported_vllm_option_is_refused_with_a_clear_message(capsys):
    from cpinfer.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--pipeline-parallel-size", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("cpinfer serve: error: unrecognized arguments: --pipeline-parallel-size (vLLM's; pipeline parallelism "
            "is not supported: use --cp and -tp)") in err, err
    with pytest.raises(SystemExit):
        main(["serve", "--swap-space=4", "--enable-lora"])
    err = capsys.readouterr().err
    assert ("--swap-space=4 (vLLM's; use --kv-host-gib (a host tier for evicted K/V)) --enable-lora (vLLM's; LoRA "
            "adapters are not supported)") in err, err
