package eventmonitor

import (
	"fmt"
	"strings"

	"github.com/containerd/log"
)

// Drop is an event, or an envelope that never became one, that the monitor
// gave up on.
type Drop struct {
	Key    string
	Events []any // nil when the envelope could not be decoded
	Reason error // wraps ErrDecode, ErrInvalidEvent, ErrMaxAttempts, ErrQueueFull or ErrStopped
	// Topic and Namespace are the envelope's, for events that came from the
	// stream; "" for events from Submit, Backoff and WatchExit.
	Topic, Namespace string
}

// String says what was dropped, where it came from and why, for a log line
// a person can act on.
func (d Drop) String() string {
	var b strings.Builder
	switch n := len(d.Events); {
	case n == 0:
		b.WriteString("dropped an envelope that did not become an event")
	case n == 1:
		b.WriteString("dropped 1 event")
	default:
		fmt.Fprintf(&b, "dropped %d events", n)
	}
	if d.Key != "" {
		fmt.Fprintf(&b, " of key %q", d.Key)
	}
	if d.Topic != "" || d.Namespace != "" {
		fmt.Fprintf(&b, " (topic %q, namespace %q)", d.Topic, d.Namespace)
	}
	fmt.Fprintf(&b, ": %v", d.Reason)
	return b.String()
}

// drop counts a drop and returns it for emit, which runs without mu. mu is
// held.
func (m *Monitor) drop(key string, events []any, reason error) Drop {
	m.stats.Dropped += uint64(max(1, len(events)))
	return Drop{Key: key, Events: events, Reason: reason}
}

// refuse drops an event that arrived with no caller to refuse it to (from
// the stream, an exit watcher or Backoff): it counts as received and
// dropped, so Stats still accounts for it. event may be nil. mu is held.
func (m *Monitor) refuse(key string, event any, reason error) Drop {
	m.stats.Received++
	var events []any
	if event != nil {
		events = []any{event}
	}
	return m.drop(key, events, reason)
}

// dropByOrigin drops a key's events, one Drop for each run of events that
// came from the same topic and namespace, so that every Drop says where its
// events came from. mu is held.
func (m *Monitor) dropByOrigin(key string, items []item) []Drop {
	var drops []Drop
	for len(items) > 0 {
		n := 1
		for n < len(items) && sameOrigin(items[n], items[0]) {
			n++
		}
		events := make([]any, n)
		for i, it := range items[:n] {
			events[i] = it.event
		}
		d := m.drop(key, events, ErrStopped)
		d.Topic, d.Namespace = items[0].from()
		drops = append(drops, d)
		items = items[n:]
	}
	return drops
}

func sameOrigin(a, b item) bool {
	at, an := a.from()
	bt, bn := b.from()
	return at == bt && an == bn
}

// emit hands a drop to the drop handler; a panicking drop handler is logged
// rather than allowed to take a worker or the stream down.
func (m *Monitor) emit(d Drop) {
	if mt := m.cfg.metrics; mt != nil {
		mt.Dropped(d.Reason, max(1, len(d.Events)))
	}
	defer func() {
		if r := recover(); r != nil {
			m.cfg.logger.WithField("key", d.Key).Errorf("drop handler panicked: %v", r)
		}
	}()
	m.cfg.onDrop(d)
}

func logDrop(l *log.Entry) func(Drop) {
	return func(d Drop) {
		fields := log.Fields{"key": d.Key, "events": len(d.Events)}
		if d.Topic != "" || d.Namespace != "" {
			fields["topic"], fields["namespace"] = d.Topic, d.Namespace
		}
		l.WithFields(fields).WithError(d.Reason).Warn("event dropped")
	}
}
