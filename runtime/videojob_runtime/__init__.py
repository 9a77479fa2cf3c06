"""VideoJob runtime: everything that touches torch, diffusers and xfuser.

Ray actor groups, model loaders, memory strategies, step caches and video
encoding live here (see DESIGN.md). The operator package never imports it.
"""

__version__ = "0.1.0"
