package eventmonitor

import "time"

// Metrics receives the measurements that Stats cannot hold: durations and
// drops by reason. Counters and gauges are read from Stats at scrape time
// (see the prometheus module), so they cost nothing on the event path.
//
// Methods are called on the monitor's goroutines without its lock held;
// they must be safe for concurrent use and quick. With no Metrics set the
// monitor only checks for nil.
type Metrics interface {
	// HandlerDone is called after every handler call with its duration and
	// error (nil on success).
	HandlerDone(d time.Duration, err error)
	// Recovered is called when an event that failed before is handled
	// successfully, with the time since its first failure.
	Recovered(sinceFirstFailure time.Duration)
	// Dropped is called for every drop with its reason and event count.
	Dropped(reason error, events int)
}

// WithMetrics sets where the monitor reports durations and drops.
func WithMetrics(m Metrics) Option { return func(c *config) { c.metrics = m } }
