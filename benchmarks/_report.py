"""How every benchmark hands back its result: one JSON object on stdout, and optionally a file."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None) -> None:
    print(json.dumps(result))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))


def fill_defaults(args, quick: dict, full: dict) -> None:
    """Set every option the command line left None from the quick or the full run's defaults."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
