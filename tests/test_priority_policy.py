"""Priority ceilings per namespace (charts/videojob/templates/priority-policy.yaml) on
the real loopback kube-apiserver: the chart's ValidatingAdmissionPolicy, rendered by
`helm template --show-only`, refuses a VideoJob whose spec.resources.priority is above
its namespace's ceiling (the label videojob.io/max-priority, else
priorityPolicy.defaultMaxPriority), naming the field, the ceiling and how to raise it.

The chart's binding covers every namespace. Here the test narrows it to namespaces it
labels itself (BOUND), so the other tests sharing the cluster (priorities up to 1000 in
unlabelled namespaces) never meet the policy, even in the moments after the teardown
deletes it: bindings and namespace labels reach admission through informers, so every
change is waited for with a deadline (probing with server-side dry runs).

Needs Kubernetes 1.30+ (admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy);
the first test says so when the server is older.
"""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import yaml

from helpers import REPO, helm_binary, load, wait_for

pytestmark = pytest.mark.cluster

CHART = REPO / "charts" / "videojob"
TEMPLATE = "templates/priority-policy.yaml"
RELEASE = "vj-prio-test"
LABEL = "videojob.io/max-priority"
BOUND = "videojob-tests/priority-policy"  # the test's narrowing of the binding
DEFAULT_CEILING = yaml.safe_load((CHART / "values.yaml").read_text())["priorityPolicy"]["defaultMaxPriority"]
JOB = load(REPO / "examples" / "tiny-cpu.yaml")
EFFECT_TIMEOUT_S = 60


def job(name: str, priority: int | None) -> dict:
    manifest = copy.deepcopy(JOB)
    manifest["metadata"] = {"name": name}
    if priority is not None:
        manifest["spec"].setdefault("resources", {})["priority"] = priority
    return manifest


def create(cluster, namespace: str, manifest: dict, *, dry_run: bool = False) -> subprocess.CompletedProcess:
    args = ["create", "-n", namespace, "-f", "-"] + (["--dry-run=server"] if dry_run else [])
    return cluster.kubectl(*args, input=json.dumps(manifest), check=False)


def refused_by_policy(result: subprocess.CompletedProcess) -> bool:
    return result.returncode != 0 and "ValidatingAdmissionPolicy" in result.stderr


def label_namespace(cluster, namespace: str, value: str | None) -> None:
    cluster.kubectl("label", "namespace", namespace, f"{LABEL}-" if value is None else f"{LABEL}={value}",
                    "--overwrite")


def wait_ceiling(cluster, namespace: str, ceiling: int) -> None:
    """Until admission sees ``ceiling`` in ``namespace``: one above it refused, it accepted."""
    def probe():
        above = create(cluster, namespace, job("probe", ceiling + 1), dry_run=True)
        at = create(cluster, namespace, job("probe", ceiling), dry_run=True)
        return refused_by_policy(above) and at.returncode == 0
    wait_for(f"the priority ceiling {ceiling} to take effect in {namespace}", probe, timeout=EFFECT_TIMEOUT_S,
             interval=0.5)


def _version(cluster) -> tuple[int, int]:
    info = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    return int(info["major"]), int(info["minor"].rstrip("+"))


@pytest.fixture(scope="module")
def policy(kube_cluster, tmp_path_factory):
    """The CRD, then the chart's policy and binding (the binding narrowed to BOUND)."""
    version = _version(kube_cluster)
    served = kube_cluster.kubectl("api-resources", "--api-group=admissionregistration.k8s.io", "-o", "name").stdout
    if version < (1, 30) or "validatingadmissionpolicies.admissionregistration.k8s.io" not in served.split():
        pytest.fail(f"the loopback kube-apiserver ({version}) does not serve admissionregistration.k8s.io/v1 "
                    f"ValidatingAdmissionPolicy (Kubernetes 1.30+): {served!r}", pytrace=False)
    kube_cluster.install_crd()

    rendered = subprocess.run([helm_binary(), "template", RELEASE, str(CHART), "--show-only", TEMPLATE],
                              capture_output=True, text=True, cwd=REPO, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(rendered.stdout) if d}
    assert set(docs) == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    binding = docs["ValidatingAdmissionPolicyBinding"]
    assert "matchResources" not in binding["spec"], "the chart's binding covers every namespace"
    assert binding["spec"]["validationActions"] == ["Deny"]
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {BOUND: "on"}}}
    path = tmp_path_factory.mktemp("policy") / "policy.yaml"
    path.write_text(yaml.safe_dump_all([docs["ValidatingAdmissionPolicy"], binding]))
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    names = {kind: d["metadata"]["name"] for kind, d in docs.items()}
    try:
        def type_checked():
            status = kube_cluster.get_json("validatingadmissionpolicy", names["ValidatingAdmissionPolicy"]).get(
                "status", {})
            return status.get("typeChecking") is not None and status
        status = wait_for("the policy's type check", type_checked, timeout=EFFECT_TIMEOUT_S, interval=0.5)
        assert not status["typeChecking"].get("expressionWarnings"), status["typeChecking"]
        yield kube_cluster
    finally:
        kube_cluster.kubectl("delete", "validatingadmissionpolicybinding",
                             names["ValidatingAdmissionPolicyBinding"], "--ignore-not-found", check=False)
        kube_cluster.kubectl("delete", "validatingadmissionpolicy", names["ValidatingAdmissionPolicy"],
                             "--ignore-not-found", check=False)


@pytest.fixture
def bound(policy, namespace):
    """A fresh namespace the policy applies to, once admission sees the default ceiling there."""
    policy.kubectl("label", "namespace", namespace, f"{BOUND}=on")
    wait_ceiling(policy, namespace, DEFAULT_CEILING)
    return namespace


def _render(*sets: str) -> subprocess.CompletedProcess:
    args = [helm_binary(), "template", RELEASE, str(CHART), "--show-only", TEMPLATE]
    for value in sets:
        args += ["--set", value]
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=60)


def test_rendering_follows_the_values():
    """No cluster: priorityPolicy.enabled=false renders nothing, the default ceiling is
    the value, and the schema bounds it to the CRD's priority range."""
    off = _render("priorityPolicy.enabled=false")
    assert off.returncode != 0 and "could not find template" in off.stderr
    docs = [d for d in yaml.safe_load_all(_render("priorityPolicy.defaultMaxPriority=-5").stdout) if d]
    (vap,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    ceiling = {v["name"]: v["expression"] for v in vap["spec"]["variables"]}["ceiling"]
    assert ceiling == "variables.labelValid ? int(variables.label) : -5"
    too_high = _render("priorityPolicy.defaultMaxPriority=1001")
    assert too_high.returncode != 0 and "/priorityPolicy/defaultMaxPriority" in too_high.stderr


def test_server_serves_validating_admission_policies(kube_cluster):
    assert _version(kube_cluster) >= (1, 30)
    kube_cluster.kubectl("get", "validatingadmissionpolicies.v1.admissionregistration.k8s.io")


def test_unlabelled_namespace_gets_the_default_ceiling(policy, bound):
    assert create(policy, bound, job("at-ceiling", DEFAULT_CEILING)).returncode == 0
    assert create(policy, bound, job("no-priority", None)).returncode == 0  # priority 0
    above = create(policy, bound, job("above", DEFAULT_CEILING + 1))
    assert refused_by_policy(above), above.stderr
    message = above.stderr
    assert f"spec.resources.priority {DEFAULT_CEILING + 1} is above {DEFAULT_CEILING}" in message
    assert f"the ceiling of namespace {bound}" in message and f"no label {LABEL}" in message
    assert f"kubectl label namespace {bound} {LABEL}=<ceiling> --overwrite" in message
    assert policy.kubectl("get", "vj", "above", "-n", bound, check=False).returncode != 0


def test_the_label_sets_the_ceiling(policy, bound):
    label_namespace(policy, bound, "500")
    wait_ceiling(policy, bound, 500)
    assert create(policy, bound, job("at-label", 500)).returncode == 0
    above = create(policy, bound, job("above-label", 501))
    assert refused_by_policy(above), above.stderr
    assert "spec.resources.priority 501 is above 500" in above.stderr and f"(its label {LABEL})" in above.stderr
    # A label may lower the ceiling below the default too.
    label_namespace(policy, bound, "10")
    wait_ceiling(policy, bound, 10)
    assert refused_by_policy(create(policy, bound, job("above-low", 11)))


def test_raising_the_label_allows_what_was_refused(policy, bound):
    wanted = DEFAULT_CEILING + 200
    refused = create(policy, bound, job("urgent", wanted))
    assert refused_by_policy(refused), refused.stderr
    label_namespace(policy, bound, str(wanted))
    wait_ceiling(policy, bound, wanted)
    created = create(policy, bound, job("urgent", wanted))
    assert created.returncode == 0, created.stderr
    assert policy.get_json("vj", "urgent", "-n", bound)["spec"]["resources"]["priority"] == wanted


def test_updates_cannot_raise_the_priority(policy, bound):
    """A patch raising the priority above the ceiling is refused (the CRD's immutable
    spec refuses any spec change first; the policy checks raised priorities on UPDATE
    too, in case that ever changes). A job created under a higher ceiling stays
    editable once the ceiling is lowered: only raised priorities are checked, so the
    operator's finalizers and labels keep working."""
    assert create(policy, bound, job("steady", DEFAULT_CEILING)).returncode == 0
    raise_it = policy.kubectl("patch", "vj", "steady", "-n", bound, "--type=merge",
                              "-p", json.dumps({"spec": {"resources": {"priority": DEFAULT_CEILING + 1}}}), check=False)
    assert raise_it.returncode != 0, raise_it.stdout
    assert "spec is immutable" in raise_it.stderr or refused_by_policy(raise_it), raise_it.stderr
    assert policy.get_json("vj", "steady", "-n", bound)["spec"]["resources"]["priority"] == DEFAULT_CEILING

    label_namespace(policy, bound, "300")
    wait_ceiling(policy, bound, 300)
    assert create(policy, bound, job("high", 300)).returncode == 0
    label_namespace(policy, bound, None)  # back to the default ceiling, below the job's 300
    wait_ceiling(policy, bound, DEFAULT_CEILING)
    edited = policy.kubectl("label", "vj", "high", "-n", bound, "team=video", check=False)
    assert edited.returncode == 0, edited.stderr
    try:
        finalized = policy.kubectl("patch", "vj", "high", "-n", bound, "--type=merge",
                                   "-p", json.dumps({"metadata": {"finalizers": ["videojob.io/test"]}}), check=False)
        assert finalized.returncode == 0, finalized.stderr
    finally:  # a finalizer left behind would hold the namespace in Terminating
        policy.kubectl("patch", "vj", "high", "-n", bound, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                       check=False)


def test_a_malformed_label_refuses_with_its_own_message(policy, bound):
    label_namespace(policy, bound, "high")
    def refused():
        result = create(policy, bound, job("any", 0), dry_run=True)
        return refused_by_policy(result) and result
    result = wait_for("the malformed label to take effect", refused, timeout=EFFECT_TIMEOUT_S, interval=0.5)
    assert f"the label {LABEL}=high of namespace {bound} is not a whole number" in result.stderr
