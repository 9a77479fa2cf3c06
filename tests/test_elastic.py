"""Layer 4 (DESIGN.md "Testing layers"): GPU-class elasticity with Ray's real
autoscaler (v2) on its fake multi-node provider.

A Ray head, started here as its own process group with the autoscaling config
in tests/data/fake_multi_node.yaml (a 0-GPU head; worker types ``gpu1`` =
1 GPU of class ``small`` and ``gpu8`` = 8 GPUs of class ``big``, both at min
0), and a driver process (tests/elastic_driver.py) that starts groups with the
real ``ActorGroup.start``. Every bundle asks for one GPU and one unit of its
class's custom resource (``videojob.inventory.class_resource``):

1. a 4-rank group of class big makes the autoscaler launch exactly one gpu8
   node, and all four ranks land on it, one GPU each;
2. a 1-rank group of class small launches one gpu1 node;
3. once the groups are torn down, the idle worker nodes are removed, and no
   process of theirs is left;
4. a group of class slow, whose node type ``slow1`` takes 8 s to come up
   (``node_config.launch_delay_s``: tests/fake_slow_provider.py, like a pod
   scaled from zero plus an image pull), waits through the scale-up with a
   placement timeout of 5 s, because the autoscaler says it is launching a
   node of that type (``videojob_runtime.placement``), and starts;
5. a group nothing can launch a node for fails NoPlacement after its timeout,
   saying the autoscaler launched nothing, and leaves nothing behind.

The fake "nodes" are real raylets (with their agents and log monitor) that the
autoscaler's monitor process starts on this machine, so they are in the head's
process group; the test checks that they go when the autoscaler removes them
and that nothing naming the head's temp dir survives the head.

No fixed port: the fake provider points new nodes at ``<machine IP>:6379``
unless the config's ``provider.gcs_address`` says otherwise, and the test sets
it to the head's free loopback port, so nothing else on the machine (another
Ray on 6379) is touched or in the way. The driver is a process of its own
because this pytest process may already be the driver of another Ray.

The tests share one cluster and run in order (under a minute on 2 idle cores).
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required
import yaml

require_module("ray")
require_module("torch")  # a CPU rank builds a torch worker
require_module("xfuser")  # and a 4-rank group rendezvouses through xfuser's groups

from helpers import REPO, RayHead, free_port, wait_for  # noqa: E402
from videojob.inventory import class_resource  # noqa: E402

CONFIG = REPO / "tests" / "data" / "fake_multi_node.yaml"
DRIVER = REPO / "tests" / "elastic_driver.py"
# The node id `ray start --head` takes under RAY_FAKE_CLUSTER=1. (The autoscaler's
# status names the head's type "node_<id>", not ray.head.default.)
HEAD_ID = "f" * 51 + "00000"
# Worker type -> its GPU class (the class's custom resource is added per GPU).
CLASSES = {"gpu1": "small", "gpu8": "big", "slow1": "slow"}
START_TIMEOUT_S = 150  # a node launch, 4 ranks importing torch, an xfuser rendezvous, on 2 cores
SCALE_DOWN_TIMEOUT_S = 120  # idle_timeout_minutes is 0.1 (6 s)
PREFIX = "vj-elastic-"


# -- processes -----------------------------------------------------------------

def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) of every process on the machine."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        table[int(stat.parent.name)] = (int(fields[1]), fields[0], cmdline.strip())
    return table


def live_descendants(pid: int) -> dict[int, str]:
    """Live (not zombie) descendants of ``pid``: pid -> command line."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = {}, list(children.get(pid, []))
    while todo:
        p = todo.pop()
        _, state, cmdline = table[p]
        if state != "Z":
            found[p] = cmdline
        todo.extend(children.get(p, []))
    return found


def processes_naming(text: str) -> dict[int, str]:
    """Live processes whose command line contains ``text``."""
    return {pid: cmd[:200] for pid, (_, state, cmd) in _processes().items() if text in cmd and state != "Z"}


# -- the cluster -----------------------------------------------------------------

class FakeClusterHead(RayHead):
    """A RayHead (own process group, temp dir, token; never ``ray stop``) whose
    autoscaler v2 runs the fake multi-node provider with our config. No fixed
    port: the config tells the provider where the GCS is (``gcs_address``)."""

    def __init__(self):
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        assert FAKE_HEAD_NODE_ID == HEAD_ID
        tests = str(REPO / "tests")  # the monitor imports the provider (fake_slow_provider) from there
        super().__init__(num_cpus=0, env={
            "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p),
            "RAY_FAKE_CLUSTER": "1", "RAY_enable_autoscaler_v2": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            # The head's instance id (autoscaler v2 matches Ray nodes to cloud instances by it).
            "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
        })
        config = yaml.safe_load(CONFIG.read_text())
        config["provider"]["gcs_address"] = self.address
        for node_type, klass in CLASSES.items():
            resources = config["available_node_types"][node_type]["resources"]
            resources[class_resource(klass)] = resources["GPU"]
        self.config_path = self.root / "autoscaling.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self._argv += [f"--autoscaling-config={self.config_path}", "--num-gpus=0",
                       "--object-store-memory=100000000",
                       # Fixed defaults (52365, 8265) would meet another Ray on the machine.
                       f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-port={free_port()}"]

    def monitor_pid(self) -> int | None:
        """The autoscaler v2 monitor process (it starts and stops the fake nodes)."""
        pgid = self.process.pid
        for pid, (_, state, cmdline) in _processes().items():
            if state != "Z" and "ray/autoscaler/v2/monitor.py" in cmdline:
                try:
                    if os.getpgid(pid) == pgid:
                        return pid
                except ProcessLookupError:
                    continue
        if self.process.poll() is not None:
            raise RuntimeError(f"ray start exited {self.process.returncode}")
        return None

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.temp_dir / "session_latest" / "logs" / name
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"({path}: {exc})"


class GroupDriver:
    """tests/elastic_driver.py in its own process, connected to the head; ``call``
    sends one command and waits for its reply, at most ``timeout`` seconds."""

    def __init__(self, head: FakeClusterHead):
        self.log_path = head.root / "driver.log"
        self._log = open(self.log_path, "w")
        # A plain driver: the head's auth, none of its fake-cluster settings, no other cluster's address.
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        env.update(head.env, RAY_ADDRESS=head.address)
        self.process = subprocess.Popen([sys.executable, str(DRIVER)], cwd=REPO, env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._replies.put(line)
        self._replies.put(None)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the driver did not answer {op!r} within {timeout:.0f}s; "
                               f"its log:\n{self.log_tail()}") from None
        if line is None:
            raise RuntimeError(f"the driver exited ({self.process.wait(5)}) during {op!r}; its log:\n{self.log_tail()}")
        return json.loads(line)

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.call("quit", timeout=30)
            self.process.wait(timeout=30)
        except (TimeoutError, RuntimeError, OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(timeout=30)
        finally:
            self._log.close()


class Cluster:
    def __init__(self, head: FakeClusterHead, driver: GroupDriver, monitor: int):
        self.head, self.driver, self.monitor = head, driver, monitor
        self.groups: list[str] = []

    def start_group(self, name: str, ulysses: int, klass: str) -> dict[str, Any]:
        """A group through the real ActorGroup.start: each bundle {CPU 1, GPU 1, class 1}."""
        reply = self.driver.call("start", timeout=START_TIMEOUT_S + 30, name=name, ulysses=ulysses,
                                 bundle_resources={"GPU": 1, class_resource(klass): 1}, cpus_per_rank=1,
                                 timeout_s=START_TIMEOUT_S)
        assert reply["ok"], (f"group {name} did not start: {reply['error']}\n"
                             f"autoscaler log:\n{self.head.log_tail('monitor.log')}\n"
                             f"driver log:\n{self.driver.log_tail()}")
        self.groups.append(name)
        return reply

    def teardown_group(self, name: str) -> None:
        reply = self.driver.call("teardown", timeout=60, name=name)
        assert reply["ok"], f"tearing down {name} failed: {reply['error']}"
        self.groups.remove(name)

    def status(self) -> dict[str, Any]:
        reply = self.driver.call("status", timeout=30)
        assert reply["ok"], f"the autoscaler's cluster status: {reply['error']}"
        return reply["status"]

    def alive_nodes(self) -> dict[str, dict[str, float]]:
        reply = self.driver.call("nodes", timeout=30)
        assert reply["ok"], f"ray.nodes(): {reply['error']}"
        return {n["node_id"]: n["resources"] for n in reply["nodes"] if n["alive"]}

    def settled_workers(self, what: str, timeout: float = 60) -> dict[str, str]:
        """Worker node id -> node type, once the autoscaler has nothing pending
        and Ray and the autoscaler agree on the nodes (for two polls in a row)."""
        previous: list[dict[str, str] | None] = [None]

        def settled():
            s = self.status()
            if s["pending_launches"] or s["pending_nodes"]:
                previous[0] = None
                return None
            workers = {n["node_id"]: n["type"] for n in s["active"] + s["idle"] if n["node_id"] != HEAD_ID}
            alive = set(self.alive_nodes())
            if set(workers) | {HEAD_ID} != alive:
                previous[0] = None
                return None
            stable = workers == previous[0]
            previous[0] = workers
            return {"workers": workers} if stable else None

        return wait_for(f"the autoscaler to settle ({what}: nothing pending, two equal polls)",
                        settled, timeout=timeout, interval=1.0)["workers"]


@pytest.fixture(scope="module")
def cluster():
    head = FakeClusterHead()
    root = str(head.root)
    with head:
        monitor = wait_for("the autoscaler v2 monitor process (ray/autoscaler/v2/monitor.py) in the head's "
                           "process group", head.monitor_pid, timeout=30)
        driver = GroupDriver(head)
        c = Cluster(head, driver, monitor)
        try:
            yield c
        finally:
            for name in list(c.groups):
                try:
                    c.teardown_group(name)
                except Exception:  # noqa: BLE001 - the head goes next, with everything in it
                    pass
            driver.close()
    # RayHead killed its process group; the fake nodes' raylets and workers were in it.
    try:
        wait_for(f"no process naming the head's temp dir {root} to be left", lambda: not processes_naming(root),
                 timeout=10)
    except TimeoutError:
        raise AssertionError(f"processes left after the head was stopped: {processes_naming(root)}") from None


def _worker_processes(c: Cluster) -> dict[int, str]:
    return live_descendants(c.monitor)


# -- tests -------------------------------------------------------------------------

def test_big_group_gets_one_eight_gpu_node(cluster: Cluster):
    before = cluster.settled_workers("before any group")
    assert before == {}, f"worker nodes before any demand (all types are min 0): {before}"

    reply = cluster.start_group(PREFIX + "big", ulysses=4, klass="big")

    workers = cluster.settled_workers("after the big group started")
    assert Counter(workers.values()) == Counter({"gpu8": 1}), (
        f"a STRICT_PACK group of 4 x {{GPU 1, {class_resource('big')} 1}} should launch one gpu8 node "
        f"and nothing else; the autoscaler launched {workers}\n{cluster.head.log_tail('monitor.log')}")
    (node_id,) = workers
    assert reply["strategy"] == "STRICT_PACK"
    assert reply["bundle_nodes"] == [node_id] * 4, (
        f"bundles not all on the gpu8 node {node_id}: {reply['bundle_nodes']}")
    for bundle in reply["bundles"]:
        assert bundle == {"CPU": 1.0, "GPU": 1.0, class_resource("big"): 1.0}, bundle
    # Each rank's actor runs on that node and holds its own GPU (the bundle's GPU became num_gpus).
    assert [r["node_id"] for r in reply["ranks"]] == [node_id] * 4, reply["ranks"]
    gpu_ids = [tuple(r["gpu_ids"]) for r in reply["ranks"]]
    assert all(len(ids) == 1 for ids in gpu_ids) and len(set(gpu_ids)) == 4, f"GPUs seen by the ranks: {gpu_ids}"
    for r in reply["ranks"]:
        assert r["assigned"].get("GPU") == 1 and r["assigned"].get(class_resource("big")) == 1, r["assigned"]
    assert [h["rank"] for h in reply["health"]] == [0, 1, 2, 3]
    assert all(h["distributed"] for h in reply["health"]), f"the ranks did not rendezvous: {reply['health']}"

    resources = cluster.alive_nodes()[node_id]
    assert (resources.get("GPU"), resources.get("CPU"), resources.get(class_resource("big"))) == (8, 8, 8), resources
    assert class_resource("small") not in resources
    # The fake node is a real raylet the autoscaler's monitor process started.
    raylets = [cmd for cmd in _worker_processes(cluster).values() if "raylet/raylet" in cmd]
    assert [cmd for cmd in raylets if f"--node_id={node_id}" in cmd], (
        f"no raylet for node {node_id} among the autoscaler's child processes: {raylets}")


def test_small_group_gets_one_one_gpu_node(cluster: Cluster):
    before = cluster.settled_workers("before the small group")  # the big group's gpu8 node, when run in order
    reply = cluster.start_group(PREFIX + "small", ulysses=1, klass="small")

    workers = cluster.settled_workers("after the small group started")
    added = {n: t for n, t in workers.items() if n not in before}
    assert Counter(added.values()) == Counter({"gpu1": 1}) and before.items() <= workers.items(), (
        f"a 1-rank group of class small should add one gpu1 node; before: {before}, after: {workers}\n"
        f"{cluster.head.log_tail('monitor.log')}")
    (small_node,) = added
    assert reply["bundle_nodes"] == [small_node]
    assert reply["ranks"][0]["node_id"] == small_node and len(reply["ranks"][0]["gpu_ids"]) == 1, reply["ranks"]
    resources = cluster.alive_nodes()[small_node]
    assert (resources.get("GPU"), resources.get("CPU"), resources.get(class_resource("small"))) == (1, 1, 1), resources


def test_idle_worker_nodes_are_removed_after_teardown(cluster: Cluster):
    if not cluster.groups:  # run alone: give the autoscaler something to remove
        cluster.start_group(PREFIX + "small", ulysses=1, klass="small")
    launched = cluster.settled_workers("before the teardown")
    assert launched, "no worker node to scale down"
    assert _worker_processes(cluster), "the autoscaler has started no node process"

    for name in list(cluster.groups):
        cluster.teardown_group(name)

    def only_the_head():
        s = cluster.status()
        workers = [n for n in s["active"] + s["idle"] + s["pending_nodes"] if n["node_id"] != HEAD_ID]
        return not workers and set(cluster.alive_nodes()) == {HEAD_ID}

    started = time.monotonic()
    wait_for(f"the idle worker nodes {sorted(launched.values())} to be removed (idle_timeout_minutes 0.1)",
             only_the_head, timeout=SCALE_DOWN_TIMEOUT_S, interval=1.0)
    took = time.monotonic() - started
    assert took > 2, f"worker nodes went {took:.1f}s after teardown: sooner than the 6 s idle timeout allows"
    # The provider killed each removed node's processes (raylet, agents, log monitor, workers).
    wait_for("no process started by the autoscaler to be left",
             lambda: not _worker_processes(cluster) or None, timeout=30)
    # Removed for being idle, each launched node (v2's status lists removed nodes as DEAD under
    # failed_nodes either way, so the autoscaler's log says why).
    log = (cluster.head.temp_dir / "session_latest" / "logs" / "monitor.log").read_text(errors="replace")
    removed = Counter()
    for m in re.finditer(r"Removing (\d+) nodes of type (\S+) \((\w+)\)", log):
        removed[(m.group(2), m.group(3))] += int(m.group(1))
    expected = Counter((t, "idle") for t in launched.values())
    assert removed == expected, f"nodes removed (type, reason): {dict(removed)}, expected {dict(expected)}"
    assert not cluster.status()["failed_launches"]


# -- placement waits for the autoscaler --------------------------------------------

SLOW_DELAY_S = 8  # tests/data/fake_multi_node.yaml: slow1's launch_delay_s
PLACEMENT_TIMEOUT_S = 5


def test_a_placement_waits_through_a_scale_up_longer_than_its_timeout(cluster: Cluster):
    """The group asks for a node that takes 8 s to come up with a placement timeout
    of 5 s: it waits (the autoscaler is launching one of its type) and starts there.
    (The actors' start on the new node has its own bound: 5 s was too short for a
    worker process on a loaded machine, and that wait is not what is tested here.)"""
    name = PREFIX + "slow"
    reply = cluster.driver.call("start", timeout=START_TIMEOUT_S + 60, name=name, ulysses=1,
                                bundle_resources={"GPU": 1, class_resource("slow"): 1}, cpus_per_rank=1,
                                timeout_s=PLACEMENT_TIMEOUT_S, node_type="slow1", max_wait_s=START_TIMEOUT_S,
                                start_timeout_s=START_TIMEOUT_S)
    assert reply["ok"], (f"the group did not wait for its node: {reply['error']}\nwaits: {reply.get('waits')}\n"
                         f"{cluster.head.log_tail('monitor.log')}")
    cluster.groups.append(name)
    placement = reply["placement"]
    assert placement["waitedS"] > PLACEMENT_TIMEOUT_S, (
        f"the placement waited {placement['waitedS']} s, not longer than its {PLACEMENT_TIMEOUT_S} s timeout: "
        "the node came up too fast to show the wait")
    assert placement["launchingS"] > PLACEMENT_TIMEOUT_S, placement  # the time not counted against the timeout
    waiting = [w for w in reply["waits"] if w["state"] == "waiting-for-node"]
    assert waiting and all(w["nodeType"] == "slow1" for w in waiting), reply["waits"]
    assert "launch" in waiting[0]["launching"], waiting[0]
    workers = cluster.settled_workers("after the slow group started")
    (node_id,) = [n for n, t in workers.items() if t == "slow1"]
    assert reply["bundle_nodes"] == [node_id] and reply["ranks"][0]["node_id"] == node_id, reply


def test_a_placement_nothing_launches_for_fails_after_its_timeout(cluster: Cluster):
    """No node type offers class `nowhere`: nothing launches, so the timeout runs
    its course and the group fails NoPlacement, saying why, leaving nothing."""
    name = PREFIX + "nowhere"
    started = time.monotonic()
    reply = cluster.driver.call("start", timeout=120, name=name, ulysses=1,
                                bundle_resources={"GPU": 1, class_resource("nowhere"): 1}, cpus_per_rank=1,
                                timeout_s=3, node_type="nowhere", max_wait_s=60)
    took = time.monotonic() - started
    assert not reply["ok"], reply
    error = reply["error"]
    assert error["reason"] == "NoPlacement" and error["stage"] == "placement", error
    assert "within 3s" in error["message"] and "launched no node of node type nowhere" in error["message"], error
    assert 3 <= reply["seconds"] < 30 and took < 60, (reply["seconds"], took)
    assert {w["state"] for w in reply["waits"]} == {"waiting-for-room"}, reply["waits"]
    census = cluster.driver.call("census", timeout=30, prefix=name)
    assert census["ok"] and not any(census["census"].values()), census
