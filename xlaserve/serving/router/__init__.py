"""Routing: request model name -> model group (name, version, tier check, "auto") -> replica."""

from xlaserve.serving.router.router import ModelGroup, Replica, Router, RoutingError

__all__ = ["ModelGroup", "Replica", "Router", "RoutingError"]
