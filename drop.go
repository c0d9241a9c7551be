package eventmonitor

import (
	"fmt"

	"github.com/containerd/log"
)

// Drop is an event, or an envelope that never became one, that the monitor
// gave up on.
type Drop struct {
	Key string
	// Events is nil when no event was made: an envelope not decoded, a nil
	// event given to Backoff, an exit whose builder panicked.
	Events []any
	Reason error // wraps ErrDecode, ErrInvalidEvent, ErrMaxAttempts, ErrQueueFull or ErrStopped
	// Topic and Namespace are the envelope's; "" for events from Submit,
	// Backoff and WatchExit.
	Topic, Namespace string
}

// String says what was dropped, from where and why, as an actionable log line.
func (d Drop) String() string {
	s := "dropped an input that did not become an event"
	if n := len(d.Events); n > 0 {
		s = "dropped " + counted(n, "event")
	}
	if d.Key != "" {
		s += fmt.Sprintf(" of key %q", d.Key)
	}
	if d.Topic != "" || d.Namespace != "" {
		s += fmt.Sprintf(" (topic %q, namespace %q)", d.Topic, d.Namespace)
	}
	return s + fmt.Sprintf(": %v", d.Reason)
}

// counted is "1 noun" or "n nouns".
func counted(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// failedDrop is the reason an event that failed is dropped, formatted
// only when read: the handler's error is user code, not to run under mu.
type failedDrop struct {
	why    error // ErrStopped or ErrMaxAttempts
	detail string
	err    error // the handler's
}

func (f failedDrop) Error() string {
	return fmt.Sprintf("%v%s: %s", f.why, f.detail, f.err.Error()) // not %v, which may call a Format of its own
}
func (f failedDrop) Unwrap() []error { return []error{f.why, f.err} }

// drop counts the drops of key's items and returns them for emit to hand
// over once mu is released: one Drop per run of items of the same topic
// and namespace, so that each says where its events came from. An item
// with a nil event counts, but adds nothing to Events. mu is held.
func (m *Monitor) drop(key string, reason error, items ...item) []Drop {
	var drops []Drop
	for i, it := range items {
		topic, ns := it.from()
		if i == 0 || topic != drops[len(drops)-1].Topic || ns != drops[len(drops)-1].Namespace {
			drops = append(drops, Drop{Key: key, Reason: reason, Topic: topic, Namespace: ns})
		}
		if d := &drops[len(drops)-1]; it.event != nil {
			d.Events = append(d.Events, it.event)
		}
		m.stats.Dropped++
	}
	return drops
}

// refuse drops an item with no caller to refuse it to, counting it as
// received too so Stats stays balanced. mu is held.
func (m *Monitor) refuse(key string, it item, reason error) []Drop {
	m.stats.Received++
	return m.drop(key, reason, it)
}

// emit hands drops to the metrics and the drop handler.
func (m *Monitor) emit(drops ...Drop) {
	for _, d := range drops {
		if mt := m.cfg.metrics; mt != nil {
			m.logOnPanic("Metrics", d.Key, func() { mt.Dropped(d.Reason, max(1, len(d.Events))) })
		}
		m.logOnPanic("drop handler", d.Key, func() { m.cfg.onDrop(d) })
	}
}

// logOnPanic runs fn, which calls a user's callback, and logs its panic.
func (m *Monitor) logOnPanic(callback, key string, fn func()) {
	if r, ok := recovering(fn); !ok {
		m.cfg.logger.WithField("key", key).Errorf("%s panicked: %s", callback, panicked(r))
	}
}

// addOrigin adds an envelope's topic and namespace to a log line's fields.
func addOrigin(fields log.Fields, topic, namespace string) {
	if topic != "" || namespace != "" {
		fields["topic"], fields["namespace"] = topic, namespace
	}
}

func logDrop(l *log.Entry) func(Drop) {
	return func(d Drop) {
		fields := log.Fields{"key": d.Key, "events": len(d.Events)}
		addOrigin(fields, d.Topic, d.Namespace)
		l.WithFields(fields).WithError(d.Reason).Warn("event dropped")
	}
}
