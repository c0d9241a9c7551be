package eventmonitor

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// runHarness starts a monitor whose calls need no clock, so that a worker
// with a backlog takes it in runs; a/1 holds the only worker until release,
// while a/2..a/n queue up behind it.
func runHarness(t *testing.T, r *recorder, n int, opts ...Option) (h *harness, release func()) {
	t.Helper()
	h = newHarness(t, r, append([]Option{WithHandleTimeout(0)}, opts...)...)
	started, release := r.gate(ev{"a", 1})
	h.submit(t, ev{"a", 1})
	<-started
	for i := 2; i <= n; i++ {
		h.submit(t, ev{"a", i})
	}
	return h, release
}

// A run stops at its first failure: the failed event and the untouched
// ones behind it wait in backoff, in order, at the initial delay.
func TestRunStopsAtItsFirstFailure(t *testing.T) {
	r := newRecorder()
	r.fail(ev{"a", 3}, 1)
	h, release := runHarness(t, r, 6)
	release()
	h.settled(t)

	assert.Equal(t, anys(evs("a", 1, 2)...), r.handledList())
	r.mu.Lock()
	assert.Equal(t, anys(evs("a", 1, 2, 3)...), r.calls, "nothing after the failure was called")
	r.mu.Unlock()
	p := h.pending("a")
	assert.Equal(t, anys(evs("a", 3, 4, 5, 6)...), p.Events)
	assert.Equal(t, 1, p.Attempts)
	assert.Equal(t, epoch.Add(DefaultInitialBackoff), p.Due)
	assert.Equal(t, Stats{Received: 6, Handled: 2, Failed: 1, KeysInBackoff: 1, EventsInBackoff: 4}, h.m.Stats())

	h.step(t, DefaultInitialBackoff)
	assert.Equal(t, anys(evs("a", 1, 2, 3, 4, 5, 6)...), r.handledList())
	assert.Equal(t, 1, r.maxConc["a"])
}

// Stop cancels the call a run has in progress and hands the run's other
// events over, with what is queued, to the drop handler.
func TestStopCancelsARun(t *testing.T) {
	r := newRecorder()
	inCall := make(chan struct{})
	r.onCall = func(ctx context.Context, e any) error {
		if e == (ev{"a", 3}) {
			close(inCall)
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}
	h, release := runHarness(t, r, 6)
	release()
	<-inCall // a/3, in a run of a/2..a/6
	h.submit(t, ev{"a", 7})
	h.m.Stop()

	assert.Equal(t, anys(evs("a", 1, 2)...), r.handledList())
	var dropped []any
	for _, d := range h.drops.all() {
		assert.ErrorIs(t, d.Reason, ErrStopped)
		dropped = append(dropped, d.Events...)
	}
	assert.Equal(t, anys(evs("a", 3, 4, 5, 6, 7)...), dropped, "the run's call, its untouched events, then the queue")
	s := h.m.Stats()
	assert.Equal(t, s.Received, s.Handled+s.Dropped)
}

// Each call of a run has a context of its own, ended when it returns.
func TestRunCallsHaveTheirOwnContexts(t *testing.T) {
	r := newRecorder()
	var contexts []context.Context
	r.onCall = func(ctx context.Context, e any) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if _, ok := ctx.Deadline(); ok {
			return errors.New("a deadline with WithHandleTimeout(0)")
		}
		contexts = append(contexts, ctx) // calls of one key never overlap
		return nil
	}
	h, release := runHarness(t, r, 5)
	release()
	h.settled(t)
	require.Len(t, contexts, 5)
	for i, ctx := range contexts {
		assert.ErrorIs(t, ctx.Err(), context.Canceled, "call %d's context ended when it returned", i)
		for _, other := range contexts[:i] {
			assert.NotSame(t, other, ctx)
		}
	}
	assert.Equal(t, uint64(5), h.m.Stats().Handled)
}

// A replay goes call by call even without deadlines: its first failure
// decides whether the delay doubles.
func TestReplaysAreNotRuns(t *testing.T) {
	r := newRecorder()
	r.fail(ev{"a", 2}, 2)
	h, release := runHarness(t, r, 4, WithBackoff(time.Second, time.Minute))
	release()
	h.settled(t)
	h.step(t, time.Second) // the replay fails on a/2 again: no progress, the delay doubles
	assert.Equal(t, 2*time.Second, h.pending("a").Due.Sub(h.clock.Now()))
	h.step(t, 2*time.Second)
	assert.Equal(t, anys(evs("a", 1, 2, 3, 4)...), r.handledList())
}
