"""Reading a daemon's TOML config file: one place maps the file's failures to the daemon's
config error (agent.errors.ConfigError, placer.errors.PlacerConfigError), one line each."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any


def read_toml(path: str | os.PathLike[str], error: type[Exception]) -> dict[str, Any]:
    """The file's tables; a missing, unreadable or not-TOML file is ``error`` naming it."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"config file {path} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read config file {path}: {getattr(e, 'strerror', None) or e}") from None
