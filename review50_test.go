package eventmonitor

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Promise (WaitIdle's doc): it returns ErrStopped "if the monitor is
// stopping with work left". Called while Stop waits for a handler that
// ignores its ctx (no handle timeout), WaitIdle returns at once; it does not
// wait for that handler. Review 50: deleting WaitIdle's "case m.state ==
// stopped" passed the whole suite, as WaitIdle then waited for a wake-up.
func TestWaitIdleWhileAStopWaitsReturnsErrStopped(t *testing.T) {
	r := newRecorder()
	started, release := r.gate(ev{"a", 1})
	h := newHarness(t, r, WithHandleTimeout(0))
	t.Cleanup(release) // before the harness's Stop, which waits for the handler
	h.submit(t, ev{"a", 1})
	<-started
	stopDone := make(chan struct{})
	go func() { h.m.Stop(); close(stopDone) }()
	waitFor(t, stateIs(h.m, stopped), "Stop began")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	require.ErrorIs(t, h.m.WaitIdle(ctx), ErrStopped)
	require.NoError(t, ctx.Err(), "WaitIdle waited for the handler Stop waits for")
	release()
	<-stopDone
}
