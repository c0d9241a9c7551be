package containerd

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/require"

	"github.com/eventmonitor/eventmonitor"
)

// The stamping between the informer's subscriber and its intake passes a
// broken stream's error on only after the envelopes the stream delivered
// before it, which the monitor then reads: none vanishes. The source
// delivers more than its buffer and the copy's hold while the intake limit
// holds the reader, then fails.
func TestStampedSubscriberDeliversEnvelopesBeforeItsError(t *testing.T) {
	const c = 16      // the source's buffer (NewSubscriber's is 128)
	const n = 2*c + 3 // what the source, the copy, and a reader held by the intake limit hold
	env := func(i int) *eventmonitor.Envelope {
		a, err := typeurl.MarshalAny(&events.TaskExit{ContainerID: "c", ID: "c", Pid: uint32(i)})
		require.NoError(t, err)
		return &eventmonitor.Envelope{Timestamp: time.Now(), Namespace: "ns", Topic: "/tasks/exit", Event: a}
	}
	sent := make(chan struct{})
	second := make(chan struct{})
	var subs sync.Once
	src := eventmonitor.SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		ch, errs := make(chan *eventmonitor.Envelope, c), make(chan error, 1)
		first := false
		subs.Do(func() { first = true })
		if !first {
			close(second)
			go func() { // a quiet second subscription, which ends with ctx
				<-ctx.Done()
				close(errs)
				close(ch)
			}()
			return ch, errs
		}
		go func() {
			for i := range n {
				select {
				case ch <- env(i):
				case <-ctx.Done():
					return
				}
			}
			errs <- errors.New("stream broke") // after every envelope was taken from ch
			close(ch)
			close(sent)
		}()
		return ch, errs
	})
	gate := make(chan struct{})
	release := sync.OnceFunc(func() { close(gate) })
	defer release()
	var dropped sync.Map
	m := eventmonitor.MustNew(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error { <-gate; return nil }),
		eventmonitor.WithConverter(stampedConverter{eventmonitor.NewConverter(
			eventmonitor.KeyOf(func(e *events.TaskExit) string { return e.ContainerID }))}),
		eventmonitor.WithIntakeLimit(1), // the reader waits while the first call runs
		eventmonitor.WithResubscribe(time.Millisecond, time.Millisecond),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) { dropped.Store(d.Key, true) }))
	defer m.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx, stampedSubscriber{src}) }()
	defer func() { cancel(); <-done }()
	select {
	case <-sent: // the source delivered all n, then its error
	case <-time.After(10 * time.Second):
		t.Fatal("the source could not deliver its envelopes")
	}
	release()
	select {
	case <-second: // the monitor saw the error and re-subscribed
	case <-time.After(10 * time.Second):
		t.Fatal("no re-subscription")
	}
	require.Eventually(t, func() bool { return m.Stats().InFlight == 0 && m.Stats().Queued == 0 }, 10*time.Second, time.Millisecond)
	s := m.Stats()
	_, anyDropped := dropped.Load("c")
	require.Equal(t, uint64(n), s.Received, "envelopes delivered before the stream's error vanished (dropped: %v): %+v", anyDropped, s)
}
