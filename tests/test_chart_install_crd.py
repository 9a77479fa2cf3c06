"""The documented CRD upgrade path, on the full loopback cluster (DESIGN.md "Testing
layers", 5): helm installs crds/ once and never upgrades them (README "Helm chart",
NOTES.txt), so `kubectl apply --server-side --force-conflicts -f charts/videojob/crds/`
comes before `helm upgrade`. The release is ci/embedded.yaml; the CRD, the cluster's,
ends as the current one. Fixtures and helpers: tests/chart_install_support.py.
"""
from __future__ import annotations

import copy
import json
import shutil

import yaml

from chart_install_support import CHART, EMBEDDED_VALUES, RELEASE, installed, wait_established
from chart_install_support import helm  # noqa: F401 - fixture
from helpers import REPO, wait_for
from videojob.crd import CRD_NAME


CRD_FILE = next((CHART / "crds").glob("*.yaml"))


def _job(name: str, **spec) -> str:
    job = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"].update(spec)
    return json.dumps(job)


def _spec_fields(cluster) -> set[str]:
    (version,) = [v for v in cluster.get_json("crd", CRD_NAME)["spec"]["versions"] if v["storage"]]
    return set(version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])


def test_crd_upgrade_path(full_cluster, helm, full_namespaces, tmp_path):
    """Helm installs crds/ once and never upgrades them (README "Helm chart", NOTES.txt):
    with a release whose CRD is older (the current one without the optional
    spec.negativePrompt, written here), `helm upgrade` alone leaves the old schema (the
    API server refuses the new field, or prunes it); `kubectl apply --server-side
    --force-conflicts -f charts/videojob/crds/` and then `helm upgrade` serve the new
    field, and the VideoJob made before is intact. The CRD is the cluster's: it ends as
    the current one whatever happens."""
    system, jobs = full_namespaces(), full_namespaces()
    field, text = "negativePrompt", "blurry, low quality"
    current = yaml.safe_load(CRD_FILE.read_text())
    old = copy.deepcopy(current)
    for version in old["spec"]["versions"]:
        del version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][field]
    old_chart = tmp_path / "videojob-old"
    shutil.copytree(CHART, old_chart)
    (old_chart / "crds" / CRD_FILE.name).write_text(yaml.safe_dump(old, sort_keys=False))
    args = ["-f", str(EMBEDDED_VALUES), "--set", f"watch.namespaces={{{jobs}}}"]
    documented = ["apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds") + "/"]
    try:
        if full_cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0:
            # another release put the CRD here already (helm install would skip it): make it the
            # older one, owned by helm as an older install would have left it
            full_cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=helm",
                                 "-f", str(old_chart / "crds" / CRD_FILE.name))
        with installed(helm, system, args, chart=old_chart):
            wait_established(full_cluster, CRD_NAME)
            assert field not in _spec_fields(full_cluster)
            full_cluster.kubectl("create", "-n", jobs, "-f", "-", input=_job("before"))
            before = full_cluster.get_json("vj", "before", "-n", jobs)

            notes = helm("upgrade", RELEASE, str(CHART), "--namespace", system, *args).stdout
            assert field not in _spec_fields(full_cluster), "helm upgrade changed the CRD"
            # NOTES.txt says what to run: the command this test runs below
            assert "kubectl apply --server-side --force-conflicts -f charts/videojob/crds/" in notes, notes
            refused = full_cluster.kubectl("apply", "-n", jobs, "-f", "-", input=_job("after", **{field: text}),
                                           check=False)
            assert refused.returncode != 0 and "unknown field" in refused.stderr and field in refused.stderr, (
                refused.stdout + refused.stderr)
            full_cluster.kubectl("apply", "--validate=false", "-n", jobs, "-f", "-",
                                 input=_job("pruned", **{field: text}))
            assert field not in full_cluster.get_json("vj", "pruned", "-n", jobs)["spec"], "not pruned"

            # the documented path: the new CRD first, then helm upgrade
            full_cluster.kubectl(*documented)
            wait_established(full_cluster, CRD_NAME)
            assert field in _spec_fields(full_cluster)
            wait_for("the API server to serve the new schema", lambda: full_cluster.kubectl(
                "apply", "--dry-run=server", "-n", jobs, "-f", "-", input=_job("after", **{field: text}),
                check=False).returncode == 0, timeout=30, interval=0.5)
            helm("upgrade", RELEASE, str(CHART), "--namespace", system, *args)
            full_cluster.kubectl("apply", "-n", jobs, "-f", "-", input=_job("after", **{field: text}))
            assert full_cluster.get_json("vj", "after", "-n", jobs)["spec"][field] == text
            still = full_cluster.get_json("vj", "before", "-n", jobs)
            assert still["metadata"]["uid"] == before["metadata"]["uid"]
            assert still["spec"] == before["spec"]
            live = full_cluster.get_json("crd", CRD_NAME)["spec"]["versions"]
            assert [v["schema"] for v in live] == [v["schema"] for v in current["spec"]["versions"]]
    finally:
        full_cluster.kubectl(*documented, check=False)
