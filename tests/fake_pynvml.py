"""Moved to ``testing/fake_pynvml.py`` (the shared fakes); this name still imports it."""

from testing.fake_pynvml import FakeGpu, FakeHandle, FakeNvml, gb200_tray, h100_node, pcie_node

__all__ = ["FakeGpu", "FakeHandle", "FakeNvml", "gb200_tray", "h100_node", "pcie_node"]
