package eventmonitor

import (
	"context"
	"errors"
	"fmt"

	"github.com/containerd/log"
)

// maxIgnoredURLs bounds the type URLs a monitor remembers having ignored, to
// log each once.
const maxIgnoredURLs = 256

// errFiltered marks an envelope of another namespace: counted, not accepted.
var errFiltered = errors.New("eventmonitor: envelope of another namespace")

// take accepts one envelope read from a stream: converted without the lock,
// then accepted, waiting while WithIntakeLimit events wait for a worker (so
// a flood stays in the runtime, not in our memory) until ctx ends. What
// cannot be accepted goes to the drop handler with the reason.
func (m *Monitor) take(ctx context.Context, env *Envelope) {
	m.mu.Lock()
	m.stream.accepting++ // WaitIdle waits for it
	m.mu.Unlock()
	key, event, err := m.convert(env)
	var url string
	if errors.Is(err, ErrUnsupportedEvent) {
		url = env.Event.GetTypeUrl() // the payload's code, not to be called under the lock
	}

	m.mu.Lock()
	var drop *Drop
	firstIgnored := false
	switch {
	case errors.Is(err, errFiltered):
		m.stats.Received++
		m.stats.Filtered++
	case errors.Is(err, ErrUnsupportedEvent):
		m.stats.Received++
		m.stats.Ignored++
		firstIgnored = m.firstIgnored(url)
	default:
		for err == nil && (m.state == held || m.state == running) && ctx.Err() == nil &&
			m.keys.Queued() >= m.cfg.intakeLimit {
			m.cond.Wait()
		}
		if err == nil {
			_, err = m.accept(key, item{event: event, origin: &origin{env.Topic, env.Namespace}}, false)
		}
		if err != nil {
			d := m.refuse(key, event, err)
			if env != nil {
				d.Topic, d.Namespace = env.Topic, env.Namespace
			}
			drop = &d
		}
	}
	if drop != nil || firstIgnored {
		m.mu.Unlock()
		m.reportEnvelope(env, url, key, err, drop)
		m.mu.Lock()
	}
	m.stream.accepting--
	m.changed()
	m.mu.Unlock()
}

func (m *Monitor) reportEnvelope(env *Envelope, url, key string, err error, drop *Drop) {
	if env == nil {
		m.emit(*drop)
		return
	}
	entry := m.cfg.logger.WithFields(log.Fields{"topic": env.Topic, "namespace": env.Namespace})
	if drop == nil {
		entry.WithField("type", url).WithError(err).
			Debug("ignoring events of a type the converter has no key for; logged once per type")
		return
	}
	entry.WithField("key", key).WithError(err).Debug("envelope dropped")
	m.emit(*drop)
}

// firstIgnored reports whether url is ignored for the first time, up to
// maxIgnoredURLs. mu is held.
func (m *Monitor) firstIgnored(url string) bool {
	if m.stream.ignoredURLs[url] || len(m.stream.ignoredURLs) >= maxIgnoredURLs {
		return false
	}
	if m.stream.ignoredURLs == nil {
		m.stream.ignoredURLs = make(map[string]bool)
	}
	m.stream.ignoredURLs[url] = true
	return true
}

// convert filters env by namespace and runs the converter, turning a panic
// (say, in a key function) into ErrInvalidEvent.
func (m *Monitor) convert(env *Envelope) (key string, event any, err error) {
	defer func() {
		if r := recover(); r != nil {
			key, event, err = "", nil, fmt.Errorf("%w: converter panicked: %v", ErrInvalidEvent, r)
		}
	}()
	switch {
	case env == nil:
		return "", nil, fmt.Errorf("%w: nil envelope", ErrInvalidEvent)
	case m.cfg.namespace != "" && env.Namespace != m.cfg.namespace:
		return "", nil, errFiltered
	case env.Event == nil:
		return "", nil, fmt.Errorf("%w: nil payload", ErrInvalidEvent)
	}
	key, event, err = m.cfg.converter.Convert(env.Event)
	if err == nil && event == nil {
		err = fmt.Errorf("%w: converter returned a nil event", ErrInvalidEvent)
	}
	return key, event, err
}
