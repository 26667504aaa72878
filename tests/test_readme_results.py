"""The README's figures are the results page's, and the results page shows what its folder holds.

The README quotes measured figures only between `<!-- figures from benches/RESULTS.md#SECTION -->`
and `<!-- end figures -->`; each figure there (a number with a decimal point or a thousands
comma, or one with a unit: ms, µs, s, GB/s, tokens, ×, %; both ends of a range) must appear in a
table of that section of `benches/RESULTS.md` (its `|` lines, from its heading to the next).
Updating a figure on one page and not on the other fails here, whichever page moved. No servers:
it reads files."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benches" / "RESULTS.md"
RESULTS_DIR = ROOT / "benches" / "results"
HISTORY = RESULTS_DIR / "HISTORY.md"

BLOCK = re.compile(
    r"<!--\s*figures\s+from\s+benches/RESULTS\.md#([\w-]+)\s*-->(.*?)<!--\s*end\s+figures\s*-->", re.S
)
NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
# Not after a word, a dot, a comma, a slash or a hyphen: no part of a name (SmolLM2-360M), a
# date (2026-12-04), a path or a longer number.
FIGURE = re.compile(
    rf"(?<![\w.,/-])({NUM})(?:\s?–\s?({NUM}))?(\s?(?:ms|µs|s|GB/s|tokens)\b|×|%)?"
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _plain(number: str) -> str:
    return number.replace(",", "")


def figures(text: str) -> list[str]:
    """The measured figures a README block quotes, as written (commas dropped)."""
    out = []
    for match in FIGURE.finditer(text):
        first, second, unit = match.groups()
        numbers = [n for n in (first, second) if n]
        if unit or any("." in n or "," in n for n in numbers):
            out += [_plain(n) for n in numbers]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(page: str) -> dict[str, str]:
    """The results page's `## ` sections by anchor, each its text up to the next."""
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return {slug(title): body for title, body in zip(parts[1::2], parts[2::2])}


def test_figures_and_sections_are_found():
    # A guard against a check that passes because it reads nothing.
    blocks = BLOCK.findall(README.read_text())
    assert {anchor for anchor, _ in blocks} >= {"history-sweep", "raw-transfers", "load"}
    for anchor, text in blocks:
        assert figures(text), f"README's block for #{anchor} quotes no figure"
    assert figures("0.86–1.07× one-way, 4,177 ms, 16 KiB, SmolLM2-360M, 2026-12-04") == [
        "0.86", "1.07", "4177"
    ]


def table_numbers(section: str) -> set[str]:
    """Every number in a section's tables (its lines that start with `|`), commas dropped."""
    rows = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    return {_plain(n) for n in re.findall(NUM, rows)}


def test_readme_figures_are_the_results_pages():
    page = sections(RESULTS.read_text())
    missing = []
    for anchor, text in BLOCK.findall(README.read_text()):
        assert anchor in page, f"README cites benches/RESULTS.md#{anchor}, which has no such section"
        present = table_numbers(page[anchor])
        missing += [f"#{anchor}: {n}" for n in figures(text) if n not in present]
    assert not missing, (
        "README figures not in the results page's section (update both pages together): "
        + ", ".join(missing)
    )


def test_readme_plots_are_the_results_pages():
    shown = set(re.findall(r"\]\((benches/results/[^)]+\.png)\)", README.read_text()))
    assert shown, "the README shows no plot of the results page"
    page = RESULTS.read_text()
    for path in shown:
        assert (ROOT / path).is_file(), path
        assert f"]({path.removeprefix('benches/')})" in page, f"{path} is not on the results page"


def test_results_files_are_linked_and_links_resolve():
    """Every file in benches/results/ is one a current table links; every one in history/ is
    named by the history; every relative link of both pages names a file that exists."""
    page, history = RESULTS.read_text(), HISTORY.read_text()
    linked = {(RESULTS.parent / target).resolve() for target in LINK.findall(page)
              if not target.startswith("http")}
    current = {p.resolve() for p in RESULTS_DIR.iterdir() if p.suffix in (".json", ".png")}
    assert not current - linked, f"not linked from RESULTS.md: {sorted(current - linked)}"
    for p in (RESULTS_DIR / "history").iterdir():
        assert p.name in history or p.stem in history, f"history/{p.name}: no entry names it"
    for source in (RESULTS, HISTORY):
        for target in LINK.findall(source.read_text()):
            if not target.startswith("http"):
                assert (source.parent / target).exists(), f"{source.name}: broken link {target}"


def test_links_to_results_sections_resolve():
    """A link to a section of the results page (README, docs/) names one it has."""
    page = sections(RESULTS.read_text())
    for source in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for anchor in re.findall(r"RESULTS\.md#([a-z0-9-]+)", source.read_text()):
            assert anchor in page, f"{source.name}: no section #{anchor} in benches/RESULTS.md"
