package containerd_test

import (
	"context"
	"fmt"
	"time"

	"github.com/containerd/containerd/api/events"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

// A monitor of a node's Kubernetes containers: dial containerd, key its
// events with Converter, and let Run subscribe and re-subscribe.
func ExampleNewSubscriber() {
	ctx := context.Background()
	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()

	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *events.TaskExit) error {
		fmt.Printf("%s exited with %d\n", e.ContainerID, e.ExitStatus)
		return nil
	})
	m, err := eventmonitor.New(mux,
		eventmonitor.WithNamespace(containerd.K8sNamespace),
		eventmonitor.WithConverter(containerd.Converter()),
		eventmonitor.WithWorkers(4))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(ctx)
	_ = m.Run(ctx, containerd.NewSubscriber(conn), `topic~="/tasks/"`)
}

// exitStatus stands in for containerd's client type containerd.ExitStatus,
// which task.Wait delivers and which has the same Result method, to keep the
// client module out of these tests.
type exitStatus struct {
	code uint32
	at   time.Time
}

func (s exitStatus) Result() (uint32, time.Time, error) { return s.code, s.at, nil }

// WatchExit takes the exit channel of containerd's client as it is;
// TaskExit turns the status into the event containerd would publish.
func ExampleTaskExit() {
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *events.TaskExit) error {
		fmt.Printf("%s (pid %d) exited with %d\n", e.ContainerID, e.Pid, e.ExitStatus)
		return nil
	})
	m, err := eventmonitor.New(mux)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Stop()

	exitCh := make(chan exitStatus, 1) // in a runtime: exitCh, err := task.Wait(ctx)
	exitCh <- exitStatus{code: 137, at: time.Now()}
	<-eventmonitor.WatchExit(context.Background(), m, "c1", exitCh, containerd.TaskExit("c1", "c1", 4242))
	// Output: c1 (pid 4242) exited with 137
}
