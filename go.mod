module github.com/eventmonitor/eventmonitor

go 1.23.0

require (
	github.com/containerd/log v0.2.0
	github.com/containerd/typeurl/v2 v2.3.0
	github.com/sirupsen/logrus v1.10.2
	github.com/stretchr/testify v1.12.1
	go.uber.org/goleak v1.3.0
	google.golang.org/protobuf v1.36.8
	k8s.io/utils v0.0.0-20250604170112-4c0f3b243397
)

require (
	github.com/google/go-cmp v0.7.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/sys v0.35.0 // indirect
)
