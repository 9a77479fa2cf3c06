"""VideoJob: elastic, memory-aware video diffusion inference on Kubernetes.

This package is the operator side: API models, planner, scheduler, CLI. It
never imports torch; the torch side lives in ``videojob_runtime``.
"""

__version__ = "0.1.0"
