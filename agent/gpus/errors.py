"""Errors of GPU discovery and health, by who broke the rules."""

from __future__ import annotations

from agent.errors import AgentError


class GpuError(AgentError):
    """Base of every GPU-subsystem error (the CLI prints it as one line)."""


class GpuBackendError(GpuError):
    """The GPU backend cannot be opened or cannot do what was asked: no NVML library,
    no driver, no permission, an unknown profile, fault injection on real GPUs."""


class FaultError(GpuError, ValueError):
    """A fault-injection request is malformed or names something that does not exist.

    Derives from ValueError so a raise in ``Fault.__post_init__`` becomes a msgspec
    ValidationError (a 400 with the reason) when the body is decoded."""
