"""OpenAI-compatible HTTP server with Prometheus ``/metrics`` (``kvcanary serve``)."""

from kvcanary.server.app import create_app
from kvcanary.server.engine_loop import EngineLoop

__all__ = ["EngineLoop", "create_app"]
