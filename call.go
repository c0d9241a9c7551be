package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"time"

	"github.com/containerd/log"
)

// callState is where a handler call is, as the monitor sees it (under mu).
type callState uint8

const (
	inTime    callState = iota // taken, its deadline (if any) ahead
	late                       // past its deadline: its ctx ended
	overran                    // past its deadline and the grace: logged, its worker maybe replaced
	settling                   // returned and counted: its outcome is being reported
	abandoned                  // Stop gave up on it: its event is dropped, its goroutine leaves unseen
)

// slot is which worker slot, if any, a call holds.
type slot uint8

const (
	noSlot   slot = iota // an exit handled on its watcher's goroutine
	ownSlot              // one of the WithWorkers slots
	gaveSlot             // it overran and gave its slot to a new worker
)

// call is one handler call; mu guards its state and slot.
type call struct {
	ctx    handlerContext
	cancel context.CancelCauseFunc // the scheduler ends ctx at its deadline, with the cause DeadlineExceeded
	key    *key
	it     item
	start  time.Time
	behind int  // a retry's: events queued behind it, for its log line
	busy   bool // other keys were ready as it was taken: the next record is made before mu
	state  callState
	slot   slot
}

// takeReady starts a call for the first ready key, if the monitor handles,
// in record c if one was made for it. mu is held.
func (m *Monitor) takeReady(c *call) *call {
	if m.state != running && m.state != draining {
		return nil
	}
	k, it := m.keys.take()
	if k == nil {
		return nil
	}
	c = m.startCall(k, it, ownSlot, c)
	c.busy = m.keys.anyReady()
	return c
}

// newCall makes a call's record and ctx. A busy worker makes its next one
// before it takes mu: allocating under mu held the other workers up.
func (m *Monitor) newCall() *call {
	c := new(call)
	c.ctx.Context, c.cancel = context.WithCancelCause(m.base)
	return c
}

// startCall registers a call of it for k, just taken, in record c (a new
// one if nil). mu is held.
func (m *Monitor) startCall(k *key, it item, s slot, c *call) *call {
	if c == nil {
		c = m.newCall()
	}
	c.key, c.it, c.slot, c.start = k, it, s, m.cfg.clock.Now()
	c.ctx.key, c.ctx.origin = k.name, it.origin
	if it.failed != nil {
		c.behind = len(k.events)
	}
	if d := m.cfg.handleTimeout; d > 0 {
		c.ctx.deadline = c.start.Add(d)
		m.wakeBy(c.ctx.deadline)
	}
	m.calls = append(m.calls, c)
	m.work.Add(1)
	return c
}

// serve is a worker: it makes call c, then the calls its slot takes on.
func (m *Monitor) serve(c *call) {
	for c != nil {
		c = m.handle(c)
	}
}

var errHandlerExited = errors.New("eventmonitor: handler ended its goroutine (runtime.Goexit, as t.FailNow does)")

// handle makes call c and returns its slot's next call. A handler that ends
// its goroutine fails its call, and a new goroutine takes the slot on.
func (m *Monitor) handle(c *call) *call {
	if c.it.failed != nil {
		m.logRetry(c)
	}
	// Stop may have withdrawn the call since it was taken: before this
	// goroutine ran, or during a retry's log line, which may be slow.
	m.mu.Lock()
	withdrawn := c.state == abandoned
	if !withdrawn && c.it.failed != nil {
		m.stats.Retried++
	}
	m.mu.Unlock()
	if withdrawn {
		return nil // its event was dropped
	}
	returned := false
	defer func() {
		if !returned {
			if next := m.finish(c, errHandlerExited); next != nil {
				go m.serve(next)
			}
		}
	}()
	err := m.invoke(c)
	returned = true
	return m.finish(c, err)
}

// logRetry is a retry's log line. It and panicked are out of line: inline,
// their frames grew the stack of every new worker.
func (m *Monitor) logRetry(c *call) {
	f := c.it.failed
	entry := m.itemLog(c.key.name, c.it).WithFields(log.Fields{"attempt": f.attempts + 1, "events": c.behind + 1})
	if f.last != nil { // an event given to Backoff has none
		entry = entry.WithField("previous_error", f.last)
	}
	entry.Info("retrying backed-off events")
}

// invoke calls the handler; a panic becomes its error, logged with its stack.
func (m *Monitor) invoke(c *call) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = m.panicked(c, r)
		}
	}()
	return m.handler.HandleEvent(&c.ctx, c.it.event)
}

func (m *Monitor) panicked(c *call, r any) error {
	err := fmt.Errorf("eventmonitor: handler panicked: %v", r)
	m.cfg.logger.WithFields(log.Fields{"key": c.key.name, "stack": string(debug.Stack())}).
		WithError(err).Error("event handler panicked")
	return err
}

// outcome is what settle leaves for report, which runs user code (the
// logger, Metrics, the drop handler) without mu.
type outcome struct {
	ignored bool          // the handler returned ErrUnsupportedEvent
	err     error         // the handler's error, nil if handled or ignored
	delay   time.Duration // the backoff a failed event now waits
	drop    error         // the monitor gave up on the event: ErrStopped or ErrMaxAttempts
	overran bool
	end     time.Time
}

// finish settles call c, reports its outcome, and releases it, returning
// its slot's next call (nil if none, or if c held no slot).
func (m *Monitor) finish(c *call, err error) *call {
	out := outcome{ignored: errors.Is(err, ErrUnsupportedEvent)}
	if !out.ignored {
		out.err = err
	}
	c.cancel(context.Canceled) // what the handler started with ctx stops
	out.end = m.cfg.clock.Now()
	var record *call // for the next call of the slot c may hold
	if c.busy {
		record = m.newCall()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if c.state == abandoned {
		return nil // Stop gave up on it and dropped its event
	}
	out.overran = c.state == overran
	m.settle(c, &out)
	if out.err != nil || out.overran || m.cfg.metrics != nil {
		c.state = settling // WaitIdle and Stop wait for the report too
		m.mu.Unlock()
		m.report(c, out)
		m.mu.Lock()
		if out.drop != nil { // the drop handler saw the event before its key moves on
			m.keys.done(c.key)
		}
	}
	return m.release(c, record)
}

// slotsHeld is how many of the WithWorkers slots calls hold. mu is held.
func (m *Monitor) slotsHeld() (n int) {
	for _, c := range m.calls {
		if c.slot == ownSlot {
			n++
		}
	}
	return n
}

// release removes settled call c and, if it held a worker slot, starts the
// slot's next call, in record, and returns it. mu is held.
func (m *Monitor) release(c, record *call) (next *call) {
	m.calls = slices.DeleteFunc(m.calls, func(x *call) bool { return x == c })
	switch c.slot {
	case ownSlot:
		next = m.takeReady(record)
	case gaveSlot:
		m.poke() // a call that kept its worker for WithMaxOverruns may give it now
	}
	m.changed()
	m.work.Done()
	return next
}

// settle records a returned call's outcome and moves its key on: handled,
// ignored, or back at its key's head to wait. The key of an event given up
// on waits until finish has reported the drop. mu is held.
func (m *Monitor) settle(c *call, out *outcome) {
	switch {
	case out.err == nil && out.ignored:
		m.stats.Ignored++
	case out.err == nil:
		m.stats.Handled++
	default:
		m.stats.Failed++
		f := failure{attempts: 1, first: out.end, last: out.err}
		if old := c.it.failed; old != nil {
			f.attempts, f.first = old.attempts+1, old.first
		}
		c.it.failed = &f
		switch {
		case m.state != running:
			out.drop = ErrStopped
		case m.cfg.maxAttempts > 0 && f.attempts >= m.cfg.maxAttempts:
			out.drop = ErrMaxAttempts
		default:
			out.delay = m.keys.failed(c.key, c.it, out.end)
			return
		}
		m.stats.Dropped++
		return
	}
	m.keys.done(c.key)
}

// report hands a settled call's outcome to the metrics, the log and the drop
// handler. A failing key fails once per delay, so it cannot flood the log.
func (m *Monitor) report(c *call, out outcome) {
	ran := out.end.Sub(c.start)
	if mt := m.cfg.metrics; mt != nil {
		mt.HandlerDone(ran, out.err)
		if out.err == nil && !out.ignored && c.it.failed != nil {
			mt.Recovered(out.end.Sub(c.it.failed.first))
		}
	}
	if out.overran {
		m.cfg.logger.WithFields(log.Fields{"key": c.key.name, "ran": ran}).Warn("event handler returned after its deadline")
	}
	switch {
	case out.drop != nil:
		m.itemLog(c.key.name, c.it).WithError(out.err).Warn("giving up on event")
		reason := fmt.Errorf("%w (%d): %w", ErrMaxAttempts, c.it.attempts(), out.err)
		if out.drop == ErrStopped {
			reason = fmt.Errorf("%w: failed while the monitor stops: %w", ErrStopped, out.err)
		}
		m.emit(dropsOf(c.key.name, reason, c.it)...)
	case out.err != nil:
		m.itemLog(c.key.name, c.it).WithError(out.err).WithField("delay", out.delay).Error("event handling failed; backing off")
	}
}

// itemLog is the logger with an event's fields.
func (m *Monitor) itemLog(name string, it item) *log.Entry {
	fields := log.Fields{"key": name, "attempt": it.attempts()}
	if topic, ns := it.from(); topic != "" || ns != "" {
		fields["topic"], fields["namespace"] = topic, ns
	}
	return m.cfg.logger.WithFields(fields)
}
