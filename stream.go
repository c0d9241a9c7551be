package eventmonitor

import (
	"context"
	"fmt"
	"time"

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
	in := m.newIntake()
	for {
		select {
		case <-ctx.Done():
			return delivered, nil
		case env, ok := <-sub.ch:
			if !ok {
				return delivered, sub.closedErr()
			}
			delivered = true
			in.add(env)
			open := in.fill(sub.ch)
			in.flush(ctx)
			if !open {
				return delivered, sub.closedErr()
			}
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

// closedErr is the error of a stream whose envelope channel closed. A
// subscriber may send its error and close both channels at once: report the
// error, not just the closing.
func (s *subscription) closedErr() error {
	select {
	case err := <-s.errs:
		if err != nil {
			return err
		}
	default:
	}
	return ErrStreamClosed
}
