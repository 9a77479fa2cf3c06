"""The Helm chart refusing bad values, rendered by `helm template` (no cluster; the helm
binary as in tests/test_chart.py): values.schema.json refuses them naming the value,
and with schema validation skipped the templates still refuse the combinations they
check, saying what to do. Fixtures and helpers: tests/chart_support.py."""

from __future__ import annotations

import re

import pytest

from chart_support import CHART, NAMESPACE, RELEASE, TOKEN, _class, _merged, of_kind, one, ray_containers
from chart_support import chart, helm  # noqa: F401 - fixtures


# --- modes that need a value ----------------------------------------------------------------------

def test_address_mode_requires_an_address(chart):
    result = chart.template(values={"ray": {"mode": "address"}})
    assert result.returncode != 0
    assert re.search(r"ray[./]address", result.stderr), result.stderr


def test_kuberay_requires_a_token(chart):
    """The schema refuses kuberay mode without ray.auth.existingSecret, naming it; with
    schema validation skipped the template says what to do."""
    result = chart.template(values={"ray": {"mode": "kuberay"}})
    assert result.returncode != 0, "kuberay without a token was accepted"
    assert "/ray/auth/existingSecret" in result.stderr, result.stderr
    skipped = chart.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--skip-schema-validation",
                        "--set", "ray.mode=kuberay")
    assert skipped.returncode != 0
    assert "ray.auth.existingSecret" in skipped.stderr and "kubectl create secret" in skipped.stderr, skipped.stderr
    docs = chart.render(values=TOKEN)
    for where, container in ray_containers(one(docs, "RayCluster")):
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", where
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ray-token", where


def test_kuberay_claim_without_read_write_many_is_refused(chart):
    """The schema refuses a kuberay claim that only one node can mount, naming the value; with
    schema validation skipped the template says the value and the fix. Explicit lists with
    ReadWriteMany pass, and other modes may use ReadWriteOnce."""
    bad = _merged(TOKEN, {"persistence": {"accessModes": ["ReadWriteOnce"]}})
    result = chart.template(values=bad)
    assert result.returncode != 0, "kuberay with a ReadWriteOnce claim was accepted"
    assert "/persistence/accessModes" in result.stderr, result.stderr
    skipped = chart.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--skip-schema-validation",
                        "--set", "ray.mode=kuberay", "--set", "ray.auth.existingSecret=t",
                        "--set", "persistence.accessModes={ReadWriteOnce}")
    assert skipped.returncode != 0
    assert "persistence.accessModes" in skipped.stderr and "ReadWriteMany" in skipped.stderr, skipped.stderr
    good = _merged(TOKEN, {"persistence": {"accessModes": ["ReadWriteMany", "ReadOnlyMany"]}})
    assert one(chart.render(values=good), "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany",
                                                                                              "ReadOnlyMany"]
    rwo = {"ray": {"mode": "embedded"}, "persistence": {"accessModes": ["ReadWriteOnce"]}}
    assert one(chart.render(values=rwo), "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    # an existing claim is the user's (README: it must be ReadWriteMany); the chart makes none
    existing = _merged(TOKEN, {"persistence": {"existingClaim": "shared"}})
    assert not of_kind(chart.render(values=existing), "PersistentVolumeClaim")


# --- the schema ---------------------------------------------------------------------------------

@pytest.mark.parametrize("values,problem", [
    ({"bogusKey": 1}, r"bogusKey"),
    ({"ray": {"mode": "bogus"}}, r"/ray/mode.*(embedded|one of)"),
    ({"gpuClasses": [_class(gpusPerPod=-1)]}, r"/gpuClasses/0/gpusPerPod"),
    ({"gpuClasses": [_class(gpuMemory=None)]}, r"/gpuClasses/0.*gpuMemory"),
], ids=["unknown-key", "bad-mode", "negative-gpus", "no-gpu-memory"])
def test_schema_refuses(chart, values, problem):
    result = chart.template(values=values)
    assert result.returncode != 0, f"helm template accepted {values}"
    assert re.search(problem, result.stderr), f"the error does not name the problem ({problem}):\n{result.stderr}"


@pytest.mark.parametrize("values,problem", [
    ({"gpuClasses": [_class(rayStartParams={"num-cpus": "4"})]}, r"/gpuClasses/0/rayStartParams"),
    ({"gpuClasses": [_class(rayStartParams={"resources": "'{\"x\": 1}'"})]}, r"/gpuClasses/0/rayStartParams"),
    ({"ray": {"kuberay": {"drivers": {"rayStartParams": {"memory": "1000"}}}}}, r"/ray/kuberay/drivers/rayStartParams"),
    ({"ray": {"kuberay": {"head": {"rayStartParams": {"system-config": '{"a": 1}'}}}}},
     r"/ray/kuberay/head/rayStartParams/system-config"),
    ({"ray": {"kuberay": {"head": {"rayStartParams": {"object-store-memory": 100000000}}}}},
     r"/ray/kuberay/head/rayStartParams/object-store-memory"),
    ({"gpuClasses": [_class(name="drivers")]}, r"/gpuClasses/0/name"),
], ids=["class-num-cpus", "class-resources", "drivers-memory", "unquoted-json", "not-a-string", "class-drivers"])
def test_schema_refuses_ray_start_params_kuberay_sets_or_bash_breaks(chart, values, problem):
    """Flags the group's `resources` field sets (KubeRay refuses both), flags KubeRay writes,
    values bash would mangle (double-quoted JSON outside single quotes), non-strings, and a
    class named like the drivers' group."""
    result = chart.template(values=_merged(TOKEN, values))
    assert result.returncode != 0, f"helm template accepted {values}"
    assert re.search(problem, result.stderr), f"the error does not name the problem ({problem}):\n{result.stderr}"


def test_schema_accepts_the_valid_class(chart):
    """The refusals above are the changed field's, not of the base class they start from."""
    chart.render(values={"gpuClasses": [_class()]})
