"""Certificates (openssl command-line tool) and kubeconfigs.

pki/ holds the cluster CA, the apiserver's serving cert, client certs (admin
with O=system:masters, kube-controller-manager, kube-scheduler), the
ServiceAccount signing key pair and the front-proxy CA with its client cert.
It is made once and kept across down/up, so issued tokens and kubeconfigs
survive a restart; delete <cluster dir>/pki to regenerate it.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .common import SERVICE_IP, ClusterError, log


def openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if not exe:
        raise ClusterError("the `openssl` command is required to make the cluster certificates")
    res = subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args)} failed:\n{res.stdout}")


def make_pki(pki: Path) -> None:
    """CA, apiserver serving cert, admin + controller-manager client certs, SA keys,
    front-proxy CA + client cert.

    Made once and kept across down/up, so issued tokens and kubeconfigs survive
    a restart.  Delete .cluster/pki to regenerate.
    """
    needed = ["ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "admin.crt", "admin.key",
              "controller-manager.crt", "controller-manager.key", "sa.key", "sa.pub",
              "front-proxy-ca.crt", "front-proxy-client.crt", "front-proxy-client.key"]
    if all((pki / f).exists() for f in needed):
        return
    log(f"generating certificates in {pki}")
    if pki.exists():
        shutil.rmtree(pki)
    tmp = Path(tempfile.mkdtemp(prefix="pki.", dir=pki.parent))
    os.chmod(tmp, 0o700)
    days = "3650"

    def key(name: str) -> str:
        path = str(tmp / f"{name}.key")
        openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", path)
        return path

    def signed(name: str, subj: str, ext: str, ca: str = "ca") -> None:
        k = key(name)
        csr = tmp / f"{name}.csr"
        extfile = tmp / f"{name}.ext"
        extfile.write_text(ext)
        openssl("req", "-new", "-key", k, "-subj", subj, "-out", str(csr))
        openssl("x509", "-req", "-in", str(csr), "-CA", str(tmp / f"{ca}.crt"), "-CAkey",
                str(tmp / f"{ca}.key"), "-CAcreateserial", "-days", days, "-sha256",
                "-extfile", str(extfile), "-out", str(tmp / f"{name}.crt"))
        csr.unlink()
        extfile.unlink()

    def make_ca(name: str, cn: str) -> None:
        openssl("req", "-x509", "-new", "-key", key(name), "-subj", f"/CN={cn}", "-days", days,
                "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                "-out", str(tmp / f"{name}.crt"))

    make_ca("ca", "videojob-test-ca")
    # requestheader (front proxy) CA: not needed by the tests, but without it
    # kube-controller-manager logs errors about the missing CA bundle forever.
    make_ca("front-proxy-ca", "videojob-test-front-proxy-ca")
    common = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    sans = ",".join([
        "IP:127.0.0.1", "IP:::1", f"IP:{SERVICE_IP}", "DNS:localhost", "DNS:kubernetes",
        "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ])
    signed("apiserver", "/CN=kube-apiserver",
           common + f"extendedKeyUsage=serverAuth\nsubjectAltName={sans}\n")
    signed("admin", "/O=system:masters/CN=videojob-admin", common + "extendedKeyUsage=clientAuth\n")
    signed("controller-manager", "/CN=system:kube-controller-manager",
           common + "extendedKeyUsage=clientAuth\n")
    signed("front-proxy-client", "/CN=front-proxy-client", common + "extendedKeyUsage=clientAuth\n",
           ca="front-proxy-ca")
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", str(tmp / "sa.key"))
    openssl("pkey", "-in", str(tmp / "sa.key"), "-pubout", "-out", str(tmp / "sa.pub"))
    for f in tmp.iterdir():
        if f.suffix in (".key", ".srl"):
            os.chmod(f, 0o600)
    tmp.replace(pki)


def make_client_cert(pki: Path, name: str, subj: str) -> None:
    """A client certificate signed by the cluster CA (kept like the rest of pki/)."""
    if (pki / f"{name}.crt").exists() and (pki / f"{name}.key").exists():
        return
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=pki))
    try:
        key, csr, ext, crt = (tmp / f"{name}.{x}" for x in ("key", "csr", "ext", "crt"))
        openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key))
        os.chmod(key, 0o600)
        ext.write_text("basicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=clientAuth\n")
        openssl("req", "-new", "-key", str(key), "-subj", subj, "-out", str(csr))
        openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey",
                str(pki / "ca.key"), "-CAserial", str(tmp / "ca.srl"), "-CAcreateserial",
                "-days", "3650", "-sha256", "-extfile", str(ext), "-out", str(crt))
        key.replace(pki / f"{name}.key")
        crt.replace(pki / f"{name}.crt")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def b64file(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, ca: Path, user: dict, context: str,
                     namespace: str | None = None) -> None:
    """Write a kubeconfig. JSON is valid YAML, so no YAML library is needed."""
    ctx = {"cluster": "videojob-local", "user": context}
    if namespace:
        ctx["namespace"] = namespace
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "videojob-local",
                      "cluster": {"server": server, "certificate-authority-data": b64file(ca)}}],
        "users": [{"name": context, "user": user}],
        "contexts": [{"name": context, "context": ctx}],
        "current-context": context,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(cfg, fh, indent=2)
        fh.write("\n")
    tmp.replace(path)


def cert_user(pki: Path, name: str) -> dict:
    return {"client-certificate-data": b64file(pki / f"{name}.crt"),
            "client-key-data": b64file(pki / f"{name}.key")}
