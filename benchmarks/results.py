"""Shared by the benchmark scripts: update one section of benchmarks/RESULTS.md."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def _replace(doc: str, heading: str, text: str, stop: tuple[str, ...]) -> str | None:
    """``doc`` with the block headed ``heading`` replaced by ``text``; None if absent.

    The block ends at the next line starting with one of ``stop`` (or the end)."""
    start = doc.find(heading + "\n")
    if start < 0 or (start > 0 and doc[start - 1] != "\n"):
        return None
    ends = [e for e in (doc.find("\n" + s, start + len(heading)) for s in stop) if e >= 0]
    rest = doc[min(ends) + 1 :] if ends else ""
    return doc[:start] + text.rstrip("\n") + "\n" + ("\n" + rest if rest else "")


def write_section(section: str, text: str, subsection: str | None = None) -> None:
    """Replace the section headed ``section`` (or append it); leave the others alone.

    With ``subsection`` (a ``### `` heading line), ``text`` is that subsection only: it
    replaces the subsection inside ``section`` (or is appended to the section), and the
    section's other subsections stay as they are."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if subsection is None:
        new = _replace(old, section, text, ("## ",))
        if new is None:
            new = old.rstrip("\n") + "\n\n" + text
    else:
        start = old.find(section + "\n")
        if start < 0:
            new = old.rstrip("\n") + "\n\n" + section + "\n\n" + text
        else:
            end = old.find("\n## ", start + len(section))
            body, rest = (old[start:], "") if end < 0 else (old[start : end + 1], old[end + 1 :])
            replaced = _replace(body, subsection, text, ("## ", "### "))
            if replaced is None:
                replaced = body.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
            new = old[:start] + replaced.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    RESULTS.write_text(new)
