"""Shared fixtures. Tests never hit the internet; sockets are loopback only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def token_dir(tmp_path: Path) -> Path:
    from scheduler_link.auth import generate_token_dir
    return generate_token_dir(tmp_path / "tokens")


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0
