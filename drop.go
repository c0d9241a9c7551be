package eventmonitor

import (
	"fmt"

	"github.com/containerd/log"
)

// Drop is an event, or an envelope that never became one, that the monitor
// gave up on.
type Drop struct {
	Key    string
	Events []any // nil when no event was made (an envelope that did not decode, say)
	Reason error // wraps ErrDecode, ErrInvalidEvent, ErrMaxAttempts, ErrQueueFull or ErrStopped
	// Topic and Namespace are the envelope's; "" for Submit, Backoff and WatchExit.
	Topic, Namespace string
}

// String says what was dropped, from where and why, as a log line.
func (d Drop) String() string {
	s := fmt.Sprintf("dropped %d events", len(d.Events))
	switch len(d.Events) {
	case 0:
		s = "dropped an input that did not become an event"
	case 1:
		s = "dropped 1 event"
	}
	if d.Key != "" {
		s += fmt.Sprintf(" of key %q", d.Key)
	}
	if d.Topic != "" || d.Namespace != "" {
		s += fmt.Sprintf(" (topic %q, namespace %q)", d.Topic, d.Namespace)
	}
	return s + fmt.Sprintf(": %v", d.Reason)
}

// dropsOf makes the Drops of key's items: one per run of items of the same
// topic and namespace, so that each says where its events came from.
func dropsOf(key string, reason error, items ...item) []Drop {
	var drops []Drop
	for i, it := range items {
		topic, ns := it.from()
		if i == 0 || topic != drops[len(drops)-1].Topic || ns != drops[len(drops)-1].Namespace {
			drops = append(drops, Drop{Key: key, Reason: reason, Topic: topic, Namespace: ns})
		}
		if d := &drops[len(drops)-1]; it.event != nil {
			d.Events = append(d.Events, it.event)
		}
	}
	return drops
}

// refuse counts an item refused with no caller to tell (an envelope,
// Backoff, an exit) as received and dropped, and returns its Drop for
// handOver. mu is held.
func (m *Monitor) refuse(key string, it item, reason error) []Drop {
	m.stats.Received++
	m.stats.Dropped++
	m.handing++
	return dropsOf(key, reason, it)
}

// handOver hands refuse's drops to the drop handler, without mu, then lets
// WaitIdle see them handed over.
func (m *Monitor) handOver(drops []Drop) {
	if len(drops) == 0 {
		return
	}
	m.emit(drops...)
	m.mu.Lock()
	m.handing--
	m.cond.Broadcast()
	m.mu.Unlock()
}

// emit hands drops to the metrics and the drop handler, without mu.
func (m *Monitor) emit(drops ...Drop) {
	for _, d := range drops {
		if mt := m.cfg.metrics; mt != nil {
			mt.Dropped(d.Reason, max(1, len(d.Events)))
		}
		m.cfg.onDrop(d)
	}
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
