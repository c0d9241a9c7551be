package eventmonitor

import (
	"context"
	"fmt"
	"sync"
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

// streamState is stream intake's part of the monitor, guarded by its mu.
type streamState struct {
	reading     bool            // a Run or Start's reader is reading a stream
	subscribed  *subscription   // by Subscribe, for Start
	lifetime    chan error      // what every bare Start returns; closed by Stop
	accepting   int             // envelopes read and not yet accepted or dropped
	ignoredURLs map[string]bool // type URLs ignored so far, for logging once
}

// subscription is one stream opened on a Subscriber.
type subscription struct {
	ch     <-chan *Envelope
	errs   <-chan error
	cancel context.CancelFunc // ends the stream
}

// Subscribe subscribes to s for Start, as containerd's CRI monitor does. The
// subscription lasts until Stop or Shutdown. A second Subscribe before Start
// replaces the first, whose stream is ended.
func (m *Monitor) Subscribe(s Subscriber, filters ...string) {
	if s == nil {
		panic("eventmonitor: Subscribe with a nil Subscriber")
	}
	ctx, cancel := context.WithCancel(m.intake)
	ch, errs := s.Subscribe(ctx, filters...)
	m.mu.Lock()
	previous := m.stream.subscribed
	m.stream.subscribed = &subscription{ch: ch, errs: errs, cancel: cancel}
	m.mu.Unlock()
	if previous != nil {
		previous.cancel() // never started: nobody would read it
	}
}

// Start reads the stream opened by Subscribe, as containerd's CRI monitor
// does. The returned channel delivers the stream's error, if it breaks, and
// is closed when reading ends (on a stream error, or on Stop or Shutdown).
// The monitor itself goes on after a stream error: Submit, WatchExit and
// backoff replays keep working until Stop.
//
// Without Subscribe, Start reads nothing and its channel stays open until
// Stop, so that it can stand for the monitor's lifetime as containerd's
// podsandbox controller uses it; no converter is needed then.
//
// The channel delivers ErrStopped after Stop or Shutdown began,
// ErrNoConverter for a subscription without WithConverter, and
// ErrAlreadyRunning while a Run or another Start is reading a stream.
func (m *Monitor) Start() <-chan error {
	m.mu.Lock()
	sub := m.stream.subscribed
	m.stream.subscribed = nil
	if sub == nil && (m.state == held || m.state == running) {
		if m.stream.lifetime == nil {
			m.stream.lifetime = make(chan error)
		}
		m.releaseHold()
		lifetime := m.stream.lifetime
		m.mu.Unlock()
		return lifetime
	}
	err := m.beginReading()
	if err == nil {
		m.watchers.Add(1)
	}
	m.mu.Unlock()
	errCh := make(chan error, 1)
	if err != nil {
		if sub != nil {
			sub.cancel()
		}
		errCh <- err
		close(errCh)
		return errCh
	}
	go func() {
		defer m.watchers.Done()
		defer close(errCh)
		_, err := m.consume(m.intake, sub, nil)
		sub.cancel()
		m.doneReading() // before reporting: whoever reads errCh may Run or Start at once
		if err != nil && m.intake.Err() == nil {
			m.cfg.logger.WithError(err).Error("event stream failed")
			errCh <- err
		}
	}()
	return errCh
}

// beginReading takes the one stream reader's place, for a Run or Start.
// mu is held.
func (m *Monitor) beginReading() error {
	switch {
	case m.state == draining || m.state == stopped:
		return ErrStopped
	case m.cfg.converter == nil:
		return ErrNoConverter
	case m.stream.reading:
		return ErrAlreadyRunning
	}
	m.stream.reading = true
	m.releaseHold()
	return nil
}

// doneReading lets another Run or Start read a stream.
func (m *Monitor) doneReading() {
	m.mu.Lock()
	m.stream.reading = false
	m.mu.Unlock()
}

// Run subscribes to s and handles its events until ctx ends. When the stream
// breaks it re-subscribes after a backoff (WithResubscribe), reset once a
// subscription delivers an event, and calls the WithResync hook once the
// new subscription is established, so that what the broken stream missed
// can be relisted.
//
// One stream is read at a time: while a Run or Start's reader is reading,
// Run returns ErrAlreadyRunning at once. Run may be called again after it
// returned. It returns nil when ctx ends, ErrStopped if the monitor stops
// first. Run returning does not stop the monitor: call Shutdown or Stop.
func (m *Monitor) Run(ctx context.Context, s Subscriber, filters ...string) error {
	if s == nil {
		return fmt.Errorf("%w: Run needs a subscriber", ErrInvalidOption)
	}
	m.mu.Lock()
	err := m.beginReading()
	m.mu.Unlock()
	if err != nil {
		return err
	}
	defer m.doneReading()

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(m.intake, cancel)()

	delay := m.cfg.resubInitial
	for outage := false; ; outage = true {
		delivered, err := m.runOnce(runCtx, s, filters, outage)
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
		if delay = 2 * delay; delay > m.cfg.resubMax || delay <= 0 { // <= 0: overflow
			delay = m.cfg.resubMax
		}
	}
	if ctx.Err() == nil {
		return ErrStopped
	}
	return nil
}

// runOnce reads one subscription of Run's until it breaks or ctx ends. After
// an outage (resync set) the resync hook runs once the subscription is
// established, beside the reading, and runOnce waits for it to return.
//
// A subscription counts as established when it delivers an envelope or
// stays unrefused for the initial resubscribe delay: a daemon that is still
// down refuses at once, and relisting against it would be wasted.
func (m *Monitor) runOnce(ctx context.Context, s Subscriber, filters []string, resync bool) (delivered bool, err error) {
	subCtx, cancelSub := context.WithCancel(ctx)
	defer cancelSub()
	ch, errs := s.Subscribe(subCtx, filters...)
	var established func()
	var resyncs sync.WaitGroup
	if hook := m.cfg.resync; resync && hook != nil {
		established = func() {
			resyncs.Add(1)
			go func() {
				defer resyncs.Done()
				if err := hook(subCtx); err != nil && subCtx.Err() == nil {
					m.cfg.logger.WithError(err).Warn("resync after re-subscription failed")
				}
			}()
		}
	}
	delivered, err = m.consume(subCtx, &subscription{ch: ch, errs: errs, cancel: cancelSub}, established)
	cancelSub()
	resyncs.Wait()
	return delivered, err
}

// consume reads one subscription until it breaks or ctx ends. It reports
// whether any envelope arrived, and the stream's error (nil when ctx ended
// or errs was closed without one). established, if not nil, is called once
// the subscription is established (see runOnce).
func (m *Monitor) consume(ctx context.Context, sub *subscription, established func()) (delivered bool, err error) {
	defer context.AfterFunc(ctx, m.wakeWaiters)() // intake waiting for room gives up
	var settled <-chan time.Time
	if established != nil {
		timer := m.cfg.clock.NewTimer(m.cfg.resubInitial)
		defer timer.Stop()
		settled = timer.C()
	}
	establish := func() {
		if established != nil {
			established()
			established, settled = nil, nil
		}
	}
	for {
		select {
		case <-ctx.Done():
			return delivered, nil
		case <-settled:
			establish()
		case env, ok := <-sub.ch:
			if !ok {
				return delivered, sub.closedErr()
			}
			delivered = true
			establish()
			m.take(ctx, env)
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
