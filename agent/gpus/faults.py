"""Fault injection requests (simulated GPUs only).

A :class:`Fault` is the body of the agent's ``POST /v1/gpus/{uuid}/inject``. It
names RAW signals — an XID event, counter increments, a temperature, throttle
reasons, a lost GPU — that the simulated backend then reports through the same
poll / event path NVML data takes. It never sets a health state.

Fields (any combination except ``clear``, which stands alone):

- ``xid``: raise XID N (an event, like NVML's XID critical-error event).
- ``ecc_dbe`` / ``ecc_sbe``: N more uncorrectable / correctable ECC errors (volatile
  and aggregate counters grow; a DBE event is raised).
- ``temperature_c``: the GPU temperature now reads C.
- ``throttle``: the clock-event reasons now read this one (``none`` clears).
- ``lost``: NVML calls on the GPU now fail with GpuIsLost (and a GPU-unavailable event).
- ``reset_required``: NVML calls now fail with ResetRequired.
- ``remap``: row remapper reports ``pending`` / ``failure`` / ``none``.
- ``retired_pages_pending``: page retirement pending flag.
- ``nvlink_down``: NVLink link L now reports inactive.
- ``nvlink_errors``: N more NVLink CRC errors; ``pcie_replay``: N more PCIe replays.
- ``recovery_action``: the driver's recommended recovery action field reads N.
- ``fabric_health``: the NVL72 fabric health summary (gb200-nvl72 only).
- ``clear``: back to the profile's baseline raw signals, and a ``reset`` raw event
  (as after a GPU reset), which drops sticky XID history for that GPU.

What recovers after ``clear``: everything — fatal XIDs, a lost GPU and remap
failure are sticky on their own (they need a reset, which ``clear`` simulates).
Without ``clear``: temperature, throttling, NVLink and PCIe growth recover on
their own once the raw signal is back to normal (and its window has passed);
degraded XIDs after their window; fatal XIDs never.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .errors import FaultError

ThrottleName = Literal["none", "hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal", "sw_power_cap"]

THROTTLE_BITS: dict[str, int] = {"none": 0, "hw_slowdown": 0x8, "hw_thermal": 0x40, "hw_power_brake": 0x80,
                                 "sw_thermal": 0x20, "sw_power_cap": 0x4}

_MAX_COUNT = 1_000_000


class Fault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    xid: int | None = None
    ecc_dbe: int | None = None
    ecc_sbe: int | None = None
    temperature_c: float | None = None
    throttle: ThrottleName | None = None
    lost: bool | None = None
    reset_required: bool | None = None
    remap: Literal["none", "pending", "failure"] | None = None
    retired_pages_pending: bool | None = None
    nvlink_down: int | None = None
    nvlink_errors: int | None = None
    pcie_replay: int | None = None
    recovery_action: int | None = None
    fabric_health: Literal["healthy", "unhealthy", "limited_capacity"] | None = None
    clear: bool | None = None

    def __post_init__(self) -> None:
        fields = {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}
        if not fields:
            raise FaultError("empty fault: give at least one of " + ", ".join(self.__struct_fields__))
        if self.clear is not None:
            if not self.clear:
                raise FaultError("clear must be true when given")
            if len(fields) > 1:
                raise FaultError("clear cannot be combined with other fields")
        if self.xid is not None and not 1 <= self.xid <= 65535:
            raise FaultError(f"xid must be in 1..65535, got {self.xid}")
        for name in ("ecc_dbe", "ecc_sbe", "nvlink_errors", "pcie_replay"):
            v = getattr(self, name)
            if v is not None and not 1 <= v <= _MAX_COUNT:
                raise FaultError(f"{name} must be in 1..{_MAX_COUNT}, got {v}")
        if self.temperature_c is not None and not -40.0 <= self.temperature_c <= 200.0:
            raise FaultError(f"temperature_c must be in -40..200, got {self.temperature_c}")
        if self.nvlink_down is not None and not 0 <= self.nvlink_down < 64:
            raise FaultError(f"nvlink_down must be a link index in 0..63, got {self.nvlink_down}")
        if self.recovery_action is not None and self.recovery_action not in (0, 1, 2, 3, 4, 6, 7):
            raise FaultError(f"recovery_action must be one of 0,1,2,3,4,6,7, got {self.recovery_action}")
        if self.lost is False or self.reset_required is False:
            raise FaultError("lost / reset_required can only be set to true (use clear to undo)")

    def describe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in msgspec.structs.asdict(self).items() if v is not None)


def decode_fault(body: bytes) -> Fault:
    """Decode and validate a JSON body; a bad one raises FaultError with the reason."""
    try:
        return msgspec.json.decode(body, type=Fault)
    except msgspec.ValidationError as e:
        raise FaultError(f"bad fault: {e}") from None
    except msgspec.DecodeError as e:
        raise FaultError(f"bad fault (not JSON): {e}") from None
