"""``plait models``: the Hugging Face families plait loads and exports, and those it
refuses, from the family table (:mod:`plait.arch.families`; no torch).

``plait models`` prints one block per family: its ``architectures`` name, plait's
``model.arch`` name, the block features it turns on, and what of it is refused; then
the families refused by name with the reason. ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from plait.arch.families import FAMILIES, REFUSED


def models_table() -> dict[str, Any]:
    """The family table as plain data (what ``--json`` prints)."""
    return {
        "supported": [
            {
                "arch": s.name,
                "architecture": s.architecture,
                "model_type": s.model_type,
                "features": list(s.features),
                "fused": [hf for hf, _ in s.fused],
                "experts": s.experts,
                "refuses": list(s.refuses),
            }
            for s in FAMILIES.values()
        ],
        "refused": [
            {"architecture": r.architecture, "model_type": r.model_type, "reason": r.reason}
            for r in REFUSED
        ],
    }


def format_models() -> str:
    """The family table as text."""
    lines = ["Hugging Face families plait loads (--init-from DIR) and exports (--format hf):"]
    for s in FAMILIES.values():
        lines.append(f"  {s.architecture}  (model.arch {s.name}, model_type {s.model_type})")
        lines += [f"    - {f}" for f in s.features]
        lines += [f"    refused: {r}" for r in s.refuses]
    lines.append("Refused by name:")
    lines += [f"  {r.architecture}: {r.reason}" for r in REFUSED]
    return "\n".join(lines)


def models_main(argv: Sequence[str]) -> int:
    """``plait models [--json]``."""
    p = argparse.ArgumentParser(
        prog="plait models", description="The Hugging Face families plait loads and refuses."
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    ns = p.parse_args(list(argv))
    print(json.dumps(models_table(), indent=2) if ns.json else format_models())
    return 0
