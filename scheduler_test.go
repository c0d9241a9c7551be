package eventmonitor

// The scheduler: its one timer, WaitIdle, retries coming due on time, and a
// fake clock stepped while the monitor works.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"
	"k8s.io/utils/clock"
	testclock "k8s.io/utils/clock/testing"
)

// No lost wake-ups. A retry that comes due earlier than the
// timer while the scheduler is held outside the lock (here by its own
// overrun log line: user code, the logger) must still be replayed on time.
// The scheduler once recorded the time it would arm in a second step, and
// an earlier need arriving in between was compared against the stale time
// and lost; the timer is now set under mu by whoever changes what is due.
func TestSchedulerDoesNotLoseAnEarlierWakeWhileArming(t *testing.T) {
	fc := testclock.NewFakeClock(time.Unix(1_000_000, 0))
	t0 := fc.Now()
	logger := logrus.New()
	logger.Out = io.Discard
	hook := newBlockHook(logrus.WarnLevel, "overran its timeout")
	logger.AddHook(hook)

	handled := make(chan string, 16)
	release := make(chan struct{})
	h := HandlerFunc(func(ctx context.Context, e any) error {
		s := e.(string)
		handled <- s
		if s == "a" || s == "c" {
			<-release // ignores ctx: a overruns
		}
		return nil
	})
	m, err := New(h, WithClock(fc), WithWorkers(4), WithHandleTimeout(10*time.Second),
		WithBackoff(time.Second, time.Hour), WithLogger(logrus.NewEntry(logger)))
	require.NoError(t, err)
	var releaseOnce sync.Once
	unblock := func() {
		releaseOnce.Do(func() {
			close(release)
			select {
			case <-hook.blocked:
			default:
				hook.once.Do(func() {}) // never block later
			}
			select {
			case <-hook.release:
			default:
				close(hook.release)
			}
		})
	}
	t.Cleanup(func() { unblock(); m.Stop() })

	require.NoError(t, m.Submit("a", "a"))
	recvHandled(t, handled, "a", 5*time.Second)
	waitArmed(t, m, func(at time.Time) bool { return at.Equal(t0.Add(10 * time.Second)) })

	fc.Step(5 * time.Second)
	require.NoError(t, m.Submit("c", "c")) // deadline t0+15s
	recvHandled(t, handled, "c", 5*time.Second)

	// t0+11s: a is past its deadline and grace. The scheduler computes its
	// next wake-up, c's deadline t0+15s, unlocks and logs the overrun.
	fc.Step(6 * time.Second)
	select {
	case <-hook.blocked:
	case <-time.After(5 * time.Second):
		t.Fatal("overrun never logged")
	}
	// b is due at t0+12s, before what the scheduler is about to arm.
	m.Backoff("b", "b")
	due, ok := m.NextRetry()
	require.True(t, ok)
	require.Equal(t, t0.Add(12*time.Second), due)
	close(hook.release)

	// Wait until the scheduler armed again (anything after the stale t0+11s).
	armed := waitArmed(t, m, func(at time.Time) bool { return at.After(t0.Add(11 * time.Second)) })
	fc.Step(time.Second) // t0+12s: b is due
	if armed.After(due) {
		t.Logf("scheduler armed %v after b's due time", armed.Sub(due))
	}
	recvHandled(t, handled, "b", 3*time.Second)
}

func recvHandled(t *testing.T, ch <-chan string, want string, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for {
		select {
		case got := <-ch:
			if got == want {
				return
			}
		case <-deadline:
			t.Fatalf("%q not handled within %v", want, within)
		}
	}
}

// countingClock counts Now calls: every scheduler pass and every idle
// check reads the clock.
type countingClock struct {
	*testclock.FakeClock
	nows atomic.Int64
}

func (c *countingClock) Now() time.Time { c.nows.Add(1); return c.FakeClock.Now() }

var _ clock.WithTicker = (*countingClock)(nil)

// WaitIdle pokes the scheduler only when the timer is overdue. It once
// poked on every turn of its loop, and every pass ends in reconcile, whose
// Broadcast woke WaitIdle, which poked again: two goroutines ping-ponged on
// mu for as long as a call ran.
func TestWaitIdleDoesNotSpinWhileACallRuns(t *testing.T) {
	clk := &countingClock{FakeClock: testclock.NewFakeClock(epoch)}
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

// steppedClock steps its fake clock by step just before a timer is made
// or reset: another goroutine's Step landing between retime's clock.Now
// and its NewTimer/Reset, made deterministic.
type steppedClock struct {
	*testclock.FakeClock
	step time.Duration
}

func (c *steppedClock) NewTimer(d time.Duration) clock.Timer {
	c.FakeClock.Step(c.step)
	return c.FakeClock.NewTimer(d)
}

// retime sets the timer again when the clock moved while it set it. A fake
// clock stepped by less than a millisecond meanwhile once left the timer
// that much after the due time, and a fake timer fires only when a Step
// reaches it, so a step straight to the due time replayed nothing.
func TestStepDuringRetimeDoesNotLoseTheRetry(t *testing.T) {
	fc := testclock.NewFakeClock(epoch)
	clk := &steppedClock{FakeClock: fc, step: time.Microsecond}
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
func TestConcurrentClockStepperNeverDeadlocks(t *testing.T) {
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
func TestRetriesOnTimeWithoutWaitIdle(t *testing.T) {
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

// A key waiting in backoff keeps a timer on the clock once WaitIdle says
// idle: a pass from a buffered poke once stopped a correct timer, not yet
// due, before setting it again. A pass now stops only an overdue timer.
func TestBackoffHoldsTimerAfterWaitIdle(t *testing.T) {
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

// driftClock steps its fake clock by step just before each of the next
// `left` timers is made or reset, then leaves it alone: a test's two Steps
// landing between retime's clock.Now and its NewTimer/Reset on both of its
// tries, made deterministic.
type driftClock struct {
	*testclock.FakeClock
	step time.Duration
	left atomic.Int32
}

func (c *driftClock) drift() {
	if c.left.Add(-1) >= 0 {
		c.FakeClock.Step(c.step)
	}
}

func (c *driftClock) NewTimer(d time.Duration) clock.Timer {
	c.drift()
	return &driftTimer{Timer: c.FakeClock.NewTimer(d), c: c}
}

type driftTimer struct {
	clock.Timer
	c *driftClock
}

func (t *driftTimer) Reset(d time.Duration) bool {
	t.c.drift()
	return t.Timer.Reset(d)
}

// retime sets the timer at most twice: a fake clock stepped during both
// tries (a test stepping while the monitor works, with no WaitIdle before)
// leaves it late by the last step, so a step straight to the due time does
// not fire it. That is the documented limit; WaitIdle, the sync point of
// fake-clock tests, finds the timer overdue and has it replayed.
func TestStepDuringBothRetimeTriesRecoveredByWaitIdle(t *testing.T) {
	fc := testclock.NewFakeClock(epoch)
	clk := &driftClock{FakeClock: fc, step: time.Microsecond}
	clk.left.Store(2)
	var handled atomic.Int32
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { handled.Add(1); return nil }),
		WithClock(clk))
	h.m.Backoff("k", "e") // due epoch+1s; the clock moves 1µs in each of retime's two tries
	due, ok := h.m.NextRetry()
	require.True(t, ok)
	fc.SetTime(due)
	h.settled(t)
	require.Equal(t, int32(1), handled.Load(), "the retry due %v is replayed once WaitIdle ran", due)
	require.False(t, fc.HasWaiters(), "nothing waits: no timer")
}

// Random histories on a fake clock, with failures, drops, exits (calls
// holding no slot), handlers that move the clock, and in some runs a
// goroutine stepping it without pause (FakeClock.Step against mu). After
// every WaitIdle: the timer no later than what it times, the Stats
// identity, and with the clock still, no retry overdue and a timer on the
// clock exactly when a key waits in backoff; once one goroutine moves the
// clock, every retry taken at SetTime(NextRetry) with no WaitIdle; no key
// on two goroutines; nothing left and no timer after Stop.
func TestTimerTracksBackoffAndRetriesWithoutWaitIdle(t *testing.T) {
	for seed := uint64(1); seed <= 24; seed++ {
		timerHistoryRun(t, seed)
	}
}

func timerHistoryRun(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 13))
	var rmu sync.Mutex
	rnd := func(n int) int { rmu.Lock(); defer rmu.Unlock(); return rng.IntN(n) }
	fc := testclock.NewFakeClock(epoch)
	var keys exclusive
	var still atomic.Bool // handlers leave the clock alone
	m, err := New(HandlerFunc(func(ctx context.Context, e any) error {
		defer keys.enter(keyOf(e))()
		switch rnd(10) {
		case 0, 1, 2:
			return errors.New("fail")
		case 3:
			if !still.Load() {
				fc.Step(time.Duration(rnd(3000)) * time.Millisecond)
			}
		}
		return nil
	}), WithClock(fc), WithWorkers(1+int(seed%3)), WithHandleTimeout(time.Duration(seed%2)*time.Second),
		WithBackoff(100*time.Millisecond, 2*time.Second), WithJitter(float64(seed%2)/2),
		WithMaxAttempts(int(seed%4)), WithLogger(quietLogger()), WithDropHandler(func(Drop) {}))
	require.NoError(t, err)
	defer m.Stop()
	stepping := seed%3 == 0
	stop, stepped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stepped)
		for stepping {
			select {
			case <-stop:
				return
			default:
				fc.Step(time.Duration(rnd(50)) * time.Millisecond)
				runtime.Gosched()
			}
		}
	}()
	settle := func(step int) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, m.WaitIdle(ctx), "seed %d step %d: %+v", seed, step, m.Stats())
		m.mu.Lock()
		at, wake := m.sched.at, m.wakeAt()
		m.mu.Unlock()
		require.False(t, !wake.IsZero() && (at.IsZero() || at.After(wake)), "seed %d step %d: timer %v later than %v", seed, step, at, wake)
		assertBalanced(t, m.Stats())
		if !stepping {
			due, waiting := m.NextRetry()
			require.False(t, waiting && !due.After(fc.Now()), "seed %d step %d: retry due %v overdue at %v", seed, step, due, fc.Now())
			require.Equal(t, waiting, fc.HasWaiters(), "seed %d step %d: idle, key waiting %v, timer on the clock %v",
				seed, step, waiting, fc.HasWaiters())
		}
	}
	for step := 0; step < 200; step++ {
		k := fmt.Sprintf("k%d", rnd(5))
		switch rnd(9) {
		case 0, 1, 2:
			_ = m.Submit(k, ev{k, step})
		case 3:
			m.Backoff(k, ev{k, step})
		case 4:
			m.Forget(k)
		case 5:
			settle(step)
			fc.Step(time.Duration(rnd(1500)) * time.Millisecond)
		case 6:
			settle(step)
			if due, ok := m.NextRetry(); ok {
				fc.SetTime(due)
			}
		case 7:
			settle(step)
		case 8:
			ch := make(chan fakeExit, 1)
			ch <- fakeExit{}
			<-WatchExit(context.Background(), m, k, ch, func(uint32, time.Time) any { return ev{k, step} })
		}
	}
	close(stop)
	<-stepped
	still.Store(true)
	stepping = false
	settle(-1)
	for i := 0; i < 20; i++ {
		due, ok := m.NextRetry()
		if !ok {
			break
		}
		before := m.Stats().Retried
		fc.SetTime(due) // no WaitIdle before the retry is taken
		waitFor(t, func() bool { return m.Stats().Retried > before }, "seed %d: retry due %v not taken at %v", seed, due, fc.Now())
		settle(-2 - i)
	}
	m.Stop()
	require.False(t, fc.HasWaiters(), "seed %d: a timer left after Stop", seed)
	require.False(t, keys.twice.Load(), "seed %d: a key on two goroutines", seed)
	s := m.Stats()
	assertBalanced(t, s)
	require.Zero(t, s.Queued+s.EventsInBackoff+s.InFlight, "seed %d: %+v", seed, s)
}

// stopWatchClock counts, while watching, Stops of a timer still pending:
// the monitor stopping a correct timer, not yet due.
type stopWatchClock struct {
	*testclock.FakeClock
	watching atomic.Bool
	stopped  atomic.Int64
	resets   atomic.Int64 // Resets, watching or not
}

// Now is slow while watching: the monitor reads the clock in retime,
// between the pass's stop and its Reset, widening that window.
func (c *stopWatchClock) Now() time.Time {
	if c.watching.Load() {
		time.Sleep(100 * time.Microsecond)
	}
	return c.FakeClock.Now()
}

func (c *stopWatchClock) Since(t time.Time) time.Duration { return c.Now().Sub(t) }

func (c *stopWatchClock) NewTimer(d time.Duration) clock.Timer {
	return &stopWatchTimer{Timer: c.FakeClock.NewTimer(d), c: c}
}

type stopWatchTimer struct {
	clock.Timer
	c *stopWatchClock
}

func (t *stopWatchTimer) Reset(d time.Duration) bool {
	t.c.resets.Add(1)
	return t.Timer.Reset(d)
}

func (t *stopWatchTimer) Stop() bool {
	r := t.Timer.Stop()
	if r && t.c.watching.Load() {
		t.c.stopped.Add(1)
	}
	return r
}

// After WaitIdle, with the fake clock still and a key waiting in backoff,
// the timer stays on the clock. Two WaitIdles finding the timer overdue at
// a Step each poke; the second poke stays buffered, and its pass, run after
// both returned idle, must not stop the correct timer to set it again.
func TestABufferedPokeLeavesACorrectTimerAlone(t *testing.T) {
	clk := &stopWatchClock{FakeClock: testclock.NewFakeClock(epoch)}
	h := newHarness(t, HandlerFunc(func(_ context.Context, e any) error {
		if keyOf(e) == "z" {
			return errors.New("stays in backoff")
		}
		return nil
	}), WithClock(clk), WithBackoff(time.Second, time.Hour), WithHandleTimeout(0))
	require.NoError(t, h.m.Submit("z", ev{"z", 0})) // z waits: 1 s, 2 s, ...
	h.settled(t)
	var falseReads atomic.Int64
	for round := 0; round < 1000; round++ {
		h.m.Backoff(fmt.Sprint("k", round), ev{fmt.Sprint("k", round), round}) // due in 1 s: the timer
		h.settled(t)
		due, ok := h.m.NextRetry()
		require.True(t, ok)
		clk.SetTime(due)
		var wg sync.WaitGroup
		for range 2 {
			wg.Add(1)
			go func() { defer wg.Done(); h.settled(t) }()
		}
		wg.Wait()
		clk.watching.Store(true)
		deadline := time.Now().Add(2 * time.Millisecond)
		_, waiting := h.m.NextRetry() // z waits an hour: no poll may take mu
		for time.Now().Before(deadline) {
			if waiting && !clk.HasWaiters() {
				falseReads.Add(1)
			}
		}
		clk.watching.Store(false)
	}
	require.Zero(t, clk.stopped.Load()+falseReads.Load(),
		"idle, clock still: %d stops of a pending timer, %d reads of no waiter with a key in backoff",
		clk.stopped.Load(), falseReads.Load())
}

// staleFire makes the scheduler's next fire stale: holding mu, it fires
// the timer for k, waits for the scheduler to take the fire (it then waits
// for mu), replays k (nothing left to time: the timer stops) and backs z
// off (the timer is set for z). It returns z's due time, mu still held.
func staleFire(t *testing.T, h *harness, setTime func(time.Time)) (zDue time.Time) {
	h.m.Backoff("k", ev{"k", 1})
	h.settled(t)
	due, ok := h.m.NextRetry()
	require.True(t, ok)
	h.m.mu.Lock()
	fired := h.m.sched.timer.C()
	setTime(due)
	waitFor(t, func() bool { return len(fired) == 0 }, "the scheduler took the fire and waits for mu")
	h.m.reconcile()                                               // replays k: nothing left to time, the timer stops
	_, err := h.m.accept("z", item{event: ev{"z", 1}}, backedOff) // Backoff's steps, under the same hold
	require.NoError(t, err)
	h.m.reconcile() // the timer is set for z
	require.True(t, h.m.sched.at.After(due), "the timer is set for z's retry")
	return h.m.sched.at
}

// A fire the scheduler took before the timer was stopped and set again is
// stale: its pass must leave the pending timer on the clock, not stop it
// to set it again. A test reading the fake clock after WaitIdle, which the
// stale pass may follow, found no timer while a key waited.
func TestAStaleFireLeavesThePendingTimerOnTheClock(t *testing.T) {
	clk := &stopWatchClock{FakeClock: testclock.NewFakeClock(epoch)}
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { return nil }),
		WithClock(clk), WithBackoff(time.Second, time.Hour), WithHandleTimeout(0))
	staleFire(t, h, clk.SetTime)
	resets := clk.resets.Load()
	clk.watching.Store(true)
	h.m.mu.Unlock()
	waitFor(t, func() bool { return clk.resets.Load() > resets }, "the stale pass ran")
	h.settled(t)
	clk.watching.Store(false)
	require.Zero(t, clk.stopped.Load(), "the stale pass stopped the pending timer")
	_, waiting := h.m.NextRetry()
	require.True(t, waiting, "z waits in backoff")
	require.True(t, clk.HasWaiters(), "z's timer is on the clock")
}

// passClock counts Now calls, so that a test knows the scheduler's pass,
// which reads the clock first thing under mu, has run.
type passClock struct {
	*testclock.FakeClock
	nows atomic.Int64
}

func (c *passClock) Now() time.Time { c.nows.Add(1); return c.FakeClock.Now() }

// backClock sets its fake clock back a second as its first timer is made:
// a test's SetTime between arm's reading of the clock and its NewTimer.
type backClock struct {
	passClock
	once sync.Once
}

func (c *backClock) NewTimer(d time.Duration) clock.Timer {
	c.once.Do(func() { c.FakeClock.Step(-time.Second) })
	return c.FakeClock.NewTimer(d)
}

// The clock set back while the timer is set: the timer counts from the
// earlier time and fires before what it times; the pass finds nothing due
// and must set it again.
func TestATimerSetAsTheClockWentBackIsSetAgain(t *testing.T) {
	fc := testclock.NewFakeClock(epoch)
	clk := &backClock{passClock: passClock{FakeClock: fc}}
	var handled atomic.Int32
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { handled.Add(1); return nil }), WithClock(clk))
	h.m.Backoff("k", ev{"k", 1}) // due epoch+1s; the timer counts 1 s from epoch-1s
	due, ok := h.m.NextRetry()
	require.True(t, ok)
	require.Equal(t, epoch.Add(time.Second), due)
	n := clk.nows.Load()
	fc.SetTime(due.Add(-time.Second / 2)) // fires the early timer
	waitFor(t, func() bool { return clk.nows.Load() > n }, "the pass ran")
	h.m.mu.Lock() // the pass is done
	h.m.mu.Unlock()
	require.Zero(t, handled.Load(), "not due yet")
	fc.SetTime(due) // no WaitIdle
	waitFor(t, func() bool { return handled.Load() == 1 }, "the retry at its due time")
}

// fireBackThenStepInPass fires the timer at `at` and sets the clock back a
// second, holding mu so that the scheduler takes the fire and waits; its
// pass sets the timer again while the test steps the clock (clk's step,
// inside Reset).
func fireBackThenStepInPass(t *testing.T, h *harness, clk *driftClock, at time.Time) {
	h.m.mu.Lock()
	fired := h.m.sched.timer.C()
	clk.FakeClock.SetTime(at)
	clk.FakeClock.SetTime(at.Add(-time.Second))
	waitFor(t, func() bool { return len(fired) == 0 }, "the scheduler took the fire and waits for mu")
	clk.left.Store(1)
	h.m.mu.Unlock()
	waitFor(t, func() bool { return clk.left.Load() <= 0 }, "the pass set the timer again")
	h.m.mu.Lock() // the pass is done
	h.m.mu.Unlock()
}

// A timer that fired is off the clock even if the clock went back before
// the pass: the pass sets it again, so that the retry or deadline it timed
// still comes when the clock reaches its time, with no WaitIdle (the
// timer was once lost, its time still noted as set). And it is set again
// if the clock moves while it is (one Reset once left it late by the
// step).
func TestATimerFiredAsTheClockWentBackIsSetAgain(t *testing.T) {
	for _, step := range []time.Duration{0, time.Second / 2} {
		t.Run(fmt.Sprintf("retry, step %v", step), func(t *testing.T) {
			clk := &driftClock{FakeClock: testclock.NewFakeClock(epoch), step: step}
			var handled atomic.Int32
			h := newHarness(t, HandlerFunc(func(context.Context, any) error { handled.Add(1); return nil }), WithClock(clk))
			h.m.Backoff("k", ev{"k", 1})
			h.settled(t)
			due, ok := h.m.NextRetry()
			require.True(t, ok)
			fireBackThenStepInPass(t, h, clk, due)
			require.True(t, clk.HasWaiters(), "a key waits in backoff: its timer is on the clock")
			require.Zero(t, handled.Load(), "not due yet")
			clk.FakeClock.SetTime(due) // no WaitIdle
			waitFor(t, func() bool { return handled.Load() == 1 }, "the retry at its due time")
		})
		t.Run(fmt.Sprintf("deadline, step %v", step), func(t *testing.T) {
			clk := &driftClock{FakeClock: testclock.NewFakeClock(epoch), step: step}
			entered := make(chan context.Context, 1)
			h := newHarness(t, HandlerFunc(func(ctx context.Context, _ any) error {
				entered <- ctx
				<-ctx.Done()
				return nil
			}), WithClock(clk), WithHandleTimeout(10*time.Second))
			h.submit(t, ev{"a", 1})
			ctx := <-entered
			deadline, _ := ctx.Deadline()
			fireBackThenStepInPass(t, h, clk, deadline)
			require.NoError(t, ctx.Err(), "the clock is before the deadline")
			clk.FakeClock.SetTime(deadline)
			waitFor(t, func() bool { return ctx.Err() != nil }, "the call's ctx ends at its deadline")
		})
	}
}

// The same for a stale fire, whose pass moves the pending timer: a step
// while it does so must not leave it late.
func TestAStaleFireAcrossAStepLeavesTheTimerOnTime(t *testing.T) {
	clk := &driftClock{FakeClock: testclock.NewFakeClock(epoch), step: time.Second / 2}
	var zs atomic.Int32
	h := newHarness(t, HandlerFunc(func(_ context.Context, e any) error {
		if keyOf(e) == "z" {
			zs.Add(1)
		}
		return nil
	}), WithClock(clk), WithBackoff(time.Second, time.Hour), WithHandleTimeout(0))
	zDue := staleFire(t, h, clk.FakeClock.SetTime)
	clk.left.Store(1)
	h.m.mu.Unlock()
	waitFor(t, func() bool { return clk.left.Load() <= 0 }, "the stale pass moved the timer")
	waitFor(t, func() bool { return h.m.Stats().InFlight == 0 }, "k's call ended")
	clk.FakeClock.SetTime(zDue) // no WaitIdle
	waitFor(t, func() bool { return zs.Load() == 1 }, "z's retry at its due time")
}

// WaitIdle says idle only with the timer on the clock: a fire the
// scheduler has yet to see, the clock set back since, once left it off.
// The scheduler is held outside mu by its overrun log line, so the fire
// waits in the channel.
func TestWaitIdlePutsBackATimerFiredBeforeTheClockWentBack(t *testing.T) {
	fc := testclock.NewFakeClock(epoch)
	logger := logrus.New()
	logger.Out = io.Discard
	hook := newBlockHook(logrus.WarnLevel, "overran its timeout")
	logger.AddHook(hook)
	release := make(chan struct{})
	h := newHarness(t, HandlerFunc(func(_ context.Context, e any) error {
		if keyOf(e) == "a" {
			<-release // ignores ctx: overruns
		}
		return nil
	}), WithClock(fc), WithHandleTimeout(time.Second), WithBackoff(time.Second, time.Hour),
		WithLogger(logrus.NewEntry(logger)))
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(func() { unblock(); close(hook.release) }) // before the harness's Stop
	h.submit(t, ev{"a", 1})
	waitFor(t, fc.HasWaiters, "a's deadline timer")
	fc.Step(time.Second + grace)
	<-hook.blocked // the scheduler is outside mu, logging a's overrun
	unblock()
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 0 }, "a returned")
	h.m.Backoff("k", ev{"k", 1})
	due, ok := h.m.NextRetry()
	require.True(t, ok)
	h.m.mu.Lock()                     // no pass between the two
	fc.SetTime(due)                   // fires k's timer: the fire waits in its channel
	fc.SetTime(due.Add(-time.Second)) // and the clock goes back
	h.m.mu.Unlock()
	h.settled(t)
	require.True(t, fc.HasWaiters(), "idle, k waits in backoff: its timer is on the clock")
}

// An overrunning call holds no timer of its own (eventmonitortest's doc).
func TestAnOverrunningCallHoldsNoTimer(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Second))
	started, release := r.gate(ev{"s", 1})
	defer release()
	h.submit(t, ev{"s", 1})
	<-started
	require.True(t, h.clock.HasWaiters(), "in time: its deadline's timer")
	h.clock.Step(time.Second + grace)
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "overran")
	waitFor(t, func() bool { return !h.clock.HasWaiters() }, "no timer once it overran")
}

// Promise (WaitIdle's doc): "A held monitor (WithDeferredStart) ... times no
// retry". A Backoff on a held monitor arms no timer: the scheduler would
// wake for a replay that reconcile may not make, and set the timer again,
// at once, for as long as the hold lasts. This pins wakeAt's
// "m.state == running".
func TestAHeldMonitorTimesNoRetry(t *testing.T) {
	h := newHarness(t, newRecorder(), WithDeferredStart())
	h.m.Backoff("a", ev{"a", 1})
	h.settled(t)
	require.True(t, h.m.InBackoff("a"))
	require.False(t, h.clock.HasWaiters(), "a held monitor set a timer")
	h.clock.Step(time.Hour) // past its due: still nothing replays, nothing is timed
	h.settled(t)
	require.False(t, h.clock.HasWaiters(), "a held monitor set a timer")
	require.Equal(t, uint64(0), h.m.Stats().Retried)
}
