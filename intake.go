package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
)

// Envelope is one event as a subscriber delivers it (the fields of
// containerd's events.Envelope).
type Envelope struct {
	Timestamp time.Time // when it was published; the handler's ctx carries it (TimestampFromContext)
	Namespace string
	Topic     string
	Event     typeurl.Any
}

// errFiltered marks an envelope of another namespace: counted, not accepted.
var errFiltered = errors.New("eventmonitor: envelope of another namespace")

// ingest converts env without mu, then accepts it, waiting while
// WithIntakeLimit events wait for a worker (until ctx ends or intake
// stops), so that a flood stays in the runtime rather than in memory.
func (m *Monitor) ingest(ctx context.Context, env *Envelope) {
	name, event, err := m.convert(env)
	ignored := errors.Is(err, ErrUnsupportedEvent)
	it := item{event: event}
	if env != nil {
		it.origin = &origin{env.Topic, env.Namespace, env.Timestamp}
	}
	m.mu.Lock()
	var drops []Drop
	switch {
	case err == errFiltered:
		m.stats.Received++
		m.stats.Filtered++
	case ignored:
		m.stats.Received++
		m.stats.Ignored++
	case err == nil:
		for m.state == running && !m.intakeEnded() && ctx.Err() == nil && m.keys.queued-m.keys.inHeap >= m.cfg.intakeLimit {
			m.cond.Wait()
		}
		err = m.accept(name, it, fromStream)
	}
	if err != nil && err != errFiltered && !ignored {
		drops = m.refuse(name, it, err)
	}
	m.changed()
	m.mu.Unlock()
	switch {
	case err == errFiltered && m.filteredNamespaces.first(env.Namespace):
		m.cfg.logger.WithField("namespace", env.Namespace).
			Debug("ignoring events of another namespace (WithNamespace); logged once per namespace")
	case ignored && m.ignoredTypes.first(env.Event.GetTypeUrl()):
		m.cfg.logger.WithFields(log.Fields{"topic": env.Topic, "namespace": env.Namespace, "type": env.Event.GetTypeUrl()}).
			WithError(err).Debug("ignoring events of a type the converter has no key for; logged once per type")
	}
	m.handOver(drops)
}

// convert filters env by namespace and runs the converter. An error that
// wraps none of ErrUnsupportedEvent, ErrDecode and ErrInvalidEvent is
// wrapped in ErrDecode; a panic becomes ErrInvalidEvent.
func (m *Monitor) convert(env *Envelope) (name string, event any, err error) {
	switch {
	case env == nil:
		return "", nil, fmt.Errorf("%w: nil envelope", ErrInvalidEvent)
	case m.cfg.namespace != "" && env.Namespace != m.cfg.namespace:
		return "", nil, errFiltered
	case env.Event == nil:
		return "", nil, fmt.Errorf("%w: nil payload", ErrInvalidEvent)
	}
	defer func() {
		if r := recover(); r != nil {
			name, event, err = "", nil, fmt.Errorf("%w: converter panicked: %v", ErrInvalidEvent, r)
		}
	}()
	name, event, err = m.cfg.converter.Convert(env.Event)
	switch {
	case err == nil && event == nil:
		err = fmt.Errorf("%w: converter returned a nil event", ErrInvalidEvent)
	case err != nil && !errors.Is(err, ErrUnsupportedEvent) && !errors.Is(err, ErrDecode) && !errors.Is(err, ErrInvalidEvent):
		err = fmt.Errorf("%w: %w", ErrDecode, err)
	}
	if err != nil {
		event = nil // a Drop holds no half-made event
	}
	return name, event, err
}

// logOnce remembers up to 256 kinds of input nobody handles, so that each
// is logged once rather than per event.
type logOnce[K comparable] struct {
	mu     sync.Mutex
	logged map[K]bool
}

// first reports whether k is seen for the first time, and remembers it.
func (o *logOnce[K]) first(k K) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.logged[k] || len(o.logged) >= 256 {
		return false
	}
	if o.logged == nil {
		o.logged = make(map[K]bool)
	}
	o.logged[k] = true
	return true
}
