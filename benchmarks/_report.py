"""How every benchmark hands back its result: one JSON object on stdout, and optionally a file."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None) -> None:
    print(json.dumps(result))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
