"""What one container instance is made of: image, env, identity, argv, working dir,
mounts (and the host mount points they need), as the spec containerinit reads, plus the
probe target. Problems become the container's waiting reason, as the kubelet reports
them: ErrImagePull (not in the image map), CreateContainerConfigError."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import containers
from .env import ConfigError, build_env, command_line, final_env
from .hosts import pod_hostname
from .images import repository
from .probes import Target
from .status import CState
from .volumes import VolumeError

if TYPE_CHECKING:
    from .runner import Runner
    from .sandbox import Sandbox


def prepare(runner: "Runner", sandbox: "Sandbox", pod: dict, container: dict, cs: CState,
            ctr_dir: Path) -> tuple[dict, Target] | None:
    """(containerinit spec, probe target), or None with cs set to the waiting reason."""
    image = runner.images().lookup(container.get("image", ""))
    if image is None:
        repo = repository(container.get("image", ""))
        cs.state, cs.reason = "waiting", "ErrImagePull"
        cs.message = (f'image "{container.get("image")}" is not in the pod runner\'s image map '
                      f'{runner.image_map_path} (add an entry `image: {repo}`)')
        return None
    view = _with_ips(pod, sandbox.ip, runner.network.gateway)
    try:
        kenv = build_env(view, container, runner.services(), runner.get_object,
                         runner.allocatable(pod["spec"].get("nodeName", "")))
        uid, gid, groups = containers.identity(pod, container, image)
        hostname = pod_hostname(pod)[0] if not pod["spec"].get("hostNetwork") else pod["spec"].get("nodeName", "")
        env = final_env(hostname, image.env, kenv)
        argv = command_line(container, image, kenv)
        cwd = container.get("workingDir") or image.working_dir
        tmp = ctr_dir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        tmp.chmod(0o1777)
        profile = runner.profile_file(image)
        mounts = containers.plan_mounts(pod, container, sandbox.volumes.mounts, tmp, sandbox.pod_shm,
                                        profile, env)
        mounts += containers.workdir_mount(mounts, cwd, ctr_dir / "workdir", uid, gid)
        mounts += containers.image_path_mounts(mounts, image.paths)
        runner.host_paths.ensure(containers.host_paths_to_create(mounts))
        blocked = containers.blocked_dirs(containers.install_paths(env, cwd), uid, gid, groups)
        unmask = containers.unmask_specs(blocked, ctr_dir)
    except (ConfigError, VolumeError, ValueError) as exc:
        cs.state, cs.reason, cs.message = "waiting", "CreateContainerConfigError", str(exc)
        return None
    cs.image_id = f"{repository(container.get('image', ''))}@sha256:{image.digest}"
    spec = {"hostname": hostname, "unmask": unmask, "mounts": mounts, "nofile": containers.NOFILE,
            "uid": uid, "gid": gid, "groups": groups, "cwd": cwd, "argv": argv, "env": env}
    target = Target(container=container, pid1=0, env=env, uid=uid, gid=gid, groups=groups, cwd=cwd,
                    pod_ip=sandbox.ip, started_at=time.time())
    return spec, target


def _with_ips(pod: dict, pod_ip: str | None, host_ip: str) -> dict:
    view = dict(pod)
    status = dict(pod.get("status") or {})
    if pod_ip:
        status["podIP"], status["podIPs"] = pod_ip, [{"ip": pod_ip}]
    status["hostIP"], status["hostIPs"] = host_ip, [{"ip": host_ip}]
    view["status"] = status
    return view
