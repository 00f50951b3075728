"""Shared test fakes (CONVENTIONS.md, "Fakes over mocks"): small honest implementations of
our interfaces for tests and benches. ``testing.fleet`` is the fleet emulator."""
