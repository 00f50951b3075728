"""Errors of the node agent, by who broke the rules."""

from __future__ import annotations


class AgentError(Exception):
    """Base of every agent error (the CLI prints it as one line)."""


class ConfigError(AgentError):
    """The agent's configuration (TOML file or flags) is invalid."""


class UnknownWorkload(AgentError):
    """No workload with that id is known on this node."""


class ShimError(AgentError):
    """A workload shim failed to start or to launch its workload."""
