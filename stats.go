package eventmonitor

import (
	"slices"
	"strings"
	"time"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// Stats holds the monitor's counters and gauges.
//
// Every event accepted is counted once in Received and ends in exactly one
// of Handled, Ignored, Dropped, Forgotten, or the gauges Queued,
// EventsInBackoff and InFlight; envelopes of other namespaces are Received
// and Filtered:
//
//	Received = Filtered + Ignored + Handled + Dropped + Forgotten + Queued + EventsInBackoff + InFlight
type Stats struct {
	// Received: every envelope read and every accepted Submit or Backoff;
	// Filtered: envelopes of other namespaces; Ignored: envelopes whose type
	// the converter does not key and events the handler returned
	// ErrUnsupportedEvent for (a Mux with no route for the type), which are
	// not ours to handle and so not drops; Handled: successful handler
	// calls; Failed: failed ones (panics too); Retried: backoff replays
	// started; Dropped: events handed to the drop handler; Forgotten: events
	// returned by Forget; Resubscribed: Run's re-subscriptions.
	Received, Filtered, Ignored, Handled, Failed, Retried, Dropped, Forgotten, Resubscribed uint64
	// InFlight: handler calls running, Overrunning among them; Overrunning:
	// calls past their handle timeout that have not returned (each holds its
	// key; see WithMaxOverruns); Queued: events waiting for a worker;
	// KeysInBackoff, EventsInBackoff: keys and events waiting or replaying.
	InFlight, Overrunning, Queued, KeysInBackoff, EventsInBackoff int
}

// Stats returns a consistent snapshot of the counters and gauges.
func (m *Monitor) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.stats
	s.InFlight = m.calls.inFlight()
	s.Overrunning = m.calls.stages[overran]
	s.Queued = m.keys.Queued()
	s.KeysInBackoff, s.EventsInBackoff = m.keys.InBackoff()
	return s
}

// Pending is one key's backoff queue as Pending() saw it.
type Pending struct {
	Key      string
	Events   []any     // in the order they will be handled
	Attempts int       // failed handler calls of the event at the head
	Due      time.Time // when the queue replays (in the past while replaying)
}

// Pending returns a snapshot of every backoff queue, sorted by key.
func (m *Monitor) Pending() []Pending {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []Pending
	m.keys.Keys(func(k *keyq.Key[item]) {
		if !k.InBackoff() {
			return
		}
		p := Pending{Key: k.Name(), Due: k.Due()}
		for _, it := range k.Items() {
			p.Events = append(p.Events, it.event)
		}
		if items := k.Items(); len(items) > 0 {
			p.Attempts = items[0].attempts()
		}
		out = append(out, p)
	})
	slices.SortFunc(out, func(a, b Pending) int { return strings.Compare(a.Key, b.Key) })
	return out
}
