"""Wire messages between agents and placer, their message-level auth (MACs, signed bundles,
roles), the agent-side link loop, the framed channel and the placer-side fan-out.
The transport it rides on (TLS, HTTP, tokens) is :mod:`infra`."""
