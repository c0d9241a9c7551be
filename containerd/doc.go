// Package containerd connects an eventmonitor.Monitor to containerd: a
// Subscriber over containerd's events gRPC service, a Converter that keys
// every event type of github.com/containerd/containerd/api/events, and the
// builders WatchExit needs to turn a task's exit status into a TaskExit.
//
//	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
//	...
//	m, err := eventmonitor.New(handler,
//		eventmonitor.WithNamespace(containerd.K8sNamespace),
//		eventmonitor.WithConverter(containerd.Converter()))
//	...
//	err = m.Run(ctx, containerd.NewSubscriber(conn))
//
// It is a module of its own, so that the eventmonitor library does not
// depend on gRPC or containerd's API.
package containerd
