"""The herd node agent.

What others may use (import from the modules; this package init stays import-free so
``agent.gpus`` and the shim load fast)::

    agent.config.load_config(path, overrides) -> AgentConfig      # TOML + flags, frozen
    agent.daemon.Agent(config).run(task_status)                   # the daemon; started(control_url)
    agent.daemon.run_agent(config)                                # blocking entry point
    agent.supervisor.Supervisor(state_dir, node_id=, gpu_health=) # workloads: place/stop/workloads()
    agent.placement.check_placement(placement, records, gpu_health) -> reason | None   # pure
    agent.parts.check_part(part, node_id=, now=, inventory=, ...) -> Verdict           # pure
    agent.parts.PartAcceptor(...).handle(part) -> NodeOutcome      # NodeParts: check, persist, ack, place
    agent.relay.Relay(...).run(task_status)                        # rack relay; started(members listener URL)
    agent.beats.BeatBook                                           # members' heartbeats -> rack beats (pure)
    agent.blobs.BlobCache                                          # verified gang blobs, bounded, single flight
    agent.api.build_app(agent) -> infra.http.App
    agent.isolation: Identities (who workloads run as), Isolation / detect (cgroup | subreaper)
    agent.sdnotify.Notifier                                        # sd_notify socket protocol
    agent.errors: AgentError, ConfigError, UnknownWorkload, ShimError (refusals are PlacementAck.reason)
    agent.gpus: GPU discovery and health (see its own __init__)
"""
