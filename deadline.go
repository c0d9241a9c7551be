package eventmonitor

import (
	"context"
	"sync/atomic"
	"time"
)

// handlerContext is the context of one handler call. Its deadline is driven
// by the monitor's clock through the scheduler's single timer, rather than by
// context.WithTimeout, for two reasons: a FakeClock then controls handler
// timeouts as it controls retries, and a call costs one 64-byte allocation
// instead of a cancelCtx, a timerCtx and a runtime timer. To stay that small
// it holds no parent (values come from the monitor's base context), no event
// (the key's state holds it during the call), its start as an offset from
// the monitor's epoch (the deadline is the start plus the one timeout), and
// no lock: its state is one atomic word, and the done channel is made only if
// the handler asks for it.
type handlerContext struct {
	monitor *Monitor
	key     string
	start   time.Duration // since monitor.epoch

	// In-flight list links and flags, guarded by Monitor.mu.
	prev, next *handlerContext
	expired    bool // the deadline passed while the call ran
	abandoned  bool // Stop gave up waiting for this call

	state atomic.Uint32 // a ctxEnd, plus doneClosed once done is closed
	done  atomic.Pointer[chan struct{}]
}

// ctxEnd is why a handler context ended, if it has.
type ctxEnd uint32

const (
	notEnded ctxEnd = iota
	endedCanceled
	endedDeadline

	endMask    = 0b11
	doneClosed = 0b100
)

func (e ctxEnd) err() error {
	switch e {
	case endedCanceled:
		return context.Canceled
	case endedDeadline:
		return context.DeadlineExceeded
	}
	return nil
}

func (c *handlerContext) deadline() time.Time {
	return c.monitor.epoch.Add(c.start + c.monitor.cfg.handleTimeout)
}

// started is when the call began.
func (c *handlerContext) started() time.Time { return c.monitor.epoch.Add(c.start) }

func (c *handlerContext) Deadline() (time.Time, bool) { return c.deadline(), true }

func (c *handlerContext) Done() <-chan struct{} {
	if p := c.done.Load(); p != nil {
		return *p
	}
	ch := make(chan struct{})
	if !c.done.CompareAndSwap(nil, &ch) {
		return *c.done.Load()
	}
	// end may have run before the channel was there to close: whichever of
	// the two sees both the end and the channel closes it.
	if c.state.Load()&endMask != uint32(notEnded) {
		c.closeDone()
	}
	return ch
}

func (c *handlerContext) Err() error { return ctxEnd(c.state.Load() & endMask).err() }

func (c *handlerContext) Value(key any) any { return c.monitor.base.Value(key) }

func (c *handlerContext) String() string { return "eventmonitor.handlerContext(" + c.key + ")" }

// end ends the context for why, unless it has ended already.
func (c *handlerContext) end(why ctxEnd) {
	if !c.state.CompareAndSwap(uint32(notEnded), uint32(why)) {
		return
	}
	if c.done.Load() != nil {
		c.closeDone()
	}
}

// closeDone closes the done channel once, whoever gets here first.
func (c *handlerContext) closeDone() {
	for {
		s := c.state.Load()
		if s&doneClosed != 0 {
			return
		}
		if c.state.CompareAndSwap(s, s|doneClosed) {
			close(*c.done.Load())
			return
		}
	}
}

// callList holds the calls in flight in start order. All calls share one
// timeout, so start order is deadline order: the scheduler only ever needs
// the oldest call that has not expired yet.
type callList struct {
	head, tail *handlerContext
	n          int
}

func (l *callList) add(c *handlerContext) {
	c.prev, c.next = l.tail, nil
	if l.tail != nil {
		l.tail.next = c
	} else {
		l.head = c
	}
	l.tail = c
	l.n++
}

func (l *callList) remove(c *handlerContext) {
	if c.prev != nil {
		c.prev.next = c.next
	} else {
		l.head = c.next
	}
	if c.next != nil {
		c.next.prev = c.prev
	} else {
		l.tail = c.prev
	}
	c.prev, c.next = nil, nil
	l.n--
}

// firstLive returns the oldest call whose deadline has not been reached.
func (l *callList) firstLive() *handlerContext {
	c := l.head
	for c != nil && c.expired {
		c = c.next
	}
	return c
}
