"""Who may relay for which rack, and in which rack a node may register: pure checks.

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

Pinned racks
------------
The topology in a registration is self-reported, so "its registered rack" alone would let a
node register into the rack of its choosing and relay there. A node's rack is therefore
*pinned* (:class:`RackPins`), by the first of:

1. its certificate: a ``herd:rack:zone/block/rack`` SAN URI (``herd pki issue --rack``, a
   bootstrap token's ``--rack``; renewal keeps it: :mod:`infra.pki`), read from the principal
   of every connection the node makes with it (its reports over HTTP, its frames hello) and
   from the certificate an enrolment through a relay carries (scheduler_link.enroll), and
   remembered for the paths that carry no certificate (reports its relay forwards);
2. an operator's approval (``herd node approve NODE --rack zone/block/rack``), durable in the
   placer's state dir (:class:`placer.nodeops.ApprovalFile`).

Then (:func:`check_registration`) a full report into another rack is refused
(``rack_mismatch``), whichever path it came by (directly, relayed, enrolled), and
(:func:`check_hello`) a hello naming another rack is refused (``rack_mismatch``); with
``[placer] require_pinned_racks = true`` a node with no pin may register and report but its
relay hello is refused (``rack_unpinned``). Every refusal is counted by code
(``rack_refused_<code>`` among the state's counters).

What does not hold: with ``require_pinned_racks = false`` (the default, for fleets whose
certificates pin nothing yet) an unpinned node still registers into the rack it names and may
relay there. A certificate pin learned in memory is lost with a restart until the node presents
its certificate again (a relayed re-registration meanwhile is checked against the approval
only; a full report over the heartbeat wire's plain, non-frames connection notes no certificate
either). An old certificate with another pin (or none) stays usable until it expires or is
revoked: revoke its serial when moving a node (``herd pki revoke --serial``). Approvals live
in one placer's state dir, not in etcd: a promoted follower holds its own (certificate pins
need nothing of the placer's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from infra.tls import Principal
from scheduler_link import frames
from scheduler_link.frames import Refused

if TYPE_CHECKING:
    from scheduler_link.frames import FrameChannel
    from scheduler_link.heartbeat_wire import Hello

__all__ = ["RACK_MAX_ENTRIES", "Pin", "RackPins", "admit", "check_hello", "check_registration", "may_relay"]

# Per-node entries a relay's beat or report batch may carry: a rack's size, at most (an
# NVL72 rack is 18 compute trays; the fleet shapes have under 100 nodes a rack), with room.
RACK_MAX_ENTRIES = 256


class Registered(Protocol):
    """What is read of a node's record (placer.records.NodeRec)."""

    @property
    def node_id(self) -> str: ...

    @property
    def rack_path(self) -> str: ...


PinSource = Literal["certificate", "approval"]


@dataclass(frozen=True, slots=True)
class Pin:
    """The rack a node is pinned to, and what pinned it."""
    rack: str
    source: PinSource


class RackPins:
    """Per node, the rack it is pinned to (its certificate's, else an operator's approval),
    and the refusals counted by code. One owner (the placer state); plain dicts, no I/O:
    the service makes approvals durable before it hands them in. ``require``: a node with no
    pin relays for no rack (``[placer] require_pinned_racks``)."""

    __slots__ = ("approved", "certified", "counters", "require")

    def __init__(self, counters: dict[str, int] | None = None, approved: Mapping[str, str] | None = None, *,
                 require: bool = False) -> None:
        self.approved: dict[str, str] = dict(approved or {})   # node id -> rack, by an operator
        self.certified: dict[str, str] = {}                      # node id -> rack, by a certificate seen
        self.counters = counters if counters is not None else {}
        self.require = require

    def saw(self, principal: Principal | None) -> None:
        """A connection's verified principal: a node certificate that pins a rack pins it from
        now on (a certificate pinning none changes nothing: an older certificate must not lift
        a newer one's pin)."""
        if principal is not None and principal.kind == "node" and principal.node_id and principal.via == "cert":
            self.certificate(principal.node_id, principal.rack)

    def certificate(self, node_id: str, rack: str | None) -> None:
        """Node ``node_id`` proved a certificate pinning ``rack`` (a handshake, or an enrolment's
        certificate): :meth:`saw`'s rule."""
        if rack is not None:
            self.certified[node_id] = rack

    def approve(self, node_id: str, rack: str) -> None:
        self.approved[node_id] = rack

    def pin(self, node_id: str) -> Pin | None:
        rack = self.certified.get(node_id)
        if rack is not None:
            return Pin(rack, "certificate")
        rack = self.approved.get(node_id)
        return Pin(rack, "approval") if rack is not None else None

    def count(self, refusal: Refused) -> Refused:
        key = "rack_refused_" + refusal.code
        self.counters[key] = self.counters.get(key, 0) + 1
        return refusal

    def relays_for(self, node_id: str, rack: str) -> bool:
        """Whether the node's pin allows it to relay for ``rack`` (its registration aside)."""
        pin = self.pin(node_id)
        return not self.require if pin is None else pin.rack == rack

    def registration(self, node_id: str, rack: str) -> Refused | None:
        """:func:`check_registration` against this node's pin, counted when refused."""
        why = check_registration(node_id, rack, self.pin(node_id))
        return self.count(why) if why is not None else None


def check_registration(node_id: str, rack: str, pin: Pin | None) -> Refused | None:
    """None when ``node_id`` may register into ``rack`` (``zone/block/rack``); else why not."""
    if pin is not None and rack != pin.rack:
        return Refused("rack_mismatch", f"node {node_id[:200]} is pinned to rack {pin.rack[:400]} (by its "
                                        f"{pin.source}), not {rack[:400]}")
    return None


def check_hello(node_id: str, racks: Sequence[str], registered_rack: str | None, pin: Pin | None = None, *,
                require_pinned: bool = False) -> Refused | None:
    """None when ``node_id`` may offer to relay for ``racks``; else why not. ``registered_rack``:
    the rack of the node's registration (None: not registered yet); ``pin``: the rack it is
    pinned to (None: none); ``require_pinned``: a node with no pin relays for no rack."""
    if not racks:
        return None                       # not a relay: a plain frames connection
    if len(racks) > 1:
        return Refused("racks_many", f"node {node_id[:200]} named {len(racks)} racks; a node relays for its own "
                                     f"rack only")
    rack = racks[0]
    if pin is None and require_pinned:
        return Refused("rack_unpinned", f"node {node_id[:200]} has no pinned rack (certificate or herd node "
                                        f"approve) and this placer requires one to relay")
    if pin is not None and rack != pin.rack:
        return Refused("rack_mismatch", f"node {node_id[:200]} is pinned to rack {pin.rack[:400]} (by its "
                                        f"{pin.source}), not {rack[:400]}; a node relays for its own rack only")
    if registered_rack is not None and rack != registered_rack:
        return Refused("rack_mismatch", f"node {node_id[:200]} is registered in rack {registered_rack[:200]}, "
                                        f"not {rack[:200]}; a node relays for its own rack only")
    return None


def may_relay(rack: str, node: Registered | None, pins: RackPins | None = None) -> bool:
    """Whether a candidate connection of ``rack`` may be chosen now: its node is registered
    there, and its pin allows that rack now (an approval given after the node was admitted or
    registered takes effect at once)."""
    return node is not None and node.rack_path == rack and (pins is None or pins.relays_for(node.node_id, rack))


def admit(hello: Hello, node: Registered | None, channel: FrameChannel | Any, pins: RackPins | None = None) -> None:
    """The relay hub's hello check (``RelayHub.opened``): raises Refused, or admits the
    connection (a relay candidate gets a candidate's bounds: ``FrameChannel.make_candidate``).
    The connection's certificate pins its node's rack first (``pins.saw``)."""
    pin = None
    if pins is not None:
        principal = channel.principal
        if isinstance(principal, Principal) and principal.node_id == hello.node_id:
            pins.saw(principal)
        pin = pins.pin(hello.node_id)
    refusal = check_hello(hello.node_id, hello.racks, node.rack_path if node is not None else None, pin,
                          require_pinned=pins is not None and pins.require)
    if refusal is not None:
        if pins is not None:
            pins.count(refusal)
        raise refusal
    if hello.racks:
        frames.make_candidate(channel, RACK_MAX_ENTRIES)
