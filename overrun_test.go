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

const overranLine = "event handler overran its timeout; its key stays held until it returns or Stop abandons it"

// grace is how long past its deadline a call of these tests' 1 s timeout
// may run before it counts as overrunning: min(1 s, timeout/10).
const grace = 100 * time.Millisecond

func TestOverrunningCallHoldsItsKey(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithWorkers(2), WithHandleTimeout(time.Second))
	started, release := r.gate(ev{"a", 1}) // ignores its ctx
	defer release()
	h.submit(t, ev{"a", 1})
	<-started
	h.clock.Step(5 * time.Second)
	waitFor(t, func() bool {
		return h.logged(overranLine, "a")
	}, "the overrun is logged with its key")

	// a/2 queues behind the overrunning call; b, submitted after it, runs on
	// the free worker. Had a/2 been runnable, that worker would have taken it first.
	h.submit(t, ev{"a", 2}, ev{"b", 1})
	waitFor(t, func() bool { return len(r.handledList()) == 1 }, "b handled")
	assert.Equal(t, anys(ev{"b", 1}), r.handledList())
	assert.Equal(t, 1, h.m.Stats().Queued)

	release()
	waitFor(t, func() bool { return len(r.handledList()) == 3 }, "a/1 then a/2")
	assert.Equal(t, anys(ev{"b", 1}, ev{"a", 1}, ev{"a", 2}), r.handledList())
	assert.True(t, h.logged("event handler returned after its deadline", "a"))
	assert.Equal(t, 1, r.maxConc["a"])
}

// With one worker, a call that overruns its deadline keeps its key but not
// the worker: a new worker handles the other keys.
func TestStuckHandlerDoesNotTakeItsWorker(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Second)) // one worker
	started, release := r.gate(ev{"stuck", 1})
	defer release()
	h.submit(t, ev{"stuck", 1})
	<-started
	h.submit(t, ev{"stuck", 2}, ev{"a", 1}, ev{"b", 1})
	assert.Empty(t, r.handledList(), "within its deadline the call keeps the only worker")

	h.clock.Step(time.Second + grace)
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "other keys handled by the replacement worker")
	assert.Equal(t, anys(ev{"a", 1}, ev{"b", 1}), r.handledList())
	s := h.m.Stats()
	assert.Equal(t, 1, s.Overrunning)
	assert.Equal(t, 1, s.InFlight)
	assert.Equal(t, 1, s.Queued, "stuck/2 waits: the key stays held")
	waitFor(t, func() bool { return h.logged(overranLine, "stuck") }, "the overrun is logged (by the scheduler, outside the lock)")

	release()
	waitFor(t, func() bool { return len(r.handledList()) == 4 }, "the stuck key goes on once its call returns")
	assert.Equal(t, anys(ev{"a", 1}, ev{"b", 1}, ev{"stuck", 1}, ev{"stuck", 2}), r.handledList())
	assert.Equal(t, 1, r.maxConc["stuck"])
	assert.Zero(t, h.m.Stats().Overrunning)

	waitFor(t, func() bool { return h.workers() == 0 }, "the returned call's goroutine leaves, and the idle worker too")
}

// workers counts the goroutines holding a worker slot.
func (h *harness) workers() int {
	h.m.mu.Lock()
	defer h.m.mu.Unlock()
	return h.m.slotsHeld()
}

// limitLine is logged for an overrun past WithMaxOverruns.
const limitLine = "too many handler calls overrunning their timeout (WithMaxOverruns): this one keeps its worker until a replaced call returns"

// Past WithMaxOverruns an overrunning call keeps its worker, and says so;
// once a replaced call returns, the held one's slot goes to a new worker.
func TestMaxOverrunsBoundsReplacedWorkers(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Second), WithMaxOverruns(1))
	startedA, releaseA := r.gate(ev{"a", 1})
	defer releaseA()
	startedB, releaseB := r.gate(ev{"b", 1})
	defer releaseB()
	h.submit(t, ev{"a", 1})
	<-startedA
	h.submit(t, ev{"b", 1}, ev{"c", 1})
	h.clock.Step(time.Second + grace) // a overruns: replaced, the new worker takes b
	<-startedB
	h.clock.Step(time.Second + grace) // b overruns: the bound is reached, c waits
	waitFor(t, func() bool { return h.logged(limitLine, "b") }, "b's overrun logged, at the bound")
	assert.True(t, h.logged(overranLine, "b"))
	assert.Len(t, h.entries(limitLine), 1)
	s := h.m.Stats()
	assert.Equal(t, 2, s.Overrunning)
	assert.Equal(t, 1, s.Queued, "c waits for a worker")
	assert.Empty(t, r.handledList())

	releaseA() // b's slot goes to a new worker, which handles c
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "a and c handled")
	assert.Equal(t, anys(ev{"a", 1}, ev{"c", 1}), r.handledList())
	releaseB()
	waitFor(t, func() bool { return len(r.handledList()) == 3 }, "b handled")
	h.settled(t)
	h.m.mu.Lock()
	defer h.m.mu.Unlock()
	assert.Zero(t, len(h.m.calls), "no call left, replaced or not")
	assert.Zero(t, h.m.slotsHeld(), "every worker left once idle")
}

// With WithMaxOverruns(0) a call that overruns keeps its worker by the
// user's choice: it is logged as a warning, not as a limit reached.
func TestNoReplacementChosenLogsNoLimitError(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Second), WithMaxOverruns(0))
	started, release := r.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	<-started
	h.clock.Step(time.Second + grace)
	waitFor(t, func() bool { return h.logged(overranLine, "a") }, "a's overrun logged")
	assert.Empty(t, h.entries(limitLine))
	assert.Equal(t, 1, h.m.Stats().Queued, "b waits: a keeps the one worker")
	release()
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "a and b handled once a returns")
}

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
			if c.slot == gaveSlot {
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
		if c.slot == gaveSlot {
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

// A call that overruns while Stop waits for it keeps its slot: no call
// starts once stopped, so a new worker would be a goroutine for nothing.
// Its warning says it was not replaced, and no limit is reported.
func TestACallOverrunningDuringStopIsNotReplaced(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Second), WithMaxOverruns(1))
	started, release := r.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1})
	<-started
	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	waitFor(t, h.stopping, "Stop begun")
	h.clock.Step(time.Second + grace) // a overruns: Stop abandons it
	awaitClosed(t, stopped, "Stop")
	waitFor(t, func() bool { return h.logged(overranLine, "a") }, "a's overrun logged")
	lines := h.entries(overranLine)
	require.Len(t, lines, 1)
	assert.Equal(t, false, lines[0].Data["replaced"], "no worker replaces a call once stopped")
	assert.Empty(t, h.entries(limitLine))
}
