package eventmonitor

import (
	"context"
	"sort"
	"time"
)

// Stats holds the monitor's counters and gauges. Every envelope read or
// event accepted is Received once and is in exactly one other term of:
//
//	Received = Filtered + Ignored + Handled + Dropped + Forgotten + Queued + EventsInBackoff + InFlight
type Stats struct {
	Received     uint64 // envelopes read, events accepted, and events refused with no caller to tell (Backoff, exits)
	Filtered     uint64 // envelopes of other namespaces
	Ignored      uint64 // envelopes of types the converter has no key for, and events the handler returned ErrUnsupportedEvent for
	Handled      uint64 // handler calls that succeeded
	Failed       uint64 // handler calls that failed or panicked
	Retried      uint64 // handler calls of events that had failed before
	Dropped      uint64 // events given to the drop handler
	Forgotten    uint64 // events returned by Forget
	Resubscribed uint64 // subscriptions Run established after an outage

	InFlight    int // handler calls in progress, Overrunning included
	Overrunning int // calls past their handle timeout and its grace, each holding its key
	Queued      int // events waiting for a worker, or behind a call of their key
	// KeysInBackoff, EventsInBackoff: keys waiting for a retry, and their events.
	KeysInBackoff, EventsInBackoff int
}

// Stats returns a consistent snapshot of the counters and gauges.
func (m *Monitor) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.stats
	for _, c := range m.calls {
		switch c.state {
		case overran:
			s.Overrunning++
			fallthrough
		case inTime, late:
			s.InFlight++
		}
	}
	s.Queued = m.keys.queued - m.keys.inHeap
	s.KeysInBackoff, s.EventsInBackoff = len(m.keys.due), m.keys.inHeap
	return s
}

// Pending is one key's backoff queue as Pending() saw it.
type Pending struct {
	Key      string
	Events   []any     // in the order they will be handled
	Attempts int       // failed handler calls of the event at the head (Backoff counts one)
	Due      time.Time // when the key retries
}

// Pending returns a snapshot of every key waiting for a retry, sorted by key.
func (m *Monitor) Pending() []Pending {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Pending, 0, len(m.keys.due))
	for _, k := range m.keys.due {
		p := Pending{Key: k.name, Attempts: k.events[0].attempts(), Due: k.due}
		for _, it := range k.events {
			p.Events = append(p.Events, it.event)
		}
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// WaitIdle waits until the monitor has done all it can for now: no call in
// progress or being reported, no key waiting for a worker, and the
// scheduler's timer set for the next retry. It returns ctx's error if ctx
// ends first. It is the sync point of fake-clock tests (see package
// eventmonitortest).
func (m *Monitor) WaitIdle(ctx context.Context) error {
	ctx, done := m.waitingOn(ctx)
	defer done()
	m.mu.Lock()
	defer m.mu.Unlock()
	for {
		s := &m.sched
		overdue := !s.armed.IsZero() && !s.armed.After(m.cfg.clock.Now()) // its timer fired: a pass is coming
		switch {
		case len(m.calls) == 0 && m.handing == 0 && (m.state == held || !m.keys.anyReady()) && !s.poked && !overdue:
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		}
		m.cond.Wait()
	}
}

// Metrics receives what Stats cannot hold: durations and drops by reason
// (the prometheus module reads the rest from Stats). Its methods run on the
// monitor's goroutines without its lock, possibly concurrently.
type Metrics interface {
	// HandlerDone reports each handler call's duration and error (nil on
	// success and for an ignored event), but for calls Stop abandoned.
	HandlerDone(d time.Duration, err error)
	// Recovered reports an event handled after failing before, with the time
	// since its first failure.
	Recovered(sinceFirstFailure time.Duration)
	// Dropped reports every drop's reason and event count.
	Dropped(reason error, events int)
}
