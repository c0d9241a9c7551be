package eventmonitor

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Promise (Shutdown's doc): it returns "nil once its drain is done, or if
// a Stop had already begun; ctx's error if ctx ended first". Here a Stop
// (or a Shutdown) has already begun and finished: nothing is queued,
// running or in backoff, and this Shutdown drains, abandons and drops
// nothing. With a ctx that has already ended it returns ctx's error, as
// if ctx had cut something short; with a live ctx it returns nil, and on
// a monitor that was never stopped an ended ctx also gives nil (review
// 19). The ended ctx alone decides, not what was lost.
func TestReview20ShutdownWithAnEndedCtxAfterAStopReturnsNil(t *testing.T) {
	for _, first := range []string{"Stop", "Shutdown"} {
		t.Run("after"+first, func(t *testing.T) { shutdownWithAnEndedCtxAfter(t, first) })
	}
}

func shutdownWithAnEndedCtxAfter(t *testing.T, first string) {
	h := newHarness(t, newRecorder())
	h.submit(t, ev{"a", 1})
	h.settled(t)
	if first == "Stop" {
		h.m.Stop()
	} else {
		require.NoError(t, h.m.Shutdown(context.Background()))
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	err := h.m.Shutdown(ended)
	require.Empty(t, h.drops.all())
	require.EqualValues(t, 1, h.m.Stats().Handled)
	require.NoError(t, err, "a %s had already begun (and ended): this Shutdown lost nothing, yet it returned %v", first, err)
}

// Promise (Shutdown's doc): the error "says what its drain lost: calls
// abandoned as they overran, events dropped that stuck calls kept from
// every worker, ...". With WithMaxOverruns(0) and one worker, a stuck a/1
// keeps its worker from b/1: the drain abandons a/1 and drops b/1, but
// the error names only the abandoned call. Shutdown's switch tests
// gaveUp before left, so the "kept from every worker" case is reported
// only when no stuck call is abandoned, i.e. almost never.
func TestReview20ShutdownErrorNamesTheEventsStuckCallsKeptFromTheWorkers(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	started := make(chan struct{}, 1)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if e == (ev{"a", 1}) {
			started <- struct{}{}
			<-release // ignores its ctx
		}
		return nil
	}), WithLogger(quietLogger()), WithWorkers(1), WithMaxOverruns(0))
	h.submit(t, ev{"a", 1})
	<-started
	h.submit(t, ev{"b", 1}) // waits for the one worker, which a/1 keeps
	h.clock.Step(DefaultHandleTimeout + time.Second)
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "a/1 overruns")

	err := h.m.Shutdown(context.Background())
	require.ErrorIs(t, err, ErrStopped)
	_, aDropped := dropReason(h, ev{"a", 1})
	_, bDropped := dropReason(h, ev{"b", 1})
	require.True(t, aDropped && bDropped, "a/1 abandoned, b/1 dropped: %+v", h.drops.all())
	require.Contains(t, err.Error(), "dropped 1 events",
		"the drain lost b/1 (kept from the worker by stuck a/1) as well as a/1, but the error says only %q", err)
}
