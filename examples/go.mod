module github.com/eventmonitor/eventmonitor/examples

go 1.23.0

require (
	github.com/containerd/containerd/api v1.10.0
	github.com/containerd/log v0.2.0
	github.com/containerd/typeurl/v2 v2.3.0
	github.com/eventmonitor/eventmonitor v0.1.0
	github.com/eventmonitor/eventmonitor/containerd v0.1.0
	github.com/eventmonitor/eventmonitor/prometheus v0.1.0
	github.com/prometheus/client_golang v1.23.2
	google.golang.org/grpc v1.75.1
)

require (
	github.com/beorn7/perks v1.0.1 // indirect
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/containerd/ttrpc v1.2.8 // indirect
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/opencontainers/go-digest v1.0.0 // indirect
	github.com/opencontainers/image-spec v1.1.1 // indirect
	github.com/prometheus/client_model v0.6.2 // indirect
	github.com/prometheus/common v0.66.1 // indirect
	github.com/prometheus/procfs v0.16.1 // indirect
	github.com/sirupsen/logrus v1.10.2 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
	golang.org/x/net v0.43.0 // indirect
	golang.org/x/sys v0.35.0 // indirect
	golang.org/x/text v0.28.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20250707201910-8d1bb00bc6a7 // indirect
	google.golang.org/protobuf v1.36.11 // indirect
	k8s.io/utils v0.0.0-20250604170112-4c0f3b243397 // indirect
)

replace github.com/eventmonitor/eventmonitor => ../

replace github.com/eventmonitor/eventmonitor/prometheus => ../prometheus

replace github.com/eventmonitor/eventmonitor/containerd => ../containerd
