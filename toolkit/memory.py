"""How much memory this machine has free now: what export, check, quantize and bench size themselves against
before they allocate (refusing up front with the numbers rather than being killed halfway)."""

from __future__ import annotations

import os


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), or None where it cannot be told."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
