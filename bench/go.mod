module github.com/eventmonitor/eventmonitor/bench

go 1.24.0

require (
	github.com/containerd/containerd/api v1.11.1
	github.com/containerd/typeurl/v2 v2.3.0
	github.com/eventmonitor/eventmonitor v0.1.0
	github.com/eventmonitor/eventmonitor/containerd v0.1.0
)

require (
	github.com/containerd/log v0.2.0
	github.com/containerd/ttrpc v1.2.8 // indirect
	github.com/go-logr/logr v1.4.3 // indirect
	github.com/opencontainers/go-digest v1.0.0 // indirect
	github.com/opencontainers/image-spec v1.1.1 // indirect
	github.com/sirupsen/logrus v1.10.2 // indirect
	golang.org/x/net v0.50.0 // indirect
	golang.org/x/sys v0.41.0 // indirect
	golang.org/x/text v0.34.0 // indirect
	golang.org/x/time v0.9.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260120221211-b8f7ae30c516 // indirect
	google.golang.org/grpc v1.80.0
	google.golang.org/protobuf v1.36.11
	k8s.io/apimachinery v0.34.2 // indirect
	k8s.io/client-go v0.34.2
	k8s.io/klog/v2 v2.130.1 // indirect
	k8s.io/utils v0.0.0-20250604170112-4c0f3b243397 // indirect
)

replace github.com/eventmonitor/eventmonitor => ../

replace github.com/eventmonitor/eventmonitor/containerd => ../containerd
