module github.com/eventmonitor/eventmonitor/containerd

go 1.23.0

require (
	github.com/containerd/typeurl/v2 v2.3.0
	github.com/eventmonitor/eventmonitor v0.1.0
	github.com/stretchr/testify v1.12.1
	go.uber.org/goleak v1.3.0
	google.golang.org/grpc v1.75.1
	google.golang.org/protobuf v1.36.11
)

require go.yaml.in/yaml/v3 v3.0.5 // indirect

require (
	github.com/containerd/containerd/api v1.10.0
	github.com/containerd/log v0.2.0
	github.com/containerd/ttrpc v1.2.8 // indirect
	github.com/opencontainers/go-digest v1.0.0 // indirect
	github.com/opencontainers/image-spec v1.1.1 // indirect
	github.com/sirupsen/logrus v1.10.2
	golang.org/x/net v0.43.0 // indirect
	golang.org/x/sys v0.35.0 // indirect
	golang.org/x/text v0.28.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20250707201910-8d1bb00bc6a7 // indirect
	k8s.io/utils v0.0.0-20250604170112-4c0f3b243397
)

replace github.com/eventmonitor/eventmonitor => ../
