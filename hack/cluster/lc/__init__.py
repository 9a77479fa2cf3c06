"""The loopback test cluster behind hack/cluster/localcluster.py, by component.

Stdlib only, Python 3.11+. localcluster.py puts hack/cluster on sys.path and
calls cli.main(); the modules import each other relatively.

    common.py        paths of a cluster dir, ClusterError, log, state.json, the lock
    procs.py         processes: start (own session), alive-by-pid+exe, stop, wait_until, free ports
    client.py        HTTP(S) health checks, the apiserver's REST API as admin, kubectl
    binaries.py      build-tools.sh / build-gotool.sh: resolve (or build) the binaries
    pki.py           certificates (openssl CLI) and kubeconfigs
    steps.py         what a component is: Step / Process, Run, start_and_wait
    controlplane.py  etcd, kube-apiserver, kube-controller-manager, kube-scheduler
    nodes.py         KWOK and the fake nodes (full mode)
    kuberay.py       KubeRay's CRDs and operator (full mode)
    pods.py          the pod runner (full mode with --pod-runner: pods run as processes)
    cluster.py       the ordered step lists (CONTROL_PLANE, FULL, PODS); start, health, stop
    tokens.py        ServiceAccount tokens (TokenRequest API), kubeconfig-for
    cli.py           the commands and their argument parser

Adding a component: a module with a Step (or, for a process with an HTTP
health endpoint, a Process) subclass and an instance, plus one entry in
cluster.FULL (or CONTROL_PLANE) where it must start. steps.py documents the
hooks (preflight, resolve, record, start, check, stop, summary); state.json
then records its pid/exe/ports, `status` shows it, `down` stops it.
"""
