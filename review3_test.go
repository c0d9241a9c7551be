package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/utils/clock"
	testclock "k8s.io/utils/clock/testing"
)

// r3CountingClock counts Now calls: every scheduler pass and every idle
// check reads the clock.
type r3CountingClock struct {
	*testclock.FakeClock
	nows atomic.Int64
}

func (c *r3CountingClock) Now() time.Time { c.nows.Add(1); return c.FakeClock.Now() }

var _ clock.WithTicker = (*r3CountingClock)(nil)

// Review 3 (fixed): WaitIdle poked the scheduler on every turn of its
// loop, and every pass ends in changed, whose Broadcast woke WaitIdle,
// which poked again: two goroutines ping-ponged on mu for as long as a call
// ran. WaitIdle now pokes only when the timer is overdue.
func TestReview3WaitIdleSpinsWhileACallRuns(t *testing.T) {
	clk := &r3CountingClock{FakeClock: testclock.NewFakeClock(epoch)}
	r := newRecorder()
	h := newHarness(t, r, WithClock(clk), WithHandleTimeout(0))
	h.m.Backoff("x", ev{"x", 1}) // the scheduler starts, then has nothing to time
	h.m.Forget("x")
	started, release := r.gate(ev{"k", 1})
	defer release()
	h.submit(t, ev{"k", 1})
	<-started

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.m.WaitIdle(ctx) }()
	base := clk.nows.Load()
	require.Never(t, func() bool { return clk.nows.Load()-base > 1000 }, 300*time.Millisecond, 5*time.Millisecond,
		"WaitIdle busy-loops with the scheduler while a call runs")
	t.Logf("clock reads while waiting: %d", clk.nows.Load()-base)
	cancel()
	<-done
}

// r3SteppedClock steps its fake clock by step just before a timer is made
// or reset: another goroutine's Step landing between retime's clock.Now
// and its NewTimer/Reset, made deterministic.
type r3SteppedClock struct {
	*testclock.FakeClock
	step time.Duration
}

func (c *r3SteppedClock) NewTimer(d time.Duration) clock.Timer {
	c.FakeClock.Step(c.step)
	return c.FakeClock.NewTimer(d)
}

// Review 3 (fixed): a fake clock stepped by less than a millisecond while
// retime set the timer left it that much after the due time, and a fake
// timer fires only when a Step reaches it, so a step straight to the due
// time replayed nothing. retime now sets the timer again when the clock
// moved meanwhile.
func TestReview3StepDuringRetimeLosesRetry(t *testing.T) {
	fc := testclock.NewFakeClock(epoch)
	clk := &r3SteppedClock{FakeClock: fc, step: time.Microsecond}
	handled := make(chan any, 4)
	h := newHarness(t, HandlerFunc(func(_ context.Context, e any) error { handled <- e; return nil }),
		WithClock(clk))
	h.m.Backoff("k", "e") // due epoch+1s; the timer is set while the clock moves 1µs
	due, ok := h.m.NextRetry()
	require.True(t, ok)
	fc.SetTime(due) // as eventmonitortest.StepToNextRetry does
	select {
	case <-handled:
	case <-time.After(3 * time.Second):
		t.Fatalf("retry due %v never replayed at the clock's %v (timer armed %v late, no poke)", due, fc.Now(), clk.step)
	}
}

// A fake clock stepped without pause by another goroutine while calls end
// at their deadlines, fail and replay: Step holds the fake clock's lock
// while it fires the monitor's timer, and the monitor reads that clock
// under mu. The timer's channel must never hold a second value (Step would
// block on it, and with it every clock read under mu): every event ends
// handled or dropped, and Stop returns.
func TestReview3ConcurrentStepperNeverDeadlocks(t *testing.T) {
	fc := testclock.NewFakeClock(epoch)
	var calls atomic.Int64
	drops := &dropLog{}
	m, err := New(HandlerFunc(func(ctx context.Context, e any) error {
		if calls.Add(1)%3 == 0 {
			return errors.New("fail")
		}
		<-ctx.Done() // ends at its deadline, when the scheduler cancels it
		return nil
	}), WithClock(fc), WithWorkers(4), WithHandleTimeout(5*time.Millisecond),
		WithBackoff(time.Millisecond, 3*time.Millisecond), WithMaxAttempts(3),
		WithDropHandler(drops.add), WithLogger(quietLogger()))
	require.NoError(t, err)
	stop := make(chan struct{})
	stepped := make(chan struct{})
	go func() {
		defer close(stepped)
		for {
			select {
			case <-stop:
				return
			default:
				fc.Step(time.Millisecond)
				runtime.Gosched()
			}
		}
	}()
	const n = 300
	for i := 0; i < n; i++ {
		k := fmt.Sprintf("k%d", i%7)
		require.NoError(t, m.Submit(k, ev{k, i}))
	}
	require.Eventually(t, func() bool {
		s := m.Stats()
		return s.Handled+s.Dropped == n
	}, 20*time.Second, time.Millisecond, "events stuck: %+v", m.Stats())
	stopDone := make(chan struct{})
	go func() { m.Stop(); close(stopDone) }()
	select {
	case <-stopDone:
	case <-time.After(10 * time.Second):
		t.Fatal("Stop hangs")
	}
	close(stop)
	<-stepped
	require.False(t, fc.HasWaiters())
	assertBalanced(t, m.Stats())
}

// No lost wake-up, and no WaitIdle needed to see one: a retry due before
// the timer (a running call's deadline) moves it earlier; a timer left
// earlier than needed (an ended call's deadline) fires early and is set
// again; a step straight to the due time replays. Once nothing waits, no
// timer is left on the clock.
func TestReview3RetriesOnTimeWithoutWaitIdle(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithWorkers(2), WithHandleTimeout(500*time.Millisecond), WithBackoff(time.Second, time.Minute))
	t0 := h.clock.Now()
	at := func() time.Time { h.m.mu.Lock(); defer h.m.mu.Unlock(); return h.m.sched.at }

	// c's retry at t0+1s is after x's deadline at t0+0.5s, which x's end
	// leaves armed.
	startX, releaseX := r.gate(ev{"x", 1})
	defer releaseX()
	h.submit(t, ev{"x", 1})
	<-startX
	require.Equal(t, t0.Add(500*time.Millisecond), at(), "timer at x's deadline")
	h.m.Backoff("c", ev{"c", 1}) // due t0+1s
	releaseX()
	waitFor(t, func() bool { return len(r.handledList()) == 1 }, "x returned")
	require.Equal(t, t0.Add(500*time.Millisecond), at(), "the ended call's earlier timer is left")
	h.clock.SetTime(t0.Add(time.Second)) // fires the early timer and passes c's due at once
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "c replayed at its due time")
	waitFor(t, func() bool { return !h.clock.HasWaiters() }, "no timer once nothing waits")

	h.m.Stop() // the next monitor's cleanup checks for leaks first

	// A retry due before the timer moves it earlier.
	h2 := newHarness(t, r, WithHandleTimeout(10*time.Second), WithBackoff(time.Second, time.Minute), WithWorkers(2))
	t0 = h2.clock.Now()
	startY, releaseY := r.gate(ev{"y", 1})
	defer releaseY()
	require.NoError(t, h2.m.Submit("y", ev{"y", 1})) // deadline t0+10s
	<-startY
	h2.m.Backoff("d", ev{"d", 1}) // due t0+1s
	h2.clock.SetTime(t0.Add(time.Second))
	waitFor(t, func() bool { return len(r.handledList()) == 3 }, "d replayed at its due time")
	releaseY()
	waitFor(t, func() bool { return len(r.handledList()) == 4 }, "y returned")
	waitFor(t, func() bool { return !h2.clock.HasWaiters() }, "no timer once nothing waits")
}

// Review 3 (fixed): a key waited in backoff and WaitIdle said idle, yet
// the fake clock had no timer: a pass from a buffered poke stopped the
// timer, right and not due, before setting it again. A pass now stops only
// an overdue timer.
func TestReview3BackoffHoldsTimerAfterWaitIdle(t *testing.T) {
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { return errors.New("fails") }),
		WithBackoff(time.Hour, time.Hour))
	for i := 0; i < 2000; i++ {
		k := fmt.Sprint("c", i)
		require.NoError(t, h.m.Submit(k, "e"))
		h.settled(t)
		require.True(t, h.clock.HasWaiters(), "round %d: idle with a key in backoff, and no timer on the clock", i)
		h.m.Forget(k)
		h.settled(t)
		require.False(t, h.clock.HasWaiters(), "round %d: idle, nothing waits, a timer on the clock", i)
	}
}
