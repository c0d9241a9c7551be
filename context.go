package eventmonitor

import (
	"context"
	"time"

	"github.com/containerd/log"
)

// handlerContext is a handler's ctx: a standard library context, ended when
// the call returns, at its deadline or at Stop, whose Deadline is on the
// monitor's clock and whose values add the key and the envelope's time.
type handlerContext struct {
	context.Context
	key      string
	origin   *origin // nil for an event that came in no envelope
	deadline time.Time
}

// Deadline is the call's start on the monitor's clock plus the handle timeout.
func (c *handlerContext) Deadline() (time.Time, bool) { return c.deadline, !c.deadline.IsZero() }

// Err is DeadlineExceeded once the deadline ended the call. Contexts
// derived from it end then too, Canceled with the cause DeadlineExceeded:
// the monitor's clock, not a runtime timer, times the deadline.
func (c *handlerContext) Err() error {
	err := c.Context.Err()
	if err != nil && context.Cause(c.Context) == context.DeadlineExceeded {
		return context.DeadlineExceeded
	}
	return err
}

// Value gives KeyFromContext the key, TimestampFromContext the envelope's
// time, and log.G(ctx) a logger with the key.
func (c *handlerContext) Value(k any) any {
	switch k {
	case keyContext{}:
		return c.key
	case timestampContext{}:
		if c.origin == nil {
			return nil
		}
		return c.origin.at
	}
	v := c.Context.Value(k)
	if l, ok := v.(*log.Entry); ok {
		return l.WithField("key", c.key)
	}
	return v
}

type (
	keyContext       struct{}
	timestampContext struct{}
)

// KeyFromContext returns the key of the event whose handler call ctx is (or
// derives from), and "" outside a handler call.
func KeyFromContext(ctx context.Context) string {
	name, _ := ctx.Value(keyContext{}).(string)
	return name
}

// TimestampFromContext returns the Timestamp of the envelope whose event the
// handler call ctx is (or derives from) making, for ordering a stream's news
// against a listing taken at a known time. It returns false for an event
// given to Submit, Backoff or WatchExit, and outside a handler call.
func TimestampFromContext(ctx context.Context) (time.Time, bool) {
	at, ok := ctx.Value(timestampContext{}).(time.Time)
	return at, ok
}
