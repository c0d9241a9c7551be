package relist_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/relist"
)

// TestRelistRecoversALostStreamEvent: a container's exit event is lost, the
// stream breaks, and the relist that the monitor's resync hook triggers
// once the stream is back finds the exit.
func TestRelistRecoversALostStreamEvent(t *testing.T) {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	var mu sync.Mutex
	pods := []relist.Pod{{ID: "p1", Containers: []relist.Container{{ID: "c1", State: relist.StateRunning}}}}
	list := func(ctx context.Context) ([]relist.Pod, error) {
		mu.Lock()
		defer mu.Unlock()
		return []relist.Pod{{ID: pods[0].ID, Containers: append([]relist.Container(nil), pods[0].Containers...)}}, nil
	}
	var handled []any
	handler := eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		mu.Lock()
		defer mu.Unlock()
		handled = append(handled, e)
		return nil
	})
	subs := make(chan chan error, 4)
	stream := eventmonitor.SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		errs := make(chan error, 1)
		subs <- errs
		return make(chan *eventmonitor.Envelope), errs
	})

	var r *relist.Relister
	m, err := eventmonitor.New(handler, eventmonitor.WithClock(clk),
		eventmonitor.WithConverter(eventmonitor.NewConverter()),
		eventmonitor.WithResync(func(ctx context.Context) error { return r.Relist(ctx) }))
	require.NoError(t, err)
	defer m.Stop()
	r = relist.New(list, relist.ToMonitor(m), relist.WithClock(clk), relist.WithPeriod(time.Hour))

	require.NoError(t, r.Relist(context.Background())) // the baseline: c1 started
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error)
	go func() { runDone <- m.Run(ctx, stream) }()
	first := <-subs

	// c1 exits, but its /tasks/exit never reaches the stream; then the stream breaks.
	mu.Lock()
	pods[0].Containers[0].State = relist.StateExited
	mu.Unlock()
	first <- errors.New("connection reset")
	// Step until Run, waiting out its delay, re-subscribes: the clock has
	// other waiters (the monitor's scheduler), so HasWaiters cannot tell
	// when Run waits.
	require.Eventually(t, func() bool {
		clk.Step(100 * time.Millisecond)
		select {
		case <-subs:
			return true
		default:
			return false
		}
	}, 10*time.Second, time.Millisecond, "Run re-subscribes once its delay has passed")

	// The resync runs once the new subscription is established: unrefused
	// for the initial resubscribe delay, on the same clock.
	require.Eventually(t, func() bool {
		clk.Step(100 * time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == 2
	}, 10*time.Second, time.Millisecond, "the resync's relist finds the exit")
	require.Equal(t, []any{
		relist.Event{PodID: "p1", Type: relist.ContainerStarted, ContainerID: "c1"},
		relist.Event{PodID: "p1", Type: relist.ContainerDied, ContainerID: "c1"},
	}, handled)
	cancel()
	require.NoError(t, <-runDone)
}
