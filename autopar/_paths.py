"""Where shipped data lives, for both an installed wheel and a source checkout."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """Directory of a shipped catalog (``cost_models`` or ``strategies``).

    A wheel carries them under ``autopar/_data``; a source checkout (editable install, tests run
    from the repo) has them at the repository root.
    """
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"autopar's {name}/ catalog is missing from {_PKG}; reinstall autopar")
