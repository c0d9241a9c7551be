package eventmonitor

import (
	"context"
	"time"
)

// NextRetry returns when the next backoff replay is due, and false if no
// key is waiting in backoff. A key given Backoff while its call runs is
// due the initial delay from that Backoff, but waits (and shows here) only
// once the call ends, replaying at once if that time has passed: call
// WaitIdle first. A held monitor (WithDeferredStart) replays nothing until
// Start, Run or Shutdown, even when that time comes.
func (m *Monitor) NextRetry() (time.Time, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if k := m.keys.Earliest(); k != nil {
		return k.Due(), true
	}
	return time.Time{}, false
}

// WaitIdle waits until the monitor has done all it can: no call running or
// being settled, no key waiting for a worker, no envelope or exit being
// accepted (read, converted or built, and queued or dropped),
// no replay due at the clock's now, and a timer set no later than the next
// retry (none if no key waits: only Run, waiting to re-subscribe or before
// a resync, may then hold a fake clock's waiter).
// Keys waiting for a later retry remain (see NextRetry). A held monitor
// (WithDeferredStart) is idle with its events queued, and times no retry;
// an overrunning call keeps it busy until it returns.
//
// It returns ctx's error if ctx ends first, and ErrStopped if a stop (Stop,
// or Shutdown's) began while it waited with such work left, or if the
// monitor is stopping with work left: the stop may have finished that work
// or dropped it (the drop handler and Stats say which). Once a stop has
// emptied the monitor, WaitIdle returns nil.
//
// It is the sync point of fake-clock tests: Submit, WaitIdle, step the
// clock to NextRetry, WaitIdle again (see package eventmonitortest). An
// envelope or exit may be taken off its channel an instant before it is
// noted: such tests also wait for Stats().Received (or use
// testing/synctest). Do not call WaitIdle from a handler, which it would
// wait for, nor from a callback Stop waits for (see Stop).
func (m *Monitor) WaitIdle(ctx context.Context) error {
	ctx, done := m.waitingOn(ctx)
	defer done()
	m.mu.Lock()
	defer m.mu.Unlock()
	for waited := false; ; waited = true {
		idle := m.idle()
		if idle && !m.sched.at.IsZero() {
			// A fire not yet seen, with a fake clock set back since,
			// leaves the timer off the clock: set it again.
			m.arm(m.sched.at)
		}
		overdue := m.sched.overdue(m.cfg.clock.Now())
		switch {
		case m.state == stopped && waited && m.atStop.busy:
			return ErrStopped // the stop may have emptied it since: idle now says nothing
		case idle && !overdue:
			return nil
		case m.state == stopped:
			return ErrStopped
		case ctx.Err() != nil:
			return ctx.Err()
		case overdue:
			m.poke()
		}
		m.cond.Wait()
	}
}

// idle reports whether nothing WaitIdle waits for is left, apart from an
// overdue timer, which callers check. mu is held.
func (m *Monitor) idle() bool {
	return len(m.calls) == 0 && m.accepting == 0 && (m.state == held || !m.keys.HasReady())
}

// waitingOn wraps ctx for a wait on cond: its Err is the standard
// library's, safe to call under mu (a caller's ctx may be any code), and
// its end wakes the waiters. Call done when the wait is over.
func (m *Monitor) waitingOn(ctx context.Context) (_ context.Context, done func()) {
	ctx, cancel := context.WithCancel(ctx)
	stopWaking := context.AfterFunc(ctx, m.wakeWaiters)
	return ctx, func() { stopWaking(); cancel() }
}

// wakeWaiters wakes all on cond, for a waiter whose ctx ended.
func (m *Monitor) wakeWaiters() {
	m.mu.Lock()
	m.cond.Broadcast()
	m.mu.Unlock()
}
