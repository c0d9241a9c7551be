package eventmonitor_test

// Timing on the fake clock: backoff delays, jitter, held keys, the one
// scheduler timer, the handler's deadline, overruns and WithMaxAttempts.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/eventmonitor/eventmonitor"
)

const (
	schedOverranLine = "event handler overran its timeout; its key stays held until it returns"
	schedLimitLine   = "too many handler calls overrunning their timeout (WithMaxOverruns): this one keeps its worker until a replaced call returns"
	schedLateLine    = "event handler returned after its deadline"
)

// schedEntry is the first line logged with msg for key; nil if none.
func schedEntry(h *harness, msg, key string) *logrus.Entry {
	for _, e := range h.logs.AllEntries() {
		if e.Message == msg && e.Data["key"] == key {
			return e
		}
	}
	return nil
}

// schedArmed waits until the monitor's timer is on the clock, before a test
// steps the clock while a call runs (and WaitIdle would wait for the call):
// a step as the scheduler sets its timer would leave the timer late.
func schedArmed(t *testing.T, h *harness) {
	t.Helper()
	waitFor(t, "the monitor's timer", h.clk.HasWaiters)
}

// schedCalls is how many calls of e returned.
func schedCalls(h *harness, e any) int {
	n := 0
	for _, c := range h.rec.log() {
		if c.Event == e {
			n++
		}
	}
	return n
}

func TestBackoffRetriesExactlyWhenDue(t *testing.T) {
	const s, ms = time.Second, time.Millisecond
	for _, tc := range []struct {
		name   string
		opts   []eventmonitor.Option
		delays []time.Duration // after each failure of the same event
	}{
		{"default: 1s doubling", nil, []time.Duration{1 * s, 2 * s, 4 * s, 8 * s, 16 * s}},
		{"WithBackoff caps at max", []eventmonitor.Option{eventmonitor.WithBackoff(s, 5*s)}, []time.Duration{1 * s, 2 * s, 4 * s, 5 * s, 5 * s}},
		{"WithBackoff initial is max", []eventmonitor.Option{eventmonitor.WithBackoff(3*s, 3*s)}, []time.Duration{3 * s, 3 * s, 3 * s}},
		{"WithBackoff odd cap", []eventmonitor.Option{eventmonitor.WithBackoff(300*ms, time.Second)}, []time.Duration{300 * ms, 600 * ms, s, s}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, tc.opts...)
			e := ev{"a", 1}
			h.rec.fail(e, len(tc.delays))
			h.submit(t, e)
			var at time.Duration
			for i, d := range tc.delays {
				h.settle(t)
				p := h.pending("a")
				require.Equal(t, i+1, p.Attempts)
				require.Equal(t, epoch.Add(at+d), p.Due, "due after failure %d", i+1)
				h.step(t, d-time.Nanosecond)
				require.Len(t, h.rec.log(), i+1, "retried a nanosecond before due, after failure %d", i+1)
				h.step(t, time.Nanosecond)
				at += d
				require.Len(t, h.rec.log(), i+2, "not retried when due, after failure %d", i+1)
				require.Equal(t, at, h.rec.log()[i+1].At)
			}
			require.Equal(t, []any{e}, h.rec.handled())
			require.False(t, h.m.InBackoff("a"))
			require.EqualValues(t, len(tc.delays), h.m.Stats().Retried)
		})
	}
}

func TestALaterEventsFirstFailureWaitsTheInitialDelay(t *testing.T) {
	h := newHarness(t, nil)
	h.rec.fail(ev{"a", 1}, 2)
	h.rec.fail(ev{"a", 2}, 1)
	h.submit(t, evs("a", 1, 2)...)
	h.step(t, time.Second) // a/1 fails again: 2 s
	require.Equal(t, eventmonitor.Pending{Key: "a", Events: evs("a", 1, 2), Attempts: 2, Due: epoch.Add(3 * time.Second)}, h.pending("a"))
	h.step(t, 2*time.Second) // a/1 handled; a/2 fails for the first time
	require.Equal(t, evs("a", 1), h.rec.handled())
	require.Equal(t, eventmonitor.Pending{Key: "a", Events: evs("a", 2), Attempts: 1, Due: epoch.Add(4 * time.Second)}, h.pending("a"))
	h.step(t, time.Second)
	require.Equal(t, evs("a", 1, 2), h.rec.handled())
}

func TestJitterKeepsEachDelayWithinItsFraction(t *testing.T) {
	for _, fraction := range []float64{0.1, 0.5, 1} {
		t.Run(fmt.Sprint(fraction), func(t *testing.T) {
			const keys = 100
			h := newHarness(t, nil, eventmonitor.WithJitter(fraction), eventmonitor.WithWorkers(4))
			for i := range keys {
				e := ev{fmt.Sprint("k", i), 1}
				h.rec.fail(e, 2)
				h.submit(t, e)
			}
			within := func(d time.Duration) {
				t.Helper()
				h.settle(t)
				now, dues := h.clk.Now(), map[time.Time]bool{}
				lo, hi := time.Duration(float64(d)*(1-fraction)), time.Duration(float64(d)*(1+fraction))
				pending := h.m.Pending()
				require.Len(t, pending, keys)
				for _, p := range pending {
					got := p.Due.Sub(now)
					require.True(t, got >= lo && got <= hi, "%s waits %v, want %v ±%v", p.Key, got, d, fraction)
					dues[p.Due] = true
				}
				require.Greater(t, len(dues), keys/2, "jitter spreads the due times")
			}
			within(time.Second)
			h.step(t, time.Duration(float64(time.Second)*(1+fraction))) // every key retried, and failed again
			within(2 * time.Second)
		})
	}
}

func TestAKeyInBackoffHoldsItsLaterEventsWhileOtherKeysGoOn(t *testing.T) {
	h := newHarness(t, nil)
	h.rec.fail(ev{"a", 1}, 1)
	h.submit(t, ev{"a", 1})
	h.settle(t)
	h.submit(t, ev{"a", 2}, ev{"b", 1}, ev{"a", 3}, ev{"b", 2})
	h.settle(t)
	require.Equal(t, evs("b", 1, 2), h.rec.handled())
	require.Equal(t, evs("a", 1, 2, 3), h.pending("a").Events)
	s := h.m.Stats()
	require.Equal(t, [3]int{1, 3, 0}, [3]int{s.KeysInBackoff, s.EventsInBackoff, s.Queued})
	h.step(t, time.Second)
	require.Equal(t, evs("a", 1, 2, 3), h.rec.handled("a"))
	require.Empty(t, h.rec.overlapped())
}

func TestDueKeysOfAHeldMonitorRetryAtStart(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithDeferredStart())
	h.m.Backoff("a", ev{"a", 1}) // due at 1 s
	h.submit(t, ev{"b", 1})
	h.step(t, 2*time.Second)
	require.Empty(t, h.rec.log(), "a held monitor handles nothing")
	require.True(t, h.m.InBackoff("a"))
	require.False(t, h.clk.HasWaiters(), "a held monitor times no retry")
	h.m.Backoff("c", ev{"c", 1}) // due at 3 s
	h.m.Start()
	h.settle(t)
	require.ElementsMatch(t, []any{ev{"a", 1}, ev{"b", 1}}, h.rec.handled())
	for _, c := range h.rec.log() {
		require.Equal(t, 2*time.Second, c.At, "%v handled at Start", c.Event)
	}
	require.True(t, h.m.InBackoff("c"), "a key not yet due waits on")
	h.step(t, time.Second-time.Nanosecond)
	require.Len(t, h.rec.log(), 2)
	h.step(t, time.Nanosecond)
	require.Equal(t, ev{"c", 1}, h.rec.handled()[2])
}

// An idle monitor holds one clock timer while keys wait for a retry, and
// none when nothing does.
func TestAnIdleMonitorHoldsATimerOnlyWhileAKeyWaits(t *testing.T) {
	for _, tc := range []struct {
		name   string
		run    func(t *testing.T, h *harness)
		timers int
	}{
		{"nothing given", func(*testing.T, *harness) {}, 0},
		{"after a call returned", func(t *testing.T, h *harness) { h.submit(t, ev{"a", 1}) }, 0},
		{"a key waits", func(t *testing.T, h *harness) {
			h.rec.fail(ev{"a", 1}, 1)
			h.submit(t, ev{"a", 1})
		}, 1},
		{"keys wait", func(t *testing.T, h *harness) {
			for _, k := range []string{"a", "b", "c"} {
				h.m.Backoff(k, ev{k, 1})
				h.step(t, time.Millisecond)
			}
		}, 1},
		{"after the retry succeeded", func(t *testing.T, h *harness) {
			h.rec.fail(ev{"a", 1}, 1)
			h.submit(t, ev{"a", 1})
			h.step(t, time.Second)
			require.Equal(t, evs("a", 1), h.rec.handled())
		}, 0},
		{"after Forget emptied the only waiting key", func(t *testing.T, h *harness) {
			h.rec.fail(ev{"a", 1}, 1)
			h.submit(t, ev{"a", 1})
			h.settle(t)
			require.Equal(t, evs("a", 1), h.m.Forget("a"))
		}, 0},
		{"after Forget of one of two waiting keys", func(t *testing.T, h *harness) {
			h.m.Backoff("a", ev{"a", 1})
			h.m.Backoff("b", ev{"b", 1})
			h.settle(t)
			h.m.Forget("a")
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			tc.run(t, h)
			h.settle(t)
			require.Equal(t, tc.timers, h.clk.Waiters(), "timers on the clock (stats %+v)", h.m.Stats())
		})
	}
}

func TestHandlerContextDeadlineIsOnTheMonitorClock(t *testing.T) {
	for _, tc := range []struct {
		name    string
		opts    []eventmonitor.Option
		timeout time.Duration // 0: no deadline
	}{
		{"default 10s", nil, 10 * time.Second},
		{"WithHandleTimeout", []eventmonitor.Option{eventmonitor.WithHandleTimeout(3 * time.Second)}, 3 * time.Second},
		{"WithHandleTimeout(0)", []eventmonitor.Option{eventmonitor.WithHandleTimeout(0)}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls, release := make(chan context.Context, 1), make(chan struct{})
			h := newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, _ any) error {
				calls <- ctx
				select {
				case <-ctx.Done():
				case <-release:
				}
				return nil
			}), tc.opts...)
			defer close(release)
			h.step(t, 7*time.Second) // the call starts later than the epoch
			start := h.clk.Now()
			h.submit(t, "a")
			var ctx context.Context
			select {
			case ctx = <-calls:
			case <-time.After(10 * time.Second):
				t.Fatal("no call")
			}
			derived, cancel := context.WithCancel(ctx)
			defer cancel()
			deadline, ok := ctx.Deadline()
			if tc.timeout == 0 {
				require.False(t, ok, "a deadline at %v", deadline)
				h.clk.Step(time.Hour)
				require.NoError(t, ctx.Err())
				return
			}
			require.True(t, ok)
			require.Equal(t, start.Add(tc.timeout), deadline)
			schedArmed(t, h)
			h.clk.Step(tc.timeout - time.Nanosecond)
			require.NoError(t, ctx.Err(), "ctx ended before its deadline")
			h.clk.Step(time.Nanosecond)
			awaitClosed(t, ctx.Done(), "ctx at its deadline")
			require.Equal(t, context.DeadlineExceeded, ctx.Err())
			awaitClosed(t, derived.Done(), "the derived ctx at the deadline")
			require.Equal(t, context.Canceled, derived.Err())
			require.Equal(t, context.DeadlineExceeded, context.Cause(derived))
		})
	}
}

// An overrunning call is logged and counted past deadline + min(1s,
// timeout/10); its key stays held until it returns, late, which is logged.
func TestAnOverrunningCallHoldsItsKeyUntilItReturns(t *testing.T) {
	for _, tc := range []struct{ timeout, grace time.Duration }{
		{time.Second, 100 * time.Millisecond}, {5 * time.Second, 500 * time.Millisecond}, {30 * time.Second, time.Second},
	} {
		t.Run(tc.timeout.String(), func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithHandleTimeout(tc.timeout), eventmonitor.WithWorkers(2))
			started, release := h.rec.gate(ev{"a", 1}) // ignores its ctx
			defer release()
			h.submit(t, ev{"a", 1})
			awaitClosed(t, started, "a/1 starts")
			h.submit(t, ev{"a", 2})
			schedArmed(t, h)
			h.clk.Step(tc.timeout + tc.grace - time.Nanosecond)
			schedArmed(t, h) // the deadline's timer fired; the grace's is set
			require.Zero(t, h.m.Stats().Overrunning, "overran within its grace")
			h.clk.Step(time.Nanosecond)
			waitFor(t, "the overrun line", func() bool { return schedEntry(h, schedOverranLine, "a") != nil })
			require.Equal(t, logrus.WarnLevel, schedEntry(h, schedOverranLine, "a").Level)
			h.submit(t, ev{"b", 1}) // behind a/2 in the run queue, were a/2 runnable
			waitFor(t, "b/1 handled", func() bool { return h.m.Stats().Handled == 1 })
			s := h.m.Stats()
			require.Equal(t, [3]int{1, 1, 1}, [3]int{s.Overrunning, s.InFlight, s.Queued}, "a/2 waits for a/1: %+v", s)
			require.Equal(t, evs("b", 1), h.rec.handled())

			release()
			h.settle(t)
			require.Equal(t, evs("a", 1, 2), h.rec.handled("a"))
			require.Empty(t, h.rec.overlapped())
			late := schedEntry(h, schedLateLine, "a")
			require.NotNil(t, late, "the late return is logged")
			require.Equal(t, logrus.WarnLevel, late.Level)
			require.Zero(t, h.m.Stats().Overrunning)
		})
	}
}

// An overrunning call gives its worker to a new one: with WithWorkers(n),
// n other keys still move, and no more.
func TestAnOverrunningCallsWorkerIsReplaced(t *testing.T) {
	for _, workers := range []int{1, 2} {
		t.Run(fmt.Sprint(workers), func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithHandleTimeout(time.Second), eventmonitor.WithWorkers(workers))
			for i := range workers {
				e := ev{fmt.Sprint("stuck", i), 1}
				started, release := h.rec.gate(e)
				defer release()
				h.submit(t, e)
				awaitClosed(t, started, fmt.Sprint(e, " starts"))
				h.submit(t, ev{e.Key, 2})
			}
			startedB, releaseB := h.rec.gate(ev{"b", 1})
			defer releaseB()
			h.submit(t, ev{"b", 1}, ev{"c", 1})
			require.Empty(t, h.rec.log(), "within their deadline the stuck calls keep every worker")
			schedArmed(t, h)
			h.clk.Step(1100 * time.Millisecond)
			awaitClosed(t, startedB, "b/1 on a new worker")
			if workers == 1 {
				s := h.m.Stats()
				require.Equal(t, [2]int{2, 2}, [2]int{s.InFlight, s.Queued}, "c/1 waits for the one new worker: %+v", s)
			} else {
				waitFor(t, "c/1 on the second new worker", func() bool { return len(h.rec.handled()) == 1 })
			}
			releaseB()
			waitFor(t, "b and c handled", func() bool { return len(h.rec.handled()) == 2 })
			require.Equal(t, workers, h.m.Stats().Overrunning)
		})
	}
}

func TestMaxOverrunsBoundsTheReplacedWorkers(t *testing.T) {
	t.Run("past the bound an overrun keeps its worker", func(t *testing.T) {
		h := newHarness(t, nil, eventmonitor.WithHandleTimeout(time.Second), eventmonitor.WithMaxOverruns(1))
		startedA, releaseA := h.rec.gate(ev{"a", 1})
		defer releaseA()
		startedB, releaseB := h.rec.gate(ev{"b", 1})
		defer releaseB()
		h.submit(t, ev{"a", 1}, ev{"b", 1}, ev{"c", 1})
		awaitClosed(t, startedA, "a/1 starts")
		schedArmed(t, h)
		h.clk.Step(1100 * time.Millisecond) // a overruns: its worker is replaced, and takes b
		awaitClosed(t, startedB, "b/1 on a new worker")
		schedArmed(t, h)
		h.clk.Step(1100 * time.Millisecond) // b overruns at the bound
		waitFor(t, "b's limit line", func() bool { return schedEntry(h, schedLimitLine, "b") != nil })
		require.Equal(t, logrus.ErrorLevel, schedEntry(h, schedLimitLine, "b").Level)
		require.Nil(t, schedEntry(h, schedLimitLine, "a"))
		require.Equal(t, true, schedEntry(h, schedOverranLine, "a").Data["replaced"])
		s := h.m.Stats()
		require.Equal(t, [2]int{2, 1}, [2]int{s.Overrunning, s.Queued}, "c waits: %+v", s)

		releaseA() // a replaced call returned: b's worker can be replaced now
		waitFor(t, "c handled once a returned", func() bool { return len(h.rec.handled()) == 2 })
		require.Equal(t, []any{ev{"a", 1}, ev{"c", 1}}, h.rec.handled())
	})
	t.Run("WithMaxOverruns(0) never replaces", func(t *testing.T) {
		h := newHarness(t, nil, eventmonitor.WithHandleTimeout(time.Second), eventmonitor.WithMaxOverruns(0))
		started, release := h.rec.gate(ev{"a", 1})
		defer release()
		h.submit(t, ev{"a", 1}, ev{"b", 1})
		awaitClosed(t, started, "a/1 starts")
		schedArmed(t, h)
		h.clk.Step(1100 * time.Millisecond)
		waitFor(t, "a's overrun line", func() bool { return schedEntry(h, schedOverranLine, "a") != nil })
		require.Equal(t, false, schedEntry(h, schedOverranLine, "a").Data["replaced"])
		require.Nil(t, schedEntry(h, schedLimitLine, "a"), "no replacement is the user's choice, not a limit reached")
		require.Equal(t, 1, h.m.Stats().Queued, "b waits for a's worker")
		release()
		h.settle(t)
		require.Equal(t, []any{ev{"a", 1}, ev{"b", 1}}, h.rec.handled())
	})
}

func TestMaxAttemptsDropsAfterNFailedCalls(t *testing.T) {
	for _, tc := range []struct {
		name      string
		max       int
		backoff   bool // given to Backoff: one attempt already
		failures  int
		wantCalls int
		dropped   bool
	}{
		{"the first failure at 1", 1, false, 100, 1, true},
		{"three failures at 3", 3, false, 100, 3, true},
		{"Backoff counts one attempt", 3, true, 100, 2, true},
		{"success on the last attempt", 3, false, 2, 3, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithMaxAttempts(tc.max))
			e := ev{"a", 1}
			h.rec.fail(e, tc.failures)
			if tc.backoff {
				h.m.Backoff("a", e)
			} else {
				h.submit(t, e)
			}
			h.submit(t, ev{"a", 2})
			h.settle(t)
			for i := 0; h.m.InBackoff("a"); i++ {
				require.Less(t, i, 10, "still in backoff: %+v", h.pending("a"))
				h.step(t, h.pending("a").Due.Sub(h.clk.Now()))
			}
			require.Equal(t, tc.wantCalls, schedCalls(h, e))
			handled := h.rec.handled()
			require.NotEmpty(t, handled)
			require.Equal(t, ev{"a", 2}, handled[len(handled)-1], "the key moves on")
			if !tc.dropped {
				require.Empty(t, h.drops.list())
				return
			}
			drops := h.drops.list()
			require.Len(t, drops, 1)
			require.Equal(t, "a", drops[0].Key)
			require.Equal(t, []any{e}, drops[0].Events)
			require.True(t, errors.Is(drops[0].Reason, eventmonitor.ErrMaxAttempts), "reason %v", drops[0].Reason)
			s := h.m.Stats()
			require.Equal(t, [2]uint64{1, 1}, [2]uint64{s.Dropped, s.Handled})
			requireBalanced(t, s)
		})
	}
}
