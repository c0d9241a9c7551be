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

type subscription struct {
	ch   <-chan *Envelope
	errs <-chan error
}

// Subscribe subscribes to s for Start, as containerd's CRI monitor does. The
// subscription lasts until Stop or Shutdown.
func (m *Monitor) Subscribe(s Subscriber, filters ...string) {
	ch, errs := s.Subscribe(m.intake, filters...)
	m.mu.Lock()
	m.subscribed = &subscription{ch: ch, errs: errs}
	m.mu.Unlock()
}

// Start reads the stream opened by Subscribe. The returned channel delivers
// the stream's error, if it breaks, and is closed when reading ends (on a
// stream error, or on Stop or Shutdown). Without a converter it delivers
// ErrNoConverter; before Subscribe, ErrNotSubscribed; after Stop, ErrStopped.
func (m *Monitor) Start() <-chan error {
	errCh := make(chan error, 1)
	m.mu.Lock()
	sub := m.subscribed
	m.subscribed = nil
	var err error
	switch {
	case m.state != stateRunning:
		err = ErrStopped
	case m.cfg.converter == nil:
		err = ErrNoConverter
	case sub == nil:
		err = ErrNotSubscribed
	default:
		m.goroutines.Add(1)
	}
	m.mu.Unlock()
	if err != nil {
		errCh <- err
		close(errCh)
		return errCh
	}
	go func() {
		defer m.goroutines.Done()
		defer close(errCh)
		if _, err := m.consume(m.intake, sub); err != nil && m.intake.Err() == nil {
			m.cfg.logger.WithError(err).Error("event stream failed")
			errCh <- err
		}
	}()
	return errCh
}

// Run subscribes to s and handles its events until ctx ends. When the stream
// breaks it re-subscribes after a backoff (WithResubscribe), reset once a
// subscription delivers an event, and calls the WithResync hook after every
// re-subscription so that what the broken stream missed can be relisted.
// It returns nil when ctx ends, ErrStopped if the monitor stops first. Run
// returning does not stop the monitor: call Shutdown or Stop.
func (m *Monitor) Run(ctx context.Context, s Subscriber, filters ...string) error {
	if s == nil {
		return fmt.Errorf("%w: Run needs a subscriber", ErrInvalidOption)
	}
	if m.cfg.converter == nil {
		return ErrNoConverter
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(m.intake, cancel)()

	delay := m.cfg.resubInitial
	for subscribed := false; ; subscribed = true {
		subCtx, cancelSub := context.WithCancel(runCtx)
		ch, errs := s.Subscribe(subCtx, filters...)
		if subscribed && m.cfg.resync != nil {
			if err := m.cfg.resync(subCtx); err != nil {
				m.cfg.logger.WithError(err).Warn("resync after re-subscription failed")
			}
		}
		delivered, err := m.consume(subCtx, &subscription{ch: ch, errs: errs})
		cancelSub()
		if runCtx.Err() != nil {
			break
		}
		if delivered {
			delay = m.cfg.resubInitial
		}
		if err == nil {
			err = ErrStreamClosed
		}
		m.cfg.logger.WithError(err).WithField("delay", delay).Warn("event stream broke; re-subscribing")
		select {
		case <-runCtx.Done():
		case <-m.cfg.clock.After(delay):
		}
		if runCtx.Err() != nil {
			break
		}
		m.mu.Lock()
		m.stats.Resubscribed++
		m.mu.Unlock()
		delay = nextDelay(delay, m.cfg.resubMax)
	}
	if ctx.Err() == nil {
		return ErrStopped
	}
	return nil
}

// consume reads one subscription until it breaks or ctx ends. It reports
// whether any envelope arrived, and the stream's error (nil when ctx ended
// or errs was closed without one).
func (m *Monitor) consume(ctx context.Context, sub *subscription) (delivered bool, err error) {
	defer context.AfterFunc(ctx, func() { // free intake waiting for room
		m.mu.Lock()
		m.progress.Broadcast()
		m.mu.Unlock()
	})()
	for {
		select {
		case <-ctx.Done():
			return delivered, nil
		case env, ok := <-sub.ch:
			if !ok {
				// A subscriber may send its error and close both channels
				// at once: report the error, not just the closing.
				select {
				case err := <-sub.errs:
					if err != nil {
						return delivered, err
					}
				default:
				}
				return delivered, ErrStreamClosed
			}
			delivered = true
			m.intakeEnvelope(ctx, env)
		case err, ok := <-sub.errs:
			if !ok {
				return delivered, nil
			}
			if err != nil {
				return delivered, err
			}
		}
	}
}

var errNilEnvelope = fmt.Errorf("%w: nil envelope", ErrInvalidEvent)

// intakeEnvelope filters, converts and accepts one envelope, waiting while
// the intake limit is reached. What cannot be accepted goes to the drop
// handler with the reason.
func (m *Monitor) intakeEnvelope(ctx context.Context, env *Envelope) {
	var key string
	var event any
	err := errNilEnvelope
	if env != nil {
		if m.cfg.namespace != "" && env.Namespace != m.cfg.namespace {
			m.mu.Lock()
			m.stats.Received++
			m.stats.Filtered++
			m.mu.Unlock()
			return
		}
		key, event, err = m.convert(env.Event)
	}
	m.mu.Lock()
	if err == nil {
		it := item{event: event, trail: &trail{topic: env.Topic, namespace: env.Namespace}}
		for m.state == stateRunning && ctx.Err() == nil && m.queued-m.eventsInBackoff >= m.cfg.intakeLimit {
			m.waitProgress()
		}
		var k *keyState
		if k, err = m.accept(key, it); err == nil {
			m.schedule(k)
			m.mu.Unlock()
			return
		}
	}
	d := m.refuseLocked(key, event, err)
	m.mu.Unlock()
	if env != nil {
		m.cfg.logger.WithFields(log.Fields{"topic": env.Topic, "namespace": env.Namespace, "key": key}).
			WithError(err).Debug("envelope dropped")
	}
	m.emit(d)
}

// convert runs the converter, turning a panic (say, in a key function) into
// ErrInvalidEvent.
func (m *Monitor) convert(payload typeurl.Any) (key string, event any, err error) {
	defer func() {
		if r := recover(); r != nil {
			key, event, err = "", nil, fmt.Errorf("%w: converter panicked: %v", ErrInvalidEvent, r)
		}
	}()
	if payload == nil {
		return "", nil, fmt.Errorf("%w: nil payload", ErrInvalidEvent)
	}
	key, event, err = m.cfg.converter.Convert(payload)
	if err == nil && event == nil {
		err = errors.New("converter returned a nil event")
	}
	return key, event, err
}
