"""Ray's fake multi-node provider with a launch delay per node type, for
tests/test_elastic.py: a node type whose ``node_config`` has
``launch_delay_s: N`` comes up N seconds after the autoscaler asks for it, as
a KubeRay pod scaled from zero does (scheduling, an image pull, ``ray start``).

Autoscaler v2 runs launches in its own threads, so while one waits here the
instance stays requested: ``get_cluster_status`` lists it among the pending
launches of its type, which is what the runtime's placement wait reads. The
autoscaler's monitor imports this module (the head's PYTHONPATH holds tests/).
"""

from __future__ import annotations

import time

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class SlowFakeMultiNodeProvider(FakeMultiNodeProvider):
    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        delay = float((node_config or {}).get("launch_delay_s") or 0)
        if delay > 0:
            time.sleep(delay)
        return super().create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
