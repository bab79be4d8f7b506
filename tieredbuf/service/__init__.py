"""The HTTP ingest service behind ``tieredbuf serve`` (aiohttp; see docs/operations.md).

Stateless front ends: any client may send to any worker of any node behind any load
balancer.  Each worker process owns one staged producer (``<staging>/worker-<i>``).
"""

from __future__ import annotations

from tieredbuf.service.config import ServiceConfig

__all__ = ["ServiceConfig"]
