package relist_test

import (
	"context"
	"fmt"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/relist"
)

// A relister feeding a monitor: relist events are keyed by pod, so a pod's
// events are handled in order and backed off like stream events. In a
// runtime, also pass r.Relist to the monitor's WithResync and run r.Run
// with a long period as a safety net.
func ExampleToMonitor() {
	done := make(chan struct{})
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		ev := e.(relist.Event)
		fmt.Println(ev.PodID, ev.Type, ev.ContainerID)
		if ev.Type == relist.ContainerDied {
			close(done)
		}
		return nil
	}))
	if err != nil {
		panic(err)
	}
	defer m.Stop()

	listing := []relist.Pod{{ID: "pod-1", Containers: []relist.Container{
		{ID: "sandbox-1", State: relist.StateRunning},
		{ID: "app", State: relist.StateExited},
	}}}
	r := relist.New(func(ctx context.Context) ([]relist.Pod, error) { return listing, nil }, relist.ToMonitor(m))
	if err := r.Relist(context.Background()); err != nil {
		panic(err)
	}
	<-done
	// Output:
	// pod-1 ContainerStarted sandbox-1
	// pod-1 ContainerDied app
}
