"""Who may relay for which rack: the checks on a relay's hello, as pure functions.

A node's frames hello names the racks it offers to relay for (``Hello.racks``). Taken as
given, a node with a valid certificate could name every rack and become the relay of racks
it is not in: their members would report to it and it would receive their parts and gang
blobs. The rule here: a node relays only for the one rack it is registered in (the rack of
the topology in its registration). A hello naming another rack, or more than one, is refused
with a reason (:class:`~scheduler_link.frames.Refused`, answered as ``WireReply.reason``).

A node not registered yet (a relay that connects first and registers itself and its members
through the connection: the fleet emulator, a restarted placer) is admitted for the one
rack it names, provisionally: the relay hub chooses a candidate only while the candidate's
registered rack is that rack (:func:`may_relay`), so a registration elsewhere later makes
the connection useless, not powerful.

What does not hold: the topology itself is self-reported at registration (a node may
register into a rack of its choosing); pinning it (in the certificate, or by an operator)
is separate work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from scheduler_link import frames
from scheduler_link.frames import Refused

if TYPE_CHECKING:
    from scheduler_link.frames import FrameChannel
    from scheduler_link.heartbeat_wire import Hello

__all__ = ["RACK_MAX_ENTRIES", "admit", "check_hello", "may_relay"]

# Per-node entries a relay's beat or report batch may carry: a rack's size, at most (an
# NVL72 rack is 18 compute trays; the fleet shapes have under 100 nodes a rack), with room.
RACK_MAX_ENTRIES = 256


class Registered(Protocol):
    """What is read of a node's record (placer.records.NodeRec)."""

    @property
    def rack_path(self) -> str: ...


def check_hello(node_id: str, racks: Sequence[str], registered_rack: str | None) -> Refused | None:
    """None when ``node_id`` may offer to relay for ``racks``; else why not. ``registered_rack``:
    the rack of the node's registration (None: not registered yet)."""
    if not racks:
        return None                       # not a relay: a plain frames connection
    if len(racks) > 1:
        return Refused("racks_many", f"node {node_id[:200]} named {len(racks)} racks; a node relays for its own "
                                     f"rack only")
    rack = racks[0]
    if registered_rack is not None and rack != registered_rack:
        return Refused("rack_mismatch", f"node {node_id[:200]} is registered in rack {registered_rack[:200]}, "
                                        f"not {rack[:200]}; a node relays for its own rack only")
    return None


def may_relay(rack: str, node: Registered | None) -> bool:
    """Whether a candidate connection of ``rack`` may be chosen now: its node is registered there."""
    return node is not None and node.rack_path == rack


def admit(hello: Hello, node: Registered | None, channel: FrameChannel | Any) -> None:
    """The relay hub's hello check (``RelayHub.opened``): raises Refused, or admits the
    connection (a relay candidate gets a candidate's bounds: ``FrameChannel.make_candidate``)."""
    refusal = check_hello(hello.node_id, hello.racks, node.rack_path if node is not None else None)
    if refusal is not None:
        raise refusal
    if hello.racks:
        frames.make_candidate(channel, RACK_MAX_ENTRIES)
