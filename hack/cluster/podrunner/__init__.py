"""podrunner: a kubelet for a test cluster's nodes that runs containers as local processes.

No container engine exists where the project's cluster tests run. KWOK marks pods
Running without running anything; the pod runner does the kubelet's job for the pods
bound to the nodes it manages, so the commands, env, volumes, probes, restarts and
deletions that the Helm chart and KubeRay produce really happen.

Usage (as root; see README.md next to this file):

    python hack/cluster/podrunner --kubeconfig K --state-dir D --nodes NODES.yaml \\
        --pod-cidr 10.123.0.0/24 --image-map IMAGES.yaml [--health-port P] \\
        [--backoff-base S] [--backoff-max S] [--shutdown-grace S] [--keep-nodes] [--log-level L]
    python hack/cluster/podrunner cleanup --state-dir D

    from podrunner import Config, Runner          # with hack/cluster on sys.path
    runner = Runner(Config(kubeconfig=..., state_dir=..., nodes=..., pod_cidr=..., image_map=...))
    runner.start(); ...; runner.stop()

What it emulates
- Nodes (nodes.py): created from the manifest when missing; Lease renewed every 10 s,
  Ready heartbeats; InternalIP = the runner's bridge gateway. Nodes it created are
  deleted when it stops (--keep-nodes keeps them).
- Pod network (network.py, proxy.py): a netns per pod on the runner's bridge with an
  address from --pod-cidr (status.podIP), hostname = pod name (spec.hostname/subdomain).
  The `kubernetes` Service's ClusterIP:port (10.96.0.1:443) is served inside every
  pod's netns (not on the shared bridge: several runners never collide) and relayed
  to the apiserver of the kubeconfig.
- Names (hosts.py): a per-pod /etc/hosts with every Service name (`svc.ns`,
  `svc.ns.svc`, `svc.ns.svc.cluster.local`; `svc` within the namespace) resolving to the
  ready endpoints of its EndpointSlices (headless: per-endpoint hostnames too), kept up
  to date; a resolv.conf whose nameserver refuses at once (no DNS timeouts).
- Containers (launch.py, containers.py, containerinit.py): init containers in order,
  then the containers, each in its own PID, mount and UTS namespace inside the pod's
  netns, under a shim that records the exit code;
  image -> local install through the image map (images.py); ENTRYPOINT/CMD rules;
  $(VAR) expansion; a private /tmp, the pod's /dev/shm, bind-mounted volumes (readOnly,
  subPath, subPathExpr); runAsUser/runAsGroup/fsGroup/supplementalGroups; runAsNonRoot;
  RLIMIT_NOFILE 1048576 (the hard limit where root lacks CAP_SYS_RESOURCE); logs
  appended to <state>/logs/<ns>_<pod>_<uid>/<container>.log. Mount points the host
  lacks are created and reference-counted across runners (hostpaths.py); a missing
  working dir is the container's own; host dirs a non-root user could not enter on
  the way to the image's install (/root above a pyenv) are opened by an overlay.
- Env (env.py): image env, Service link variables (KUBERNETES_SERVICE_* always),
  envFrom, env values, fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef,
  HOSTNAME, in the kubelet's precedence.
- Volumes (volumes.py): emptyDir (Memory: under /dev/shm), configMap, secret,
  downwardAPI, projected (serviceAccountToken from the TokenRequest API, bound to the
  pod, refreshed at 80% of its life), hostPath, persistentVolumeClaim (the bound PV's
  hostPath, else <state>/pvcs/<ns>/<claim> shared by all pods), ephemeral (per pod).
- Probes (probes.py): startup/liveness/readiness with exec (inside the container),
  httpGet, tcpSocket and the kubelet's timing rules.
- Status (status.py), restarts with CrashLoopBackOff (podworker.py), events, graceful
  deletion (termination.py: preStop, SIGTERM, grace, SIGKILL, then the Pod object is
  deleted), activeDeadlineSeconds.
- A restarted runner adopts the pods of its predecessor whose processes still run;
  `cleanup` removes what a crashed one left.

What it cannot emulate (not checked by tests that use it)
- Container images: only what the image map says (env, entrypoint, cmd, user, workdir,
  /etc/profile); the host's file system is every container's root file system, so a
  read-only root file system, files baked into images and image pulls are not real.
- Linux capabilities, seccomp/AppArmor/SELinux, privileged mode: processes run with
  the uid/gids asked for and no further restriction.
- cgroup limits: CPU and memory limits are not enforced, OOMKilled never happens.
- Service ClusterIPs other than the apiserver's are not routed (names resolve to pod
  addresses instead), so a Service whose port differs from its targetPort is reached
  on the targetPort only; NodePort/LoadBalancer and ExternalName are not emulated.
- NetworkPolicy is not enforced (every pod reaches every pod).
- kubectl logs/exec/port-forward through the apiserver (read the log files instead;
  runner.json lists them and each container's host pid: `nsenter -t PID -a`).
- hostNetwork pods get neither the Service names nor the apiserver ClusterIP.
- grpc probes, hostPort, hostPID/hostIPC, image pull policies and pull secrets,
  in-place resize, sidecar (restartable init) containers, device plugins (GPUs are
  node capacity only), pod spec updates after start (image changes).
"""
from .cleanup import cleanup
from .images import ImageMap
from .runner import Config, Runner, RunnerError

__all__ = ["Config", "Runner", "RunnerError", "ImageMap", "cleanup"]
