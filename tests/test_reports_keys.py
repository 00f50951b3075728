"""A node's MAC key at the placer (placer.reports.Reports.mac_key): a relayed registration's
MAC is checked with the key of a (node, boot) no record holds yet; the record the registration
makes takes that key over, so its answer (epoch MAC, stops) derives nothing again. A key is
only ever the one for that node, that boot and the current master."""

from __future__ import annotations

import os

from scheduler_link.msgauth import node_key
from tests.test_placer_indexes import full, new_state


def test_a_registration_keeps_the_key_its_mac_was_checked_with() -> None:
    st = new_state()
    st.set_mac_master(os.urandom(32))
    k = st.mac_key("n1", "boot-n1")             # (the relayed report's MAC, before the node exists)
    assert k == node_key(st.mac_master, "n1", "boot-n1")
    assert st.ingest("n1", full("n1"), 0.0)[0] == 200
    assert st.nodes["n1"].mac is k and st.mac_key("n1", "boot-n1") is k


def test_a_key_is_never_handed_to_another_node_boot_or_master() -> None:
    st = new_state()
    st.set_mac_master(os.urandom(32))
    st.mac_key("n1", "other-boot")               # a key for another boot of n1 ...
    st.mac_key("n2", "boot-n2")                  # ... and one of another node, the last derived
    assert st.ingest("n1", full("n1"), 0.0)[0] == 200
    assert st.nodes["n1"].mac == b""             # neither taken over
    assert st.mac_key("n1", "boot-n1") == node_key(st.mac_master, "n1", "boot-n1")
    st.mac_key("n3", "boot-n3")
    st.set_mac_master(os.urandom(32))            # a new master: nothing derived before survives it
    assert st.ingest("n3", full("n3"), 0.0)[0] == 200
    assert st.nodes["n3"].mac == b""
    assert st.mac_key("n3", "boot-n3") == node_key(st.mac_master, "n3", "boot-n3")
    assert st.mac_key("n2", "boot-n2") == node_key(st.mac_master, "n2", "boot-n2")
