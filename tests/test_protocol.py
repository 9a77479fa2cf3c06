"""The versioned driver protocol (``videojob.driver_protocol``), through the real
driver entrypoint: ``python -m videojob_runtime.driver --request ...``.

A newer operator's request with optional fields this driver does not know is
accepted (the fields are ignored and listed in its records); a request of
another major version, or one that requires a feature this driver lacks, is
refused with a ``ProtocolIncompatible`` result that says what the runtime
speaks, what the operator needs and what to do. Requests that use no 1.1
field still decode on a 1.0 driver (its strict model, as it shipped, is
reproduced here), because unused new fields are left off the wire.

The entrypoint runs without a Ray cluster, with VIDEOJOB_OUTPUT_ROOT on a
file: an accepted request gets past decoding and fails at its first check,
the output location (``spec.output.uri``), before Ray is asked for anything;
tests/test_driver.py runs one to the end on a real Ray.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from typing import Any, Literal, Optional

import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers import REPO
from videojob.driver_protocol import (
    FEATURES,
    PROTOCOL,
    DriverRequest,
    GroupRequest,
    ProtocolIncompatible,
    decode_request,
    records,
    result_of,
)

PY = sys.executable


def _request(**fields: Any) -> DriverRequest:
    uid = str(uuid.uuid4())
    job = dict(job_id="p", model_id="tiny-cogvideox", task="t2v", prompt="a test", width=64, height=64, frames=9,
               fps=8, steps=2, guidance=6.0)
    return DriverRequest(namespace="ns", name="p", uid=uid, group=GroupRequest(name=f"vj-{uid}"), job=job,
                         output_uri="local://videos/p", **fields)


def _wire(request: DriverRequest) -> dict[str, Any]:
    return json.loads(base64.urlsafe_b64decode(request.encode()))


def _encode(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode()


ACCEPTED = "spec.output.uri"  # the failure of a request that was decoded: its output root is a file


def _driver(encoded: str, tmp_path) -> subprocess.CompletedProcess:
    not_a_dir = tmp_path / "outputs-is-a-file"
    not_a_dir.write_text("")
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "VIDEOJOB_OUTPUT_ROOT": str(not_a_dir)}
    return subprocess.run([PY, "-m", "videojob_runtime.driver", "--request", encoded], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=env)


# -- through the driver entrypoint -------------------------------------------------------


def test_a_newer_requests_unknown_optional_fields_are_ignored_and_listed(tmp_path):
    data = _wire(_request())
    data["priority_hint"] = "high"  # a 1.2 operator's optional fields, top level, in the group and in the job
    data["group"]["numa_pinning"] = True
    data["job"]["film_grain"] = 0.1
    done = _driver(_encode(data), tmp_path)
    result = result_of(done.stdout)
    assert result is not None, done.stdout + done.stderr[-3000:]
    assert result["error"].get("field") == ACCEPTED, result  # decoded; then its output cannot be written
    assert result["protocol"] == PROTOCOL
    assert sorted(result["ignored"]) == ["group.numa_pinning", "job.film_grain", "priority_hint"], result
    assert all(r["protocol"] == PROTOCOL for r in records(done.stdout))
    assert "ignoring request field(s) this runtime does not know: group.numa_pinning, priority_hint" in done.stderr


@pytest.mark.parametrize("change,expected", [
    ({"version": 2}, f"this runtime speaks protocol {PROTOCOL}; the operator needs protocol 2.x: upgrade the "
                     "RayCluster's runtime image"),
    ({"requires": ["placement-wait", "streaming-output"]},
     f"this runtime speaks protocol {PROTOCOL} (features: placement-wait); the operator needs feature(s) "
     "streaming-output: upgrade the RayCluster's runtime image"),
    ({"version": 0}, "upgrade the operator to match the runtime"),
])
def test_an_incompatible_request_is_refused_saying_what_to_upgrade(tmp_path, change, expected):
    data = {**_wire(_request()), **change}
    done = _driver(_encode(data), tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    result = result_of(done.stdout)
    assert result["ok"] is False and result["error"]["reason"] == "ProtocolIncompatible", done.stdout
    assert expected in result["error"]["message"], result["error"]["message"]
    assert result["protocol"] == PROTOCOL and result["error"]["stage"] == "request"
    assert "Traceback" not in done.stderr


def test_a_request_this_driver_has_every_required_feature_of_runs(tmp_path):
    request = _request(requires=sorted(FEATURES))
    done = _driver(request.encode(), tmp_path)
    assert result_of(done.stdout)["error"].get("field") == ACCEPTED, done.stdout


# -- the encoding ------------------------------------------------------------------------


class _Group10(BaseModel):
    """GroupRequest as protocol 1.0 drivers have it (strict)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    device: Literal["cpu", "cuda"] = "cpu"
    bundle_resources: dict[str, float] = Field(default_factory=dict)
    cpus_per_rank: Optional[float] = None
    keep: bool = False


class _Request10(BaseModel):
    """DriverRequest as protocol 1.0 drivers have it: any unknown field is refused."""

    model_config = ConfigDict(extra="forbid")
    version: int = 1
    namespace: str
    name: str
    uid: str
    attempt: int = 1
    group: _Group10
    job: dict[str, Any]
    output_uri: Optional[str] = None
    placement_timeout_s: float = 300.0
    job_timeout_s: float = 3600.0
    progress_interval_s: float = 1.0


def test_new_optional_fields_are_left_off_the_wire_until_used():
    plain = _wire(_request())
    assert not {"requires", "placement_max_wait_s"} & set(plain) and "node_type" not in plain["group"], plain
    _Request10.model_validate(plain)  # a 1.0 driver still takes a request that uses nothing new
    used = _request(placement_max_wait_s=900.0, requires=["placement-wait"])
    used.group.node_type = "h100-80"
    wire = _wire(used)
    assert wire["placement_max_wait_s"] == 900.0 and wire["group"]["node_type"] == "h100-80"
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        _Request10.model_validate(wire)  # what a 1.0 driver answers (the operator maps it: ProtocolIncompatible)
    decoded, ignored = decode_request(used.encode())
    assert decoded == used and ignored == []


def test_decode_refuses_before_it_validates():
    with pytest.raises(ProtocolIncompatible, match="protocol 3.x"):
        decode_request(_encode({"version": 3, "whatever": "shape"}))
    with pytest.raises(ValueError, match="not an object"):
        decode_request(_encode(["a", "list"]))
