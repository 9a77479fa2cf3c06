"""The chart's values without helm: docs/chart.md's values table is current, every
value is documented, the operator settings the chart renders are the
operator's own (names and defaults), and the chart's appVersion is the
package's version."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from helpers import REPO

CHART = REPO / "charts" / "videojob"
SCRIPT = REPO / "hack" / "values_table.py"


def _values_table():
    spec = importlib.util.spec_from_file_location("values_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_readme_values_table_is_current():
    """`--check` is what CI runs: docs/chart.md must hold exactly the generated table."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr + "\n(run `make values-table` and commit docs/chart.md)"


def test_check_fails_on_drift(tmp_path):
    table = _values_table()
    readme = (REPO / "docs" / "chart.md").read_text()
    stale = readme.replace("| `ray.mode` |", "| `ray.mode2` |")
    assert stale != readme
    path = tmp_path / "chart.md"
    path.write_text(stale)
    assert table.main(["--check", "--readme", str(path)]) == 1
    assert table.main(["--readme", str(path)]) == 0  # rewrites it
    assert path.read_text() == readme


def test_every_value_has_a_row_with_a_description():
    table = _values_table()
    rows = table.rows()
    keys = [r.key for r in rows]
    assert len(keys) == len(set(keys))
    assert all(r.description.strip() for r in rows)
    for key in ("ray.mode", "gpuClasses", "gpuClasses[].gpusPerPod", "watch.clusterWide",
                "persistence.existingClaim", "metrics.serviceMonitor.enabled", "operator.settings.maxAttempts"):
        assert key in keys


def test_undocumented_value_is_refused(tmp_path):
    """A value added to values.yaml without a `# --` comment fails the generator, naming it."""
    table = _values_table()
    chart = tmp_path / "chart"
    chart.mkdir()
    (chart / "values.schema.json").write_text((CHART / "values.schema.json").read_text())
    text = (CHART / "values.yaml").read_text().replace("  # -- Its name (empty: the full name).\n", "")
    (chart / "values.yaml").write_text(text)
    with pytest.raises(table.TableError, match="serviceAccount.name"):
        table.rows(chart)


def test_comment_reader_follows_nesting():
    table = _values_table()
    text = ("# -- top\na: 1\nb:\n  # -- nested\n  # more\n  c: x\n  list:\n    - name: q\n      # -- not a value\n"
            "      d: 1\n  # -- after the list\n  e: 2\n")
    assert table.comments(text) == {"a": "top", "b.c": "nested more", "b.e": "after the list"}


# The operator settings the chart sets outside operator.settings, and the one it
# deliberately never sets (tests only: it makes jobs fail on purpose).
RENDERED_ELSEWHERE = {
    "ray_mode": "ray.mode",
    "ray_dashboard_url": "ray.address / the RayCluster's head Service",
    "ray_token_file": "ray.auth.existingSecret",
    "runtime_key_file": "runtimeKey.* (the runtime key Secret, mounted)",
    "inventory_file": "the inventory ConfigMap",
    "namespaces": "watch.*",
    "metrics_port": "metrics.port",
    "embedded_ray_cpus": "ray.embedded.cpus",
    "driver_resources": "ray.kuberay.drivers (kuberay: one vj-driver per driver)",
}
NOT_IN_CHART = {"allow_fault_injection"}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_operator_settings_are_the_operators_own():
    from videojob.settings import OperatorSettings

    fields = OperatorSettings.model_fields
    settings = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["settings"]
    for key, value in settings.items():
        name = _snake(key)
        assert name in fields, f"operator.settings.{key}: the operator has no setting {name}"
        assert value == fields[name].default, (
            f"operator.settings.{key} defaults to {value!r}, the operator to {fields[name].default!r}")
    covered = {_snake(k) for k in settings} | set(RENDERED_ELSEWHERE) | NOT_IN_CHART
    assert set(fields) == covered, f"not reachable from the chart: {sorted(set(fields) - covered)}"


def test_env_names_in_templates_are_real_settings():
    """Every VIDEOJOB_* the templates write is an OperatorSettings field, a runtime setting
    (RunSettings: the runtime in the Ray containers) or a runtime root
    (runtime/videojob_runtime/locations.py); camelCase keys become VIDEOJOB_<SNAKE_CASE>."""
    from videojob.settings import OperatorSettings, RunSettings

    locations = (REPO / "runtime" / "videojob_runtime" / "locations.py").read_text()
    runtime_roots = set(re.findall(r'"(VIDEOJOB_[A-Z_]+)"', locations))
    assert {"VIDEOJOB_OUTPUT_ROOT", "VIDEOJOB_MODEL_ROOT", "VIDEOJOB_DATA_ROOT", "VIDEOJOB_VOLUMES_ROOT"} <= runtime_roots
    known = {f"VIDEOJOB_{name.upper()}" for name in [*OperatorSettings.model_fields, *RunSettings.model_fields]}
    known |= runtime_roots
    text = "".join(p.read_text() for p in (CHART / "templates").glob("*"))
    written = set(re.findall(r"VIDEOJOB_[A-Z][A-Z_]*[A-Z]", text))
    assert written, "no VIDEOJOB_ variables found in the templates"
    assert written <= known, f"not read by the operator or the runtime: {sorted(written - known)}"


def test_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert str(chart["appVersion"]) == project["version"]

