"""How the driver's request reaches it, and how it leaves nothing of it behind.

The operator submits a request on the command line (``--request <base64>``) or,
when it carries a secret (an https input's query), sealed under the runtime key
in the submission's runtime_env (``--request-env``: ``DriverRequest.submission``).
Ray keeps both for as long as the cluster lives (the GCS keeps a driver's command
line; the job table and the runtime env agent's log keep the runtime_env), so
the driver moves a command-line request into its environment (``hide_request``),
drops it from the environment and the job config before ``ray.init``
(``forget_request_env``: the ranks never inherit it), and opens a sealed one with
its own runtime key (``received_request``).
"""

from __future__ import annotations

import json
import os
import sys

from videojob import runtimekey
from videojob.driver_protocol import REQUEST_ENV

# Ray's job supervisor hands the submission's runtime_env to the driver here; ray.init
# makes it every task's and actor's.
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def forget_request_env() -> None:
    """Drop ``REQUEST_ENV`` from this process's environment and from the job config
    Ray's job supervisor passed it (a request submitted in the runtime_env:
    ``DriverRequest.submission``), before ``ray.init``: the ranks never inherit it
    and the GCS never keeps it."""
    os.environ.pop(REQUEST_ENV, None)
    text = os.environ.get(JOB_CONFIG_ENV)
    if not text:
        return
    try:
        config = json.loads(text)
        env_vars = (config.get("runtime_env") or {}).get("env_vars") or {}
    except (ValueError, AttributeError):
        return  # not ours to judge: ray.init reads it as it is
    if REQUEST_ENV in env_vars:
        del env_vars[REQUEST_ENV]
        os.environ[JOB_CONFIG_ENV] = json.dumps(config)


def hide_request() -> None:
    """Ray's GCS keeps every driver's command line (taken at ``ray.init``) for as long as
    the cluster lives, past the Jobs API record the operator deletes: a driver started
    as ``--request <base64>`` (prompts in it) runs itself again in the same process
    (exec: same pid, so Ray's job supervisor still follows and signals it) with the
    request in its environment, which Ray does not keep, and ``--request-env`` as its
    command line. A no-op for any other command line."""
    argv = sys.argv[1:]
    if len(argv) != 2 or argv[0] != "--request":
        return
    os.execve(sys.executable, [sys.executable, "-m", "videojob_runtime.driver", "--request-env"],
              {**os.environ, REQUEST_ENV: argv[1]})


def received_request(argument: str | None) -> str:
    """The request (base64 JSON) from ``--request`` or the environment, opened when sealed;
    forgets the environment's copy. Raises ``runtimekey.RuntimeKeyError`` when it was
    sealed under another key than this process's."""
    encoded = argument if argument is not None else os.environ.get(REQUEST_ENV, "")
    forget_request_env()
    if encoded.startswith(runtimekey.SEALED_PREFIX):
        return runtimekey.unseal(encoded).decode()
    return encoded
