package eventmonitor

import (
	"context"
	"sync"
	"time"

	"github.com/containerd/log"
)

// handlerContext is the context of one handler call. Its deadline is driven
// by the monitor's clock through the scheduler's single timer, rather than by
// context.WithTimeout, for two reasons: a FakeClock then controls handler
// timeouts as it controls retries, and a call costs a fraction of one small
// allocation (see contextSlab) instead of a cancelCtx, a timerCtx and a
// runtime timer. To stay small (80 bytes: the garbage collector scans every
// one) it holds no parent (values come from the monitor's base context), no
// event (its caller holds that), and its start as an offset from the
// monitor's epoch (the deadline is the start plus the one timeout); the done
// channel is made only if the handler asks for it.
type handlerContext struct {
	monitor *Monitor
	key     string
	by      *caller       // the goroutine running the call; it holds the event
	start   time.Duration // since monitor.epoch

	// In-flight list links and flags, guarded by Monitor.mu.
	link      listLinks[handlerContext]
	late      bool // the deadline passed while the call ran: its context ended
	expired   bool // the grace after the deadline passed too: the call overruns
	replaced  bool // a new worker took this call's worker's place
	abandoned bool // Stop gave up waiting for this call

	// Why the context ended, and its done channel: set together under mu,
	// so that Err is non-nil exactly when Done is closed.
	ended ctxEnd
	mu    sync.Mutex
	done  chan struct{}
}

// ctxEnd is why a handler context ended, if it has.
type ctxEnd uint8

const (
	notEnded ctxEnd = iota
	endedCanceled
	endedDeadline
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

// overrunAt is when a call still running past its deadline is reported as
// overrunning. The grace lets a handler that keeps a timeout of its own,
// started a moment after the monitor's, return as its own deadline passes
// without being taken for a stuck one (containerd's handlers do exactly
// that), while a stuck call is still found within a second.
func (c *handlerContext) overrunAt() time.Time {
	return c.deadline().Add(min(time.Second, c.monitor.cfg.handleTimeout/10))
}

// started is when the call began.
func (c *handlerContext) started() time.Time { return c.monitor.epoch.Add(c.start) }

func (c *handlerContext) Deadline() (time.Time, bool) {
	if c.monitor.cfg.handleTimeout == 0 {
		return time.Time{}, false
	}
	return c.deadline(), true
}

func (c *handlerContext) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		if c.ended != notEnded {
			close(c.done)
		}
	}
	return c.done
}

func (c *handlerContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ended.err()
}

// Value answers from the monitor's base context, except that the logger it
// carries comes back with the call's key as a field: log.G(ctx) in a
// handler says which key it is handling.
func (c *handlerContext) Value(key any) any {
	v := c.monitor.base.Value(key)
	if logger, ok := v.(*log.Entry); ok {
		return logger.WithField("key", c.key)
	}
	return v
}

func (c *handlerContext) String() string { return "eventmonitor.handlerContext(" + c.key + ")" }

// end ends the context for why, unless it has ended already.
func (c *handlerContext) end(why ctxEnd) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ended != notEnded {
		return
	}
	c.ended = why
	if c.done != nil {
		close(c.done)
	}
}

// contextSlabSize is how many handler contexts a worker allocates at once.
const contextSlabSize = 32

// contextSlab hands out handler contexts from arrays of contextSlabSize, so
// that a worker allocates once per contextSlabSize calls rather than once
// per call. A context is never reused: a handler may keep its context past
// the call, so an array is only ever left to the garbage collector, which
// frees it once none of its contexts is reachable.
type contextSlab struct{ free []handlerContext }

func (s *contextSlab) next() *handlerContext {
	if len(s.free) == 0 {
		s.free = make([]handlerContext, contextSlabSize)
	}
	c := &s.free[0]
	s.free = s.free[1:]
	return c
}

// callList holds the calls in flight in start order. All calls share one
// timeout, so start order is deadline order: the scheduler only ever needs
// the oldest call that has not expired yet.
type callList struct {
	linkedList[handlerContext, *handlerContext]
}

func (c *handlerContext) links() *listLinks[handlerContext] { return &c.link }

// nextWake returns when the scheduler must look at the calls in flight
// again: the earliest deadline of a call within it, or the end of the grace
// of a call past its deadline. Calls are in deadline order, so the search
// ends at the first call within its deadline. mu is held.
func (l *callList) nextWake() (at time.Time, ok bool) {
	for c := l.head; c != nil; c = c.link.next {
		if c.expired {
			continue
		}
		t := c.deadline()
		if c.late {
			t = c.overrunAt()
		}
		if !ok || t.Before(at) {
			at, ok = t, true
		}
		if !c.late {
			break
		}
	}
	return at, ok
}
