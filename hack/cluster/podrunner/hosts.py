"""Name resolution for the pods: a per-pod /etc/hosts standing in for cluster DNS, and a
resolv.conf that fails every other name at once.

Service names resolve to the addresses of the pods behind them, read from the
EndpointSlices kube-controller-manager writes (ready endpoints; it already marks
not-ready ones ready for publishNotReadyAddresses Services). Every pod gets
`svc.ns`, `svc.ns.svc` and `svc.ns.svc.cluster.local`; pods in the Service's namespace
also get `svc`. Headless Services also name each endpoint with a hostname
(`host.svc.ns.svc.cluster.local`). The apiserver's Service names its ClusterIP, which
the runner serves in every pod's network namespace."""
from __future__ import annotations

from dataclasses import dataclass

CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class Record:
    ip: str
    names: tuple[str, ...]
    namespace: str          # short names (`names[0]` without the dots) only for pods of this namespace
    short: str | None


def service_records(services: list[dict], slices: list[dict],
                    routed_cluster_ips: dict[tuple[str, str], str]) -> list[Record]:
    """Records for every Service. routed_cluster_ips: (ns, name) -> ClusterIP the runner
    serves itself (the apiserver's); every other Service resolves to its endpoints."""
    by_service: dict[tuple[str, str], list[dict]] = {}
    for s in slices:
        svc = (s.get("metadata", {}).get("labels") or {}).get("kubernetes.io/service-name")
        if svc:
            by_service.setdefault((s["metadata"]["namespace"], svc), []).append(s)
    records: list[Record] = []
    for svc in sorted(services, key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])):
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        spec = svc.get("spec", {})
        if spec.get("type") == "ExternalName":
            continue
        names = (f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.{CLUSTER_DOMAIN}")
        routed = routed_cluster_ips.get((ns, name))
        if routed:
            records.append(Record(routed, names, ns, name))
            continue
        headless = spec.get("clusterIP") == "None"
        ips: set[str] = set()
        for sl in by_service.get((ns, name), []):
            for ep in sl.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready") is False:
                    continue
                for ip in ep.get("addresses") or []:
                    ips.add(ip)
                    if headless and ep.get("hostname"):
                        host = f"{ep['hostname']}.{name}.{ns}.svc.{CLUSTER_DOMAIN}"
                        records.append(Record(ip, (host,), ns, None))
        for ip in sorted(ips, key=_ip_key):
            records.append(Record(ip, names, ns, name))
    return records


def _ip_key(ip: str):
    try:
        return tuple(int(x) for x in ip.split("."))
    except ValueError:
        return (999, ip)


def pod_hostname(pod: dict) -> tuple[str, str | None]:
    """(hostname, fqdn or None) as the kubelet computes them: spec.hostname or the pod name
    (cut to 63 characters), and the FQDN when spec.subdomain is set."""
    spec, meta = pod.get("spec", {}), pod["metadata"]
    host = spec.get("hostname") or meta["name"]
    host = host[:63].rstrip("-.")
    sub = spec.get("subdomain")
    fqdn = f"{host}.{sub}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}" if sub else None
    return host, fqdn


def render_hosts(pod: dict, pod_ip: str, records: list[Record]) -> str:
    ns = pod["metadata"]["namespace"]
    host, fqdn = pod_hostname(pod)
    lines = [
        "# Kubernetes-managed hosts file (podrunner: Service names stand in for cluster DNS).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
        f"{pod_ip}\t{fqdn + ' ' if fqdn else ''}{host}",
    ]
    if records:
        lines.append("# Services (from EndpointSlices)")
    for r in records:
        names = list(r.names)
        if r.short and r.namespace == ns:
            names.append(r.short)
        lines.append(f"{r.ip}\t{' '.join(names)}")
    aliases = pod.get("spec", {}).get("hostAliases") or []
    if aliases:
        lines.append("# Entries added by HostAliases.")
        for a in aliases:
            lines.append(f"{a['ip']}\t{' '.join(a.get('hostnames') or [])}")
    return "\n".join(lines) + "\n"


def render_resolv_conf(pod: dict) -> str:
    """Nothing listens on 127.0.0.1:53 inside the pod's network namespace: a name that the
    hosts file lacks fails at once (connection refused) instead of after DNS timeouts."""
    ns = pod["metadata"]["namespace"]
    return (f"# podrunner: names come from /etc/hosts only; nothing answers DNS here.\n"
            f"nameserver 127.0.0.1\n"
            f"search {ns}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\n"
            f"options ndots:5 timeout:1 attempts:1\n")
