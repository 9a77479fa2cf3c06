"""How the operator reaches Ray: HTTP only (Jobs and State APIs), never ``import ray``."""

from .client import HttpRayClient, RayAuthError, RayClient, RayJob, RayUnavailable

__all__ = ["HttpRayClient", "RayAuthError", "RayClient", "RayJob", "RayUnavailable"]
