package eventmonitor

import (
	"context"
	"errors"
	"fmt"

	"github.com/containerd/log"
)

// maxIgnoredURLs bounds the ignored type URLs remembered for logging once.
const maxIgnoredURLs = 256

// errFiltered marks an envelope of another namespace: counted, not accepted.
var errFiltered = errors.New("eventmonitor: envelope of another namespace")

// take converts env without the lock and accepts it, waiting until ctx ends
// while WithIntakeLimit events wait for a worker, so that a flood stays in
// the runtime rather than in our memory. What cannot be accepted is dropped.
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
	if report := m.admit(ctx, env, key, event, url, err); report != nil {
		m.mu.Unlock()
		report()
		m.mu.Lock()
	}
	m.stream.accepting--
	m.changed()
	m.mu.Unlock()
}

// admit counts a converted envelope, or accepts its event, and returns what
// to log and emit once mu is released, if anything. mu is held.
func (m *Monitor) admit(ctx context.Context, env *Envelope, key string, event any, url string, err error) (report func()) {
	switch {
	case errors.Is(err, errFiltered):
		m.stats.Received++
		m.stats.Filtered++
		return nil
	case errors.Is(err, ErrUnsupportedEvent):
		m.stats.Received++
		m.stats.Ignored++
		if !m.firstIgnored(url) {
			return nil
		}
		return func() {
			m.cfg.logger.WithFields(log.Fields{"topic": env.Topic, "namespace": env.Namespace, "type": url}).
				WithError(err).Debug("ignoring events of a type the converter has no key for; logged once per type")
		}
	}
	if err == nil {
		for (m.state == held || m.state == running) && ctx.Err() == nil && m.keys.Queued() >= m.cfg.intakeLimit {
			m.cond.Wait()
		}
		if _, err = m.accept(key, item{event: event, origin: &origin{env.Topic, env.Namespace}}, false); err == nil {
			return nil
		}
	}
	d := m.refuse(key, event, err)
	if env == nil {
		return func() { m.emit(d) }
	}
	d.Topic, d.Namespace = env.Topic, env.Namespace
	return func() {
		m.cfg.logger.WithFields(log.Fields{"topic": env.Topic, "namespace": env.Namespace, "key": key}).
			WithError(err).Debug("envelope dropped")
		m.emit(d)
	}
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
	defer panicToErr(&err, "%w: converter panicked: %v", ErrInvalidEvent) // key and event are still zero
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

// panicToErr, deferred, turns a panic into *err, formatted from format, args
// and the panic's value.
func panicToErr(err *error, format string, args ...any) {
	if r := recover(); r != nil {
		*err = fmt.Errorf(format, append(args, r)...)
	}
}
