package eventmonitor

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Run waits out a resubscribe delay on clock.After, which holds its waiter
// on a fake clock until the clock reaches it: when ctx ends first, Run
// returns and leaves the waiter behind, so the idle monitor, and the
// stopped one, hold a timer on their clock. (Pre-existing: stream.go.)
func TestReview4RunLeavesResubscribeTimerOnIdleMonitor(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter))
	broken := SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
		ch := make(chan *Envelope)
		close(ch) // the stream breaks at once
		return ch, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- h.m.Run(ctx, broken) }()
	// Nothing else is timed: the one waiter is Run's resubscribe delay.
	waitFor(t, h.clock.HasWaiters, "Run never waited out its resubscribe delay")
	cancel()
	select {
	case err := <-ran:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return once its ctx ended")
	}
	h.settled(t)
	require.False(t, h.clock.HasWaiters(), "idle monitor, Run returned: a timer is left on the clock")
	h.m.Stop()
	require.False(t, h.clock.HasWaiters(), "stopped monitor: a timer is left on the clock")
}
