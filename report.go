package eventmonitor

import (
	"sync"
	"time"

	"github.com/containerd/log"
)

// Metrics receives what Stats cannot hold: durations and drops by reason
// (counters and gauges are read from Stats at scrape time; see the
// prometheus module). Its methods run on the monitor's goroutines without
// its lock: they must be safe for concurrent use, quick, and must not call
// WaitIdle, Stop or Shutdown, which wait for them.
type Metrics interface {
	// HandlerDone reports each handler call's duration and error (nil on
	// success), but for calls Stop abandoned: their events are dropped. A
	// replay whose retry line's log hook ended the goroutine counts as a
	// call that failed with ErrHandlerPanic.
	HandlerDone(d time.Duration, err error)
	// Recovered reports an event handled after failing before, with the time
	// since its first failure.
	Recovered(sinceFirstFailure time.Duration)
	// Dropped reports every drop's reason and event count.
	Dropped(reason error, events int)
}

// outcome is what settle leaves report to do once mu is released; zero
// for a call handled or ignored.
type outcome struct {
	failed error         // the handler's error; nil if the event did not fail
	delay  time.Duration // the backoff the event now waits
	drops  []Drop        // set when the monitor gave up on the event: its key stays Running until release
}

// report gives a settled call's duration to the metrics, logs its overrun
// or failure and hands its drop over, without mu. A failing key fails once
// per delay, so it cannot flood the log.
func (m *Monitor) report(c *call, err error, end time.Time, out outcome, wasOverrun bool) {
	if mt := m.cfg.metrics; mt != nil {
		m.logOnPanic("Metrics", c.key.Name(), func() {
			mt.HandlerDone(end.Sub(c.start), err)
			if err == nil && c.it.failures != nil {
				mt.Recovered(end.Sub(c.it.failures.first))
			}
		})
	}
	if !wasOverrun && out.failed == nil {
		return
	}
	entry := m.cfg.logger.WithFields(itemFields(c.key.Name(), c.it))
	if wasOverrun {
		entry.WithField("ran", m.cfg.clock.Since(c.start)).Warn("event handler returned after its deadline")
	}
	switch {
	case out.drops != nil:
		entry.WithError(out.failed).Warn("giving up on event")
		m.emit(out.drops...)
	case out.failed != nil:
		entry.WithError(out.failed).WithField("delay", out.delay).Error("event handling failed; backing off")
	}
}

// logRetry logs a replay's start before its first call's outcome.
func (m *Monitor) logRetry(c *call) {
	m.mu.Lock()
	fields := itemFields(c.key.Name(), c.it)
	fields["attempt"] = c.it.attempts() + 1
	fields["events"], fields["delay"] = c.key.Len()+1, c.key.Delay() // the replay and what came since, as README says
	m.mu.Unlock()
	entry := m.cfg.logger.WithFields(fields)
	if f := c.it.failures; f != nil {
		// Not "error": the failure is the one that put the key in backoff.
		entry = entry.WithField("previous_error", f.last.Error())
	}
	entry.Info("retrying backed-off events")
}

// logOnce remembers up to maxLoggedOnce kinds of event nobody handles, so
// that each is logged once rather than per event.
type logOnce[K comparable] struct {
	mu     sync.Mutex
	logged map[K]bool
}

// maxLoggedOnce bounds a logOnce: past it, nothing new is logged.
const maxLoggedOnce = 256

// first reports whether k is seen for the first time, and remembers it.
func (o *logOnce[K]) first(k K) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.logged[k] || len(o.logged) >= maxLoggedOnce {
		return false
	}
	if o.logged == nil {
		o.logged = make(map[K]bool)
	}
	o.logged[k] = true
	return true
}

func itemFields(key string, it item) log.Fields {
	fields := log.Fields{"key": key, "attempt": it.attempts()}
	topic, namespace := it.from()
	addOrigin(fields, topic, namespace)
	return fields
}
