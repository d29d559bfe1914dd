"""Shared by the benchmark scripts: update one section of benchmarks/RESULTS.md."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(section: str, text: str) -> None:
    """Replace the section headed ``section`` (or append it); leave the others alone."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = old.find(section + "\n")
    if start < 0:
        RESULTS.write_text(old.rstrip("\n") + "\n\n" + text)
        return
    end = old.find("\n## ", start + len(section))
    rest = "" if end < 0 else old[end + 1 :]
    RESULTS.write_text(old[:start] + text + ("\n" + rest if rest else ""))
