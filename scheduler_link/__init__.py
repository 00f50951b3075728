"""Wire messages between agents and placer, their auth, the HTTP layer both use,
the agent-side link loop and the placer-side fan-out."""
