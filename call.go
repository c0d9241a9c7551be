package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"sync/atomic"
	"time"

	"github.com/containerd/log"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// stage is where a handler call is, as the monitor sees it (under mu).
type stage uint8

const (
	inTime    stage = iota // running, its deadline (if any) ahead
	late                   // running past its deadline: its ctx ended
	overran                // running past its deadline and the grace: stuck
	settling               // returned and counted; in calls until release
	abandoned              // Stop gave up on it; its goroutine leaves unseen
)

// A call's progress is how far its goroutine got, written without mu:
// notBegun, then invoked (by compare-and-swap, just before the handler),
// then returned (just after). Stop, when it abandons a call not yet
// invoked, moves it to withdrawn (by compare-and-swap), so that a call
// whose event it dropped never starts; it never abandons a returned call:
// that one settles once its goroutine has mu.
const (
	notBegun  int32 = iota
	invoked         // the handler was called
	returned        // no more of the handler runs: it returned (its error's methods too), panicked or exited
	withdrawn       // abandoned before its handler began
)

// slotUse is which worker slot, if any, a call runs in.
type slotUse uint8

const (
	noSlot   slotUse = iota // an exit handled inline by its watcher
	ownSlot                 // one of the WithWorkers slots
	gaveSlot                // it overran and gave its slot to a new worker
)

// call is one handler call, and the handler's ctx: it embeds a standard
// cancel context (cancelled at the call's end, its deadline or Stop), so
// that contexts derived from it cost no goroutine, even below a
// context.WithValue, and adds the call's deadline and the key's logger.
type call struct {
	context.Context
	cancel      context.CancelCauseFunc
	key         *keyq.Key[item] // its name never changes: read it anywhere
	it          item            // its failures change under mu, by the call's own goroutine
	start       time.Time       // read only with a deadline or metrics
	deadline    time.Time       // zero: none (WithHandleTimeout(0))
	replayStart bool            // the first event of a replay: logged as a retry
	progress    atomic.Int32

	slot  slotUse // guarded by mu
	stage stage   // guarded by mu
}

// runningIn reports whether c's handler has not returned and c is in one of
// stages. mu is held.
func (c *call) runningIn(stages ...stage) bool {
	return c.progress.Load() != returned && slices.Contains(stages, c.stage)
}

// Deadline is the call's start on the monitor's clock plus the handle timeout.
func (c *call) Deadline() (time.Time, bool) { return c.deadline, !c.deadline.IsZero() }

// Err is DeadlineExceeded once the deadline ended the call (cancel sets the
// cause with Err, so Cause is there once Err is).
func (c *call) Err() error {
	err := c.Context.Err()
	if err != nil && context.Cause(c.Context) == context.DeadlineExceeded {
		return context.DeadlineExceeded
	}
	return err
}

// Value gives log.G(ctx) the call's key.
func (c *call) Value(key any) any {
	v := c.Context.Value(key)
	if l, ok := v.(*log.Entry); ok {
		return l.WithField("key", c.key.Name())
	}
	return v
}

// takeReady starts a call for the first ready key on a worker slot, if the
// monitor may. mu is held.
func (m *Monitor) takeReady() *call {
	if !m.state.handles() {
		return nil
	}
	k, it, replayStart := m.keys.Take()
	if k == nil {
		return nil
	}
	return m.startCall(k, it, replayStart, ownSlot)
}

// startCall registers a call of it for k, just taken. mu is held.
func (m *Monitor) startCall(k *keyq.Key[item], it item, replayStart bool, s slotUse) *call {
	c := &call{key: k, it: it, replayStart: replayStart, slot: s}
	c.Context, c.cancel = context.WithCancelCause(m.base)
	if m.cfg.handleTimeout > 0 || m.cfg.metrics != nil {
		c.start = m.cfg.clock.Now()
	}
	if m.cfg.handleTimeout > 0 {
		c.deadline = c.start.Add(m.cfg.handleTimeout)
	}
	m.calls = append(m.calls, c)
	return c
}

// work is a worker: call c, if any, then the calls its slot takes on, until
// no key is ready or its slot went to a new worker while its call overran.
// A new worker takes over from one that a user's callback ended.
func (m *Monitor) work(c *call) {
	for c != nil {
		c = m.handle(c)
	}
}

// handle makes call c and returns the next call for its slot (see release).
func (m *Monitor) handle(c *call) (next *call) {
	began, ignored := false, false
	var err error
	onGoexit(func() {
		if c.replayStart {
			m.logRetry(c) // before the CAS: Stop may still withdraw a call held up here
		}
		if began = c.progress.CompareAndSwap(notBegun, invoked); began {
			ignored, err = m.invoke(c)
		}
	}, func() { m.settleExited(c) })
	if !began {
		return nil // Stop withdrew it before it began, and accounted for it
	}
	return m.finish(c, ignored, err)
}

// settleExited settles call c, whose goroutine is ending (runtime.Goexit)
// in the handler or in the retry line's log hook, as a failure (finish
// leaves one Stop gave up on alone), and a new goroutine takes its slot on.
func (m *Monitor) settleExited(c *call) {
	if next := m.finish(c, false, errHandlerExited); next != nil {
		go m.work(next)
	}
}

var errHandlerExited = fmt.Errorf("%w: it panicked with nil or ended its goroutine (runtime.Goexit, as t.FailNow does), or a log hook did on its retry line", ErrHandlerPanic)

// invoke calls the handler and reports whether its error wraps
// ErrUnsupportedEvent (ignored). A panic, in the handler or in errors.Is
// running its error's methods, becomes ErrHandlerPanic, logged with the
// panicking stack (an error whose Error panics, checked replaces).
func (m *Monitor) invoke(c *call) (ignored bool, err error) {
	ok := false
	defer func() {
		if ok {
			return
		}
		err = errHandlerExited // runtime.Goexit (recover is nil) unwinds on, to handle's defer
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %s", ErrHandlerPanic, panicked(r))
		}
		m.cfg.logger.WithFields(log.Fields{"key": c.key.Name(), "stack": string(debug.Stack())}).
			WithError(err).Error("event handler panicked")
	}()
	err = checked(m.handler.HandleEvent(c, c.it.event))
	ignored = errors.Is(err, ErrUnsupportedEvent)
	ok = true
	return ignored, err
}

// finish settles call c, whose handler is done, reports its outcome and
// releases it, returning release's next call.
func (m *Monitor) finish(c *call, ignored bool, err error) (next *call) {
	c.progress.Store(returned) // no user code is left: Stop waits, not abandons
	c.cancel(context.Canceled) // what the handler started with ctx stops
	var end time.Time
	if err != nil || m.cfg.metrics != nil {
		end = m.cfg.clock.Now()
	}
	m.mu.Lock()
	if c.stage == abandoned {
		m.mu.Unlock()
		return nil // Stop gave up on it and accounted for it
	}
	wasOverrun := c.stage == overran
	out := m.settle(c, err, ignored, end)
	if !wasOverrun && out.failed == nil && m.cfg.metrics == nil { // nothing to report
		next = m.release(c, out)
		m.mu.Unlock()
		return next
	}
	m.reconcile()
	m.mu.Unlock()
	return m.reportThenRelease(c, err, end, out, wasOverrun)
}

// reportThenRelease reports settled call c without mu, as the report runs
// user code (logger, Metrics, drop handler), then releases it. If that code
// ends the goroutine (runtime.Goexit), the call is released all the same
// and a new goroutine takes its slot on.
func (m *Monitor) reportThenRelease(c *call, err error, end time.Time, out outcome, wasOverrun bool) *call {
	release := func() *call {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.release(c, out)
	}
	onGoexit(func() { m.report(c, err, end, out, wasOverrun) }, func() {
		if next := release(); next != nil {
			go m.work(next)
		}
	})
	return release()
}

// release ends settled call c: the key of a dropped event, held until the
// drop was reported, goes on, and c's slot, if it holds one, takes on the
// next call, which it returns. mu is held.
func (m *Monitor) release(c *call, out outcome) (next *call) {
	if out.drops != nil { // settle kept the key Running until its drop was handed over
		m.keys.Done(c.key)
	}
	if c.slot == ownSlot {
		// Taken while c still holds its slot, so that reconcile below
		// gives that slot to no new worker: this goroutine goes on in it.
		next = m.takeReady()
	}
	m.calls = slices.DeleteFunc(m.calls, func(x *call) bool { return x == c })
	m.reconcile()
	return next
}

// settle records a returned call's outcome: handled, ignored (no route),
// back at its key's head to wait, or given up on (see release). mu is held.
func (m *Monitor) settle(c *call, err error, ignored bool, end time.Time) outcome {
	c.stage = settling // its event is counted below, so Stats no longer counts it in flight
	switch {
	case err == nil:
		m.stats.Handled++
		m.keys.Done(c.key)
		return outcome{}
	case ignored:
		m.stats.Ignored++
		m.keys.Done(c.key)
		return outcome{}
	}
	m.stats.Failed++
	// A new record, not a change: the report of the call that failed
	// before may still read the old one without mu.
	f := failures{first: end, attempts: 1, last: err}
	if old := c.it.failures; old != nil {
		f.first, f.attempts = old.first, old.attempts+1
	}
	c.it.failures = &f
	var reason error
	switch {
	case !m.state.accepts():
		reason = failedDrop{ErrStopped, ": failed as the monitor stops", err}
	case m.cfg.maxAttempts > 0 && f.attempts >= m.cfg.maxAttempts:
		reason = failedDrop{ErrMaxAttempts, fmt.Sprintf(" (%d)", f.attempts), err}
	default:
		m.keys.Failed(c.key, c.it, end)
		return outcome{failed: err, delay: c.key.Delay()}
	}
	// Its key stays Running, for release to end once report has handed the
	// drop over: the drop handler sees it before the key's next event.
	return outcome{failed: err, drops: m.drop(c.key.Name(), reason, c.it)}
}

// slotsHeld is how many worker slots the calls hold.
func (m *Monitor) slotsHeld() int {
	n := 0
	for _, c := range m.calls {
		if c.slot == ownSlot {
			n++
		}
	}
	return n
}
