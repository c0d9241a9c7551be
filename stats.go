package eventmonitor

import (
	"slices"
	"strings"
	"time"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// Stats holds the monitor's counters and gauges. Every envelope read or
// event accepted is Received once and is in exactly one other term of:
//
//	Received = Filtered + Ignored + Handled + Dropped + Forgotten + Queued + EventsInBackoff + InFlight
type Stats struct {
	Received uint64 // envelopes read; events accepted, or dropped with no caller to refuse (Backoff, exits)
	Filtered uint64 // envelopes of other namespaces
	// Ignored: envelopes of types the converter does not key, and events
	// the handler returned ErrUnsupportedEvent for: not ours, not drops.
	Ignored      uint64
	Handled      uint64 // handler calls that succeeded
	Failed       uint64 // handler calls that failed, panicked or ended their goroutine (or whose retry line did)
	Retried      uint64 // backoff replays begun, including one Forget emptied before it started
	Dropped      uint64 // events given to the drop handler
	Forgotten    uint64 // events returned by Forget
	Resubscribed uint64 // Run's re-subscriptions

	// InFlight: handler calls running, Overrunning included: those past
	// their handle timeout and its grace (see WithHandleTimeout), each
	// still holding its key (see WithMaxOverruns).
	InFlight, Overrunning int
	Queued                int // events waiting for a worker, also behind a running call of their key
	// KeysInBackoff, EventsInBackoff: keys in backoff (waiting for their
	// due time, replaying, or given Backoff during a call) and their events.
	KeysInBackoff, EventsInBackoff int
}

// Stats returns a consistent snapshot of the counters and gauges: the
// identity the Stats type states holds in every snapshot.
func (m *Monitor) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.stats
	// By stage, not runningIn: a call whose handler just returned holds its
	// event until it settles.
	for _, c := range m.calls {
		switch c.stage {
		case overran:
			s.Overrunning++
			fallthrough
		case inTime, late:
			s.InFlight++
		}
	}
	s.Queued = m.keys.Queued()
	s.KeysInBackoff, s.EventsInBackoff = m.keys.InBackoff()
	return s
}

// Pending is one key's backoff queue as Pending() saw it.
type Pending struct {
	Key      string
	Events   []any // in the order they will be handled
	Attempts int   // failed handler calls of the event at the head
	// Due: when the queue replays, but not before the key's call in
	// progress ends (in the past while replaying).
	Due time.Time
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
		for i, it := range k.Items() {
			if i == 0 {
				p.Attempts = it.attempts()
			}
			p.Events = append(p.Events, it.event)
		}
		out = append(out, p)
	})
	slices.SortFunc(out, func(a, b Pending) int { return strings.Compare(a.Key, b.Key) })
	return out
}
