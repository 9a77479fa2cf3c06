// Command etcd is the upstream etcd server (go.etcd.io/etcd/server/v3) at the
// version that k8s.io/kubernetes itself requires, so that kube-apiserver is
// tested against the etcd it was released with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
