"""Where the performance model's hardware comes from: `load_hardware_profile` takes a profile, a name of the
built-in catalog (`catalog.py`) or the path of a JSON profile (as `cpinfer calibrate` writes them).
"""
from __future__ import annotations

from pathlib import Path

from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.hardware_profile import HardwareProfile


def load_hardware_profile(name_or_path) -> HardwareProfile:
    """A profile object, a catalog name (case-insensitive), or the path of a JSON profile."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    key = str(name_or_path).strip().lower()
    if key in HARDWARE:
        return HARDWARE[key]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown hardware {name_or_path!r}: known profiles are {', '.join(sorted(HARDWARE))}, "
                         f"or give the path of a JSON profile (as written by `cpinfer calibrate`)")
    return HardwareProfile.from_json(path.read_text(), origin=str(path))
