package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
)

// Envelope is one event as a subscriber delivers it (the fields of
// containerd's events.Envelope).
type Envelope struct {
	Timestamp time.Time
	Namespace string
	Topic     string
	Event     typeurl.Any
}

// Subscriber is a source of envelopes, such as containerd's events service.
// The stream ends when ctx ends; a broken stream sends one error on errs.
type Subscriber interface {
	Subscribe(ctx context.Context, filters ...string) (ch <-chan *Envelope, errs <-chan error)
}

// SubscriberFunc adapts a function to Subscriber.
type SubscriberFunc func(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error)

// Subscribe calls f.
func (f SubscriberFunc) Subscribe(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error) {
	return f(ctx, filters...)
}

var (
	// errFiltered marks an envelope of another namespace: counted, not accepted.
	errFiltered = errors.New("eventmonitor: envelope of another namespace")
	// errConverterPanic drops an envelope whose conversion panicked.
	errConverterPanic = fmt.Errorf("%w: converter panicked", ErrInvalidEvent)
)

// ingest converts env without mu, then accepts it. While WithIntakeLimit
// events wait for a worker it waits for room, until ctx ends or intake
// stops, so that a flood stays in the runtime rather than in our memory.
// What cannot be accepted is dropped (after Stop, with ErrStopped). An
// envelope of another namespace counts as Filtered; one of a type nobody
// keys as Ignored, its type logged once.
func (m *Monitor) ingest(ctx context.Context, env *Envelope) {
	m.beginAccepting()
	defer m.endAccepting()
	var it item
	if env != nil {
		it.origin = &origin{env.Topic, env.Namespace}
	}
	key, event, ignored, url, err := m.convert(env)
	it.event = event
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
		for m.state.accepts() && ctx.Err() == nil && m.keys.Queued() >= m.cfg.intakeLimit {
			m.cond.Wait()
		}
		if _, err = m.accept(key, it, streamed); err != nil {
			drops = m.refuse(key, it, err)
		}
	default:
		drops = m.refuse(key, it, err)
	}
	m.mu.Unlock() // endAccepting, deferred, reconciles
	if ignored && m.stream.ignoredURLs.first(url) {
		m.cfg.logger.WithFields(log.Fields{"topic": env.Topic, "namespace": env.Namespace, "type": url}).
			WithError(err).Debug("ignoring events of a type the converter has no key for; logged once per type")
	}
	m.emit(drops...) // the drop handler logs it, by default
}

// beginAccepting counts an envelope or exit received and not yet queued or
// dropped (Monitor.accepting), which WaitIdle and Stop wait for;
// endAccepting ends the count once its drop, if any, was handed over.
func (m *Monitor) beginAccepting() {
	m.mu.Lock()
	m.accepting++
	m.mu.Unlock()
}

func (m *Monitor) endAccepting() {
	m.mu.Lock()
	m.accepting--
	m.reconcile()
	m.mu.Unlock()
}

// convert filters env by namespace and runs the converter. ignored: it has
// no key for the payload's type, whose URL comes too, for the log line (a
// panic in the payload's GetTypeUrl leaves it out). A panic, in a key
// function or in errors.Is running the error's own methods, becomes
// ErrInvalidEvent; any other error that wraps none of ErrUnsupportedEvent,
// ErrDecode and ErrInvalidEvent is wrapped in ErrDecode, and comes with no
// event.
func (m *Monitor) convert(env *Envelope) (key string, event any, ignored bool, url string, err error) {
	switch {
	case env == nil:
		return "", nil, false, "", fmt.Errorf("%w: nil envelope", ErrInvalidEvent)
	case m.cfg.namespace != "" && env.Namespace != m.cfg.namespace:
		return "", nil, false, "", errFiltered
	case env.Event == nil:
		return "", nil, false, "", fmt.Errorf("%w: nil payload", ErrInvalidEvent)
	}
	err = errOnPanic(errConverterPanic, func() (err error) {
		key, event, err = m.cfg.converter.Convert(env.Event)
		err = checked(err)
		ignored = errors.Is(err, ErrUnsupportedEvent)
		switch {
		case err == nil && event == nil:
			err = fmt.Errorf("%w: converter returned a nil event", ErrInvalidEvent)
		case ignored:
			recovering(func() { url = env.Event.GetTypeUrl() })
		case err != nil && !errors.Is(err, ErrDecode) && !errors.Is(err, ErrInvalidEvent):
			err = fmt.Errorf("%w: %w", ErrDecode, err) // a Drop's reason wraps a sentinel
		}
		return err
	})
	if err != nil {
		event = nil // not an event, whatever came beside the error: its Drop holds none
	}
	return key, event, ignored, url, err
}
