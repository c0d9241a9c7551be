package eventmonitor

// Deadlines and overruns: a call past its deadline keeps its key, gives its
// worker slot to a replacement up to WithMaxOverruns, and is abandoned at Stop.

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Slots counted from the calls: with two workers and WithMaxOverruns(1),
// of two stuck calls one gives its slot to a new worker and one keeps it;
// when the replaced one returns the other is replaced; an abandoned call
// leaves the list and its slot with it, and returns unseen.
func TestSlotsFollowTheCallsAcrossReplaceAndAbandon(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithWorkers(2), WithMaxOverruns(1), WithHandleTimeout(time.Second))
	startA, releaseA := r.gate(ev{"a", 1})
	startB, releaseB := r.gate(ev{"b", 1})
	defer releaseA()
	defer releaseB()
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	<-startA
	<-startB
	h.submit(t, ev{"c", 1}, ev{"d", 1})
	slots := func() (held, calls, replaced int) {
		h.m.mu.Lock()
		defer h.m.mu.Unlock()
		for _, c := range h.m.calls {
			if c.seat == gaveSlot {
				replaced++
			}
		}
		return h.m.slotsHeld(), len(h.m.calls), replaced
	}
	held, calls, replaced := slots()
	require.Equal(t, []int{2, 2, 0}, []int{held, calls, replaced})

	h.clock.Step(time.Second + grace) // both overrun; one is replaced
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "c and d on the one replacement worker")
	held, calls, replaced = slots()
	require.Equal(t, []int{1, 2, 1}, []int{held, calls, replaced}, "one stuck call keeps its slot, one gave it")
	s := h.m.Stats()
	require.Equal(t, 2, s.Overrunning)
	require.Equal(t, 2, s.InFlight)

	// The replaced one returns: the other stuck call is replaced in turn.
	h.m.mu.Lock()
	var first string
	for _, c := range h.m.calls {
		if c.seat == gaveSlot {
			first = c.key.Name()
		}
	}
	h.m.mu.Unlock()
	if first == "a" {
		releaseA()
	} else {
		releaseB()
	}
	waitFor(t, func() bool { _, calls, replaced := slots(); return calls == 1 && replaced == 1 }, "the other stuck call replaced")
	held, _, _ = slots()
	require.Zero(t, held, "no worker left busy: the stuck call gave its slot")
	require.NoError(t, h.m.Submit("e", ev{"e", 1}))
	waitFor(t, func() bool { return len(r.handledList()) == 4 }, "e handled beside the stuck call")

	h.m.Stop() // abandons the stuck call
	held, calls, _ = slots()
	require.Zero(t, held+calls)
	require.False(t, h.clock.HasWaiters(), "no timer after Stop")
	releaseA()
	releaseB() // returns unseen: nothing counted twice
	s = h.m.Stats()
	assertBalanced(t, s)
	require.Equal(t, uint64(1), s.Dropped)
	require.Equal(t, uint64(4), s.Handled)
}

// At Stop, replaceStuck gives no slot away. That once made expire report the
// one call that overran while Stop waited as "limited" (an Error saying
// WithMaxOverruns was reached, with one overrun of 64 allowed): a call
// overrunning during Stop is not over the limit.
func TestOverrunDuringStopIsNotReportedAsOverTheLimit(t *testing.T) {
	release := make(chan struct{})
	startedCh := make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		close(startedCh)
		<-release // ignores ctx
		return nil
	}), WithHandleTimeout(time.Second))
	t.Cleanup(func() { close(release) })
	require.NoError(t, h.m.Submit("a", "a"))
	<-startedCh
	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	waitFor(t, h.stopping, "Stop began")
	// Wait until the scheduler armed for a's deadline, then pass it and the grace.
	waitArmed(t, h.m, func(at time.Time) bool { return at.Equal(epoch.Add(time.Second)) })
	h.clock.Step(time.Second)
	waitArmed(t, h.m, func(at time.Time) bool { return at.Equal(epoch.Add(time.Second + 100*time.Millisecond)) })
	h.clock.Step(100 * time.Millisecond)
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("Stop did not abandon the overrunning call")
	}
	for _, e := range h.logs.AllEntries() {
		assert.NotContains(t, e.Message, "too many handler calls overrunning",
			"one overrun of %d allowed reported as over the limit: %v", DefaultMaxOverruns, e.Data)
	}
}
