"""Reports and beats copied to the placers that follow (several placers, one leading: placer.ha).

A follower keeps a warm model of the fleet (placer.observe): every report and rack beat a node
or relay sends its leader goes to each other placer it knows too. A follower applies what it is
sent and answers :data:`OBSERVED` (202): taken into its model, nothing to act on (the answer
carries no stop, relay, key or epoch; only ``need_full`` when it lacks the node's state). A
node's main link that reaches a follower takes 202 as "this placer does not lead" and moves on,
as it does on 503.
"""

from __future__ import annotations

__all__ = ["OBSERVED"]

OBSERVED = 202   # a follower applied the report (or beat) to its model and acts on nothing
