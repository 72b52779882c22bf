"""imp's HTTP server: OpenAI and Anthropic dialects over one Engine (see app.py for the routes)."""
from __future__ import annotations

from imp_runtime.server.app import create_app
from imp_runtime.server.service import Limits, Service


def build_app(bundle_path, device: str = "auto", api_key: str | None = None, limits: Limits | None = None):
    """Load a bundle and return (starlette app, service)."""
    from imp_runtime.engine import Engine

    engine = Engine(bundle_path, device=device)
    commit = getattr(engine.executor, "commit_pool", None)
    if commit is not None:            # the cpu executor: its KV pool resident from the start (a steady RSS)
        commit()
    svc = Service(engine, api_key=api_key, limits=limits)
    return create_app(svc), svc


__all__ = ["build_app", "create_app", "Limits", "Service"]
