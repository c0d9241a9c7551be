// Package eventmonitortest steps a fake clock through a monitor's retries,
// for tests of handlers that run under an eventmonitor.Monitor.
//
// Build the monitor on a k8s.io/utils/clock/testing.FakeClock
// (eventmonitor.WithClock), hand it events, and let Step and
// StepToNextRetry move time: each waits until the monitor is idle
// (Monitor.WaitIdle) before and after moving the clock, so a test asserts
// what happened at exactly that time, with no sleep and no race.
//
//	clk := testclock.NewFakeClock(start)
//	m, _ := eventmonitor.New(handler, eventmonitor.WithClock(clk))
//	m.Submit("c1", event)                                  // fails: backs off 1 s
//	eventmonitortest.Step(t, m, clk, 999*time.Millisecond) // not retried yet
//	eventmonitortest.Step(t, m, clk, time.Millisecond)     // retried now
//
// Settling waits for calls in progress, so to end a call at its deadline
// step clk yourself, then Settle. A handler's ctx.Deadline is on the fake
// clock, but network code under it reads it against the real time: start
// the fake clock at time.Now() for handlers doing real I/O.
package eventmonitortest

import (
	"context"
	"testing"
	"time"

	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

// Timeout bounds every wait; a monitor that does not settle within it fails
// the test rather than hanging it.
const Timeout = 10 * time.Second

// Settle waits until m has done all it can with what it was given (see
// Monitor.WaitIdle), failing t after Timeout.
func Settle(t testing.TB, m *eventmonitor.Monitor) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if err := m.WaitIdle(ctx); err != nil {
		t.Fatalf("eventmonitortest: monitor did not settle: %v (stats %+v)", err, m.Stats())
	}
}

// Step settles m, moves clk forward by d, and settles m again: whatever was
// due by then has run.
func Step(t testing.TB, m *eventmonitor.Monitor, clk *testclock.FakeClock, d time.Duration) {
	t.Helper()
	Settle(t, m)
	clk.Step(d)
	Settle(t, m)
}

// StepToNextRetry settles m, moves clk to the moment the next retry is due,
// settles m again, and returns how far it moved the clock: the delay a test
// asserts. It fails t if no key is waiting in backoff.
func StepToNextRetry(t testing.TB, m *eventmonitor.Monitor, clk *testclock.FakeClock) time.Duration {
	t.Helper()
	Settle(t, m)
	pending := m.Pending()
	if len(pending) == 0 {
		t.Fatalf("eventmonitortest: no key is waiting in backoff (stats %+v)", m.Stats())
	}
	due := pending[0].Due
	for _, p := range pending[1:] {
		if p.Due.Before(due) {
			due = p.Due
		}
	}
	now := clk.Now()
	if due.After(now) { // not if a held monitor (WithDeferredStart) let it pass
		clk.SetTime(due)
	}
	Settle(t, m)
	return max(0, due.Sub(now))
}
