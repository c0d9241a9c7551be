package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/utils/clock"
	testclock "k8s.io/utils/clock/testing"
)

// r4DriftClock steps its fake clock by step just before each of the next
// `left` timers is made or reset, then leaves it alone: a test's two Steps
// landing between retime's clock.Now and its NewTimer/Reset on both of its
// tries, made deterministic.
type r4DriftClock struct {
	*testclock.FakeClock
	step time.Duration
	left atomic.Int32
}

func (c *r4DriftClock) drift() {
	if c.left.Add(-1) >= 0 {
		c.FakeClock.Step(c.step)
	}
}

func (c *r4DriftClock) NewTimer(d time.Duration) clock.Timer {
	c.drift()
	return &r4DriftTimer{Timer: c.FakeClock.NewTimer(d), c: c}
}

type r4DriftTimer struct {
	clock.Timer
	c *r4DriftClock
}

func (t *r4DriftTimer) Reset(d time.Duration) bool {
	t.c.drift()
	return t.Timer.Reset(d)
}

// retime sets the timer at most twice: a fake clock stepped during both
// tries (a test stepping while the monitor works, with no WaitIdle before)
// leaves it late by the last step, so a step straight to the due time does
// not fire it. That is the documented limit; WaitIdle, the sync point of
// fake-clock tests, finds the timer overdue and has it replayed.
func TestReview4StepDuringBothRetimeTriesRecoveredByWaitIdle(t *testing.T) {
	fc := testclock.NewFakeClock(epoch)
	clk := &r4DriftClock{FakeClock: fc, step: time.Microsecond}
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

// Random histories on a fake clock, with failures, drops, exits (calls
// holding no slot), handlers that move the clock, and in some runs a
// goroutine stepping it without pause (FakeClock.Step against mu). After
// every WaitIdle: the timer no later than what it times, the Stats
// identity, and with the clock still, no retry overdue and a timer on the
// clock exactly when a key waits in backoff; once one goroutine moves the
// clock, every retry taken at SetTime(NextRetry) with no WaitIdle; no key
// on two goroutines; nothing left and no timer after Stop.
func TestReview4TimerTracksBackoffAndRetriesWithoutWaitIdle(t *testing.T) {
	for seed := uint64(1); seed <= 24; seed++ {
		r4Run(t, seed)
	}
}

func r4Run(t *testing.T, seed uint64) {
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
