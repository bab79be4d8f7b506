"""tieredbuf: an object-store tiered buffer for Python."""

from __future__ import annotations

__version__ = "0.1.0"
