"""Errors of the node agent, by who broke the rules."""

from __future__ import annotations


class AgentError(Exception):
    """Base of every agent error (the CLI prints it as one line)."""


class ConfigError(AgentError):
    """The agent's configuration (TOML file or flags) is invalid."""


class PlacementRefused(AgentError):
    """A placement cannot be honoured on this node; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownWorkload(AgentError):
    """No workload with that id is known on this node."""


class ShimError(AgentError):
    """A workload shim failed to start or to launch its workload."""


class StateError(AgentError):
    """A persisted state file cannot be read (it is set aside, never trusted)."""
