package eventmonitor

import "time"

// Metrics receives what Stats cannot hold: durations and drops by reason.
// Counters and gauges are read from Stats at scrape time (see the prometheus
// module), costing nothing on the event path. Methods run on the monitor's
// goroutines without its lock, so must be concurrency-safe and quick, and
// must not call WaitIdle, Stop or Shutdown, which wait for them. Unset, Metrics costs a nil
// check.
type Metrics interface {
	// HandlerDone reports each handler call's duration and error (nil on
	// success), but for calls Stop abandoned: their events are dropped.
	HandlerDone(d time.Duration, err error)
	// Recovered reports an event handled after failing before, with the time
	// since its first failure.
	Recovered(sinceFirstFailure time.Duration)
	// Dropped reports every drop's reason and event count.
	Dropped(reason error, events int)
}

// WithMetrics sets where the monitor reports durations and drops.
func WithMetrics(m Metrics) Option { return func(c *config) { c.metrics = m } }
