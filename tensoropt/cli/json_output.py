"""The ``--json`` convention every command follows.

``--json`` prints the command's result as one JSON document on stdout, and nothing
else goes to stdout (tables are left out; progress bars and notes stay on
stderr). Where a file is the natural result (``search``, ``validate``), ``--json-out
FILE`` writes the same document to FILE (atomically) and the human output stays.

Every document has a ``schema`` field (``tensoropt.<command>/<version>``) and every
byte count (a key ending in ``bytes``) is an integer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from tensoropt.cli.common import write_atomic

JSON_HELP = "print the result as JSON on stdout (schema {schema}); nothing else goes to stdout"
JSON_OUT_HELP = "write the result as JSON (schema {schema}) to FILE; the tables still print"


def add_json_flag(parser: argparse.ArgumentParser, schema: str) -> None:
    """``--json``: the document on stdout."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP.format(schema=schema))


def add_json_out(parser: argparse.ArgumentParser, schema: str) -> None:
    """``--json-out FILE``: the document in a file (for results too big for a terminal)."""
    parser.add_argument("--json-out", metavar="FILE.json", help=JSON_OUT_HELP.format(schema=schema))


def integral_bytes(obj: object, key: str = "") -> object:
    """``obj`` with every finite number under a key ending in ``bytes`` made an int
    (recursively, lists under such a key included): byte counts are whole bytes,
    whatever float arithmetic produced them."""
    if isinstance(obj, dict):
        return {k: integral_bytes(v, str(k)) for k, v in obj.items()}
    counts_bytes = key.endswith("bytes")
    if isinstance(obj, (list, tuple)):
        if counts_bytes:
            return [integral_bytes(v, key) for v in obj]
        # long vectors (a search point's choices) pass through without a call per item
        return [integral_bytes(v, key) if isinstance(v, _NESTED) else v for v in obj]
    if counts_bytes and isinstance(obj, float) and math.isfinite(obj):
        return int(round(obj))
    return obj


_NESTED = (dict, list, tuple)


def finite_or_null(values) -> list:
    """``values`` (floats) with NaN and infinities as None: JSON has no literal for them
    (``json.dumps`` would write ``NaN``, which strict parsers and jq refuse)."""
    return [v if math.isfinite(v) else None for v in values]


def document(schema: str, body: dict) -> dict:
    """``{"schema": schema, **body}`` with byte counts as integers."""
    doc = integral_bytes({"schema": schema, **body})
    assert isinstance(doc, dict)
    return doc


def dumps(doc: dict, *, compact: bool = False) -> str:
    """JSON text; ``compact`` drops indentation (large documents)."""
    if compact:
        return json.dumps(doc, separators=(",", ":"), default=float) + "\n"
    return json.dumps(doc, indent=2, default=float) + "\n"


def emit(args: argparse.Namespace, doc: dict, *, compact: bool = False) -> None:
    """Print ``doc`` on stdout for ``--json`` and write it to ``--json-out FILE``."""
    if getattr(args, "json_out", None):
        write_atomic(args.json_out, dumps(doc, compact=compact).encode())
    if getattr(args, "json", False):
        sys.stdout.write(dumps(doc, compact=compact))
        sys.stdout.flush()
