"""The coordinator's HTTP API (FastAPI): ``create_app(settings)`` is the only way to build it."""

from coordinator.api.app import create_app

__all__ = ["create_app"]
