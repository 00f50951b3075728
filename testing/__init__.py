"""Shared test fakes (CONVENTIONS.md, "Fakes over mocks"): small honest implementations of
our interfaces for tests and benches. ``testing.fleet`` is the fleet emulator,
``testing.fake_agent`` an agent without processes (HTTP on loopback, the real AgentLink),
``testing.fake_pynvml`` NVML (raising pynvml's own exceptions), ``testing.harness`` real
placer and agent processes, ``testing.waiting`` waits on what the code emits."""
