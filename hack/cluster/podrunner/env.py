"""A container's environment, resolved as the kubelet does (makeEnvironmentVariables),
plus `$(VAR)` expansion of values, command, args and subPathExpr.

Order and precedence, lowest first: HOSTNAME and the image's env (the runtime's part),
the Service link variables (`<SVC>_SERVICE_HOST`...; the `kubernetes` Service in
`default` always, the pod's namespace's Services unless enableServiceLinks is false),
envFrom in order, env in order (later entries win)."""
from __future__ import annotations

import base64
import re
from typing import Callable, Mapping

from .quantity import resource_value

# Resolver answers: a dict, or None when the object does not exist.
Getter = Callable[[str, str, str], "dict | None"]  # (kind "ConfigMap"|"Secret", namespace, name)


class ConfigError(Exception):
    """A container cannot start until something exists (kubelet: CreateContainerConfigError)."""


def expand(text: str, *maps: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: `$$` is a literal `$`, an unknown or incomplete
    reference is left as written, any other `$x` is kept."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != "$" or i + 1 >= n:
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2:end]
            for m in maps:
                if name in m:
                    out.append(m[name])
                    break
            else:
                out.append(f"$({name})")
            i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


def service_link_env(services: list[dict]) -> dict[str, str]:
    """Docker-link style variables of Services with a ClusterIP (kubelet envvars.FromServices)."""
    env: dict[str, str] = {}
    for svc in services:
        spec = svc.get("spec", {})
        ip = spec.get("clusterIP")
        ports = spec.get("ports") or []
        if not ip or ip == "None" or not ports:
            continue
        base = _env_name(svc["metadata"]["name"])
        env[f"{base}_SERVICE_HOST"] = ip
        env[f"{base}_SERVICE_PORT"] = str(ports[0]["port"])
        for p in ports:
            if p.get("name"):
                env[f"{base}_SERVICE_PORT_{_env_name(p['name'])}"] = str(p["port"])
        host = f"[{ip}]" if ":" in ip else ip
        for i, p in enumerate(ports):
            proto = (p.get("protocol") or "TCP")
            url = f"{proto.lower()}://{host}:{p['port']}"
            if i == 0:
                env[f"{base}_PORT"] = url
            pre = f"{base}_PORT_{p['port']}_{proto.upper()}"
            env[pre] = url
            env[pre + "_PROTO"] = proto.lower()
            env[pre + "_PORT"] = str(p["port"])
            env[pre + "_ADDR"] = ip
    return env


def services_for_pod(pod: dict, all_services: list[dict]) -> list[dict]:
    """The Services whose link variables a pod gets (kubelet getServiceEnvVarMap)."""
    ns = pod["metadata"]["namespace"]
    links = pod.get("spec", {}).get("enableServiceLinks", True) is not False
    chosen: dict[str, dict] = {}
    for svc in all_services:
        meta = svc["metadata"]
        ip = svc.get("spec", {}).get("clusterIP")
        if not ip or ip == "None":
            continue
        if meta["namespace"] == "default" and meta["name"] == "kubernetes":
            chosen.setdefault("kubernetes", svc)
        elif meta["namespace"] == ns and links:
            chosen[meta["name"]] = svc
    return [chosen[k] for k in sorted(chosen)]


_LABEL_RE = re.compile(r"^metadata\.(labels|annotations)\['(.*)'\]$")


def field_value(pod: dict, path: str) -> str:
    """A downward API fieldRef in an env var (the paths the API server accepts for env)."""
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs", []) or []),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs", []) or []),
    }
    if path in simple:
        return simple[path]
    m = _LABEL_RE.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{_escape(v)}"' for k, v in sorted(items.items()))
    raise ConfigError(f"unsupported fieldRef.fieldPath {path!r}")


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def container_resource(pod: dict, container_name: str, resource: str, divisor: str | None,
                       allocatable: Mapping[str, str]) -> str:
    """resourceFieldRef: limits.* fall back to the node's allocatable when unset."""
    containers = [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
    ctr = next((c for c in containers if c["name"] == container_name), None)
    if ctr is None:
        raise ConfigError(f"resourceFieldRef names container {container_name!r}, which the pod lacks")
    kind, _, res = resource.partition(".")
    if kind not in ("limits", "requests") or not res:
        raise ConfigError(f"unsupported resourceFieldRef.resource {resource!r}")
    resources = ctr.get("resources") or {}
    value = (resources.get(kind) or {}).get(res)
    if value is None and kind == "limits":
        value = allocatable.get(res)
    return resource_value(resource, value, divisor)


def _decode(data: str) -> str:
    return base64.b64decode(data).decode("utf-8", "surrogateescape")


def _object_data(kind: str, obj: dict) -> dict[str, str]:
    if kind == "Secret":
        return {k: _decode(v) for k, v in (obj.get("data") or {}).items()}
    return dict(obj.get("data") or {})


def build_env(pod: dict, container: dict, services: list[dict], get: Getter,
              allocatable: Mapping[str, str]) -> dict[str, str]:
    """The kubelet's part of a container's environment (no image env, no HOSTNAME).
    Raises ConfigError naming the missing ConfigMap/Secret/key (kubelet retries)."""
    ns = pod["metadata"]["namespace"]
    cname = container["name"]
    service_env = service_link_env(services_for_pod(pod, services))
    tmp: dict[str, str] = {}

    def lookup(kind: str, name: str, key: str | None, optional: bool, where: str) -> str | dict | None:
        obj = get(kind, ns, name)
        if obj is None:
            if optional:
                return None
            raise ConfigError(f'{kind.lower()} "{name}" not found (container {cname}, {where})')
        data = _object_data(kind, obj)
        if key is None:
            return data
        if key not in data:
            if optional:
                return None
            raise ConfigError(f"couldn't find key {key} in {kind} {ns}/{name} (container {cname}, {where})")
        return data[key]

    for i, src in enumerate(container.get("envFrom") or []):
        prefix = src.get("prefix", "")
        for kind, field in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            ref = src.get(field)
            if ref is None:
                continue
            data = lookup(kind, ref["name"], None, bool(ref.get("optional")), f"envFrom[{i}]")
            for k, v in (data or {}).items():
                name = prefix + k
                if name and "=" not in name:
                    tmp[name] = v
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item and item.get("value") not in (None, ""):
            tmp[name] = expand(item["value"], tmp, service_env)
            continue
        src = item.get("valueFrom")
        if not src:
            tmp[name] = ""
            continue
        where = f"env {name}"
        if "fieldRef" in src:
            tmp[name] = field_value(pod, src["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            tmp[name] = container_resource(pod, ref.get("containerName") or cname, ref["resource"],
                                           ref.get("divisor"), allocatable)
        elif "configMapKeyRef" in src or "secretKeyRef" in src:
            kind, ref = (("ConfigMap", src["configMapKeyRef"]) if "configMapKeyRef" in src
                         else ("Secret", src["secretKeyRef"]))
            value = lookup(kind, ref["name"], ref["key"], bool(ref.get("optional")), where)
            if value is None:
                continue  # optional and missing: the variable is not set at all
            tmp[name] = value
        else:
            raise ConfigError(f"container {cname}: env {name}: unsupported valueFrom {sorted(src)}")
    env = dict(service_env)
    env.update(tmp)
    return env


def final_env(hostname: str, image_env: Mapping[str, str], kubelet_env: Mapping[str, str]) -> dict[str, str]:
    """What the process gets: HOSTNAME, then the image's env, then the kubelet's (each overriding)."""
    env = {"HOSTNAME": hostname}
    env.update(image_env)
    env.update(kubelet_env)
    return env


def command_line(container: dict, image: Mapping, env: Mapping[str, str]) -> list[str]:
    """argv by the Kubernetes rules: command replaces ENTRYPOINT (and drops CMD), args
    replace CMD; `$(VAR)` expanded from the container's env."""
    command = container.get("command") or []
    args = container.get("args") or []
    if command:
        argv = [expand(c, env) for c in command] + [expand(a, env) for a in args]
    elif args:
        argv = list(image.get("entrypoint") or []) + [expand(a, env) for a in args]
    else:
        argv = list(image.get("entrypoint") or []) + list(image.get("cmd") or [])
    return argv
