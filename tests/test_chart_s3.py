"""The chart's `runtime.s3` values (issue 23): what every runtime container gets, and that it works.

Not only rendered: one rendered Ray container's environment, with its
secretKeyRefs read from the Secret the admin would create, is handed to a
real runtime process that uploads to a real S3 server (rclone's `serve s3`)
and reads the object back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from chart_support import chart, helm, pod_specs, ray_containers, of_kind, TOKEN  # noqa: F401 - fixtures
from helpers import REPO, require_module

sys.path.insert(0, str(REPO / "hack" / "cluster"))

from lc.s3 import start_s3_server  # noqa: E402

S3 = {"region": "us-east-1", "buckets": ["videos", "models"], "credentialsSecret": "videojob-s3",
      "presignExpiryS": 3600}


def _values(**s3) -> dict:
    return {**TOKEN, "runtime": {"s3": {**S3, **s3}}}


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_nothing_of_s3_is_rendered_by_default(chart):
    for where, pod in pod_specs(chart.render(None, TOKEN)):
        for container in pod["containers"]:
            names = [e["name"] for e in container.get("env", [])]
            assert not [n for n in names if n.startswith(("VIDEOJOB_S3_", "AWS_"))], (where, names)


def test_every_ray_container_gets_the_store_and_the_secret_s_credentials(chart):
    docs = chart.render(None, _values(endpointUrl="https://s3.example.com"))
    (rc,) = of_kind(docs, "RayCluster")
    for where, container in ray_containers(rc):
        env = _env(container)
        assert env["VIDEOJOB_S3_ENDPOINT_URL"]["value"] == "https://s3.example.com", where
        assert env["VIDEOJOB_S3_BUCKETS"]["value"] == "videos,models"
        assert env["VIDEOJOB_S3_TENANT_PREFIX"]["value"] == "videojob-tenants"  # issue 36, 12: the default
        assert env["VIDEOJOB_S3_CACHE_ROOT"]["value"].endswith("/s3-cache")
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "videojob-s3",
                                                                             "key": "AWS_SECRET_ACCESS_KEY"}
        assert "value" not in env["AWS_ACCESS_KEY_ID"], "credentials only by reference"


@pytest.mark.parametrize("bad", [{"buckets": ["Not_A_Bucket"]}, {"endpointUrl": "s3.example.com"},
                                 {"credentials": "inline"}, {"presignExpiryS": 10**7}, {"tenantPrefix": ""},
                                 {"tenantPrefix": "a/../b"}, {"tenantPrefix": "a..b"}, {"tenantPrefix": "/x"}])
def test_bad_s3_values_are_refused_by_the_schema(chart, bad):
    result = chart.template(None, _values(**bad))
    assert result.returncode != 0 and "s3" in result.stderr, result.stderr


def test_the_rendered_environment_uploads_to_a_real_store(chart, tmp_path):
    require_module("boto3")
    server = start_s3_server(tmp_path / "data", tmp_path / "rclone.log")
    try:
        secret = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
        docs = chart.render(None, _values(endpointUrl=server.endpoint, tenantPrefix="jobs/tenants"))
        (rc,) = of_kind(docs, "RayCluster")
        _, container = ray_containers(rc)[0]
        env = {}
        for name, entry in _env(container).items():
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["name"] == "videojob-s3":  # (the Ray token's Secret is another one)
                env[name] = secret[ref["key"]]
            elif "value" in entry:
                env[name] = entry["value"]
        env = {k: v for k, v in env.items() if k.startswith(("VIDEOJOB_S3_", "AWS_"))}
        env["VIDEOJOB_S3_CACHE_ROOT"] = str(tmp_path / "cache")  # the pod's data volume, here
        bucket = "videos"
        (tmp_path / "data" / bucket).mkdir(parents=True)  # rclone: a bucket is a folder
        payload = uuid.uuid4().hex
        script = (
            "import sys, pathlib\n"
            "from videojob.settings import S3Settings\n"
            "from videojob_runtime import s3store\n"
            "s = S3Settings(); c = s3store.client(s)\n"
            "p = pathlib.Path(sys.argv[1]); p.write_text(sys.argv[2])\n"
            "w = s3store.locate('s3://videos/clips', 'output', 'spec.output.uri', 'team-a', s)\n"
            "print(s3store.upload(c, p, w.child('x.txt'), s)['uri'])\n"
            "bad = s3store.locate('s3://private/x', 'input', 'spec.image', 'team-a', s)\n")
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("VIDEOJOB_S3_", "AWS_"))}
        result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "x.txt"), payload],
                                capture_output=True, text=True, timeout=120, env={**clean, **env})
        assert "s3://videos/jobs/tenants/team-a/clips/x.txt" in result.stdout, result.stdout + result.stderr
        assert "bucket private is not one this cluster lets jobs use" in result.stderr, result.stderr
        assert (tmp_path / "data" / bucket / "jobs" / "tenants" / "team-a" / "clips" / "x.txt").read_text() == payload
    finally:
        server.stop()
