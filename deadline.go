package eventmonitor

import (
	"context"
	"sync"
	"time"
)

// handlerContext is the context of one handler call. Its deadline is driven
// by the monitor's clock through the scheduler's single timer, rather than by
// context.WithTimeout, for two reasons: a FakeClock then controls handler
// timeouts as it controls retries, and a call costs one small allocation
// instead of a cancelCtx, a timerCtx and a runtime timer. The done channel is
// made only if the handler asks for it.
type handlerContext struct {
	context.Context // parent: values (the logger) only; it is never cancelled

	key      string
	event    any
	started  time.Time
	deadline time.Time

	// In-flight list links and flags, guarded by Monitor.mu.
	prev, next *handlerContext
	expired    bool // the deadline passed while the call ran
	abandoned  bool // Stop gave up waiting for this call

	mu   sync.Mutex
	done chan struct{}
	err  error
}

func (c *handlerContext) Deadline() (time.Time, bool) { return c.deadline, true }

func (c *handlerContext) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		if c.err != nil {
			close(c.done)
		}
	}
	return c.done
}

func (c *handlerContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *handlerContext) String() string { return "eventmonitor.handlerContext(" + c.key + ")" }

func (c *handlerContext) cancel(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return
	}
	c.err = err
	if c.done != nil {
		close(c.done)
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
