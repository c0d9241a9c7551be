package eventmonitor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
)

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

// reader is where the one stream reader, a Run or a Start, is.
type reader uint8

const (
	noReader  reader = iota
	reserved         // subscribing, resyncing or waiting to re-subscribe
	consuming        // reading a subscription: Shutdown waits for it to see intake end
)

// streamState is the stream reader's place, and what Subscribe opened for
// Start. Monitor.mu guards it.
type streamState struct {
	reader     reader
	subscribed *subscription // by Subscribe, for Start
	hadOne     bool          // a stream was read or established: Run's next is a re-subscription
}

// subscription is one stream opened on a Subscriber.
type subscription struct {
	ch     <-chan *Envelope
	errs   <-chan error
	cancel context.CancelFunc
}

var errStreamClosed = errors.New("eventmonitor: event stream closed")

// Subscribe opens a stream on s for Start to read, as containerd's CRI
// monitor does; it ends with Stop or Shutdown. Subscribing again before
// Start ends the earlier stream.
func (m *Monitor) Subscribe(s Subscriber, filters ...string) {
	ctx, cancel := context.WithCancel(m.intake)
	ch, errs := s.Subscribe(ctx, filters...)
	m.mu.Lock()
	previous := m.stream.subscribed
	m.stream.subscribed = &subscription{ch: ch, errs: errs, cancel: cancel}
	m.mu.Unlock()
	if previous != nil {
		previous.cancel()
	}
}

// Start reads the stream Subscribe opened. Its channel delivers the stream's
// error if it breaks, then closes; Stop or Shutdown close it with no error.
// Without Subscribe, Start reads nothing: its channel closes when Stop is
// done. Either way Start ends WithDeferredStart's hold.
func (m *Monitor) Start() <-chan error {
	m.mu.Lock()
	sub := m.stream.subscribed
	m.stream.subscribed = nil
	if sub == nil {
		m.releaseHold()
		m.mu.Unlock()
		return m.lifetime
	}
	err := m.beginReading(consuming)
	if err == nil {
		m.stream.hadOne = true
	}
	m.mu.Unlock()
	errCh := make(chan error, 1)
	if err != nil {
		if errors.Is(err, ErrStopped) {
			m.drain(m.intake, sub.ch) // delivered before Stop: dropped, not lost
		}
		sub.cancel()
		errCh <- err
		close(errCh)
		return errCh
	}
	go func() {
		defer m.endReading() // last: Stop returns once errCh is closed
		defer close(errCh)
		_, err := m.consume(m.intake, sub, nil)
		sub.cancel()
		if err != nil && !m.intakeEnded() {
			m.cfg.logger.WithError(err).Error("event stream failed")
			errCh <- err
		}
	}()
	return errCh
}

// beginReading takes the one stream reader's place, for a Run (reserved)
// or a Start (consuming). mu is held.
func (m *Monitor) beginReading(r reader) error {
	switch {
	case m.intakeEnded():
		return ErrStopped
	case m.cfg.converter == nil:
		return fmt.Errorf("%w: reading a stream needs WithConverter", ErrInvalidOption)
	case m.stream.reader != noReader:
		return ErrAlreadyRunning
	}
	m.stream.reader = r
	m.work.Add(1)
	m.releaseHold()
	return nil
}

// endReading frees the reader's place.
func (m *Monitor) endReading() {
	m.setReader(noReader)
	m.work.Done()
}

// Run subscribes to s and handles its events until ctx ends. When the
// stream breaks it re-subscribes after a backoff (WithResubscribe); each
// subscription, once established, calls the WithResync hook. Run returns
// nil when ctx ends, and ErrStopped once Shutdown or Stop is called;
// returning does not stop the monitor.
func (m *Monitor) Run(ctx context.Context, s Subscriber, filters ...string) error {
	m.mu.Lock()
	err := m.beginReading(reserved)
	m.mu.Unlock()
	if err != nil {
		return err
	}
	defer m.endReading()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(m.intake, cancel)()
	delay := m.cfg.resubInitial
	for {
		established, err := m.runOnce(ctx, s, filters)
		if ctx.Err() != nil {
			break
		}
		if established {
			delay = m.cfg.resubInitial
			m.cfg.logger.WithError(err).WithField("delay", delay).Warn("event stream broke; re-subscribing")
		} else {
			m.cfg.logger.WithError(err).WithField("delay", delay).Debug("re-subscribing failed; trying again")
		}
		wait := m.cfg.clock.NewTimer(delay) // not After: a fake clock would keep its waiter after ctx ends
		select {
		case <-ctx.Done():
		case <-wait.C():
		}
		wait.Stop()
		if ctx.Err() != nil {
			break
		}
		delay = doubled(delay, m.cfg.resubMax)
	}
	if m.intakeEnded() {
		return ErrStopped
	}
	return nil
}

// runOnce reads one subscription until it breaks or ctx ends. It is
// established once it delivers an envelope or is not refused within the
// initial resubscribe delay; then the resync hook runs beside the reading,
// and runOnce waits for it.
func (m *Monitor) runOnce(ctx context.Context, s Subscriber, filters []string) (established bool, err error) {
	m.mu.Lock()
	open := !m.intakeEnded()
	if open {
		m.stream.reader = consuming // from the subscription on: Shutdown waits for what it delivers
	}
	m.mu.Unlock()
	if !open {
		return false, nil
	}
	defer m.setReader(reserved)
	ctx, cancel := context.WithCancel(ctx)
	var hook sync.WaitGroup
	defer func() { cancel(); hook.Wait() }()
	ch, errs := s.Subscribe(ctx, filters...)
	first := make(chan struct{}) // closed by consume at the first envelope
	hooked := false
	hook.Add(1)
	go func() {
		defer hook.Done()
		if hooked = m.established(ctx, first); hooked {
			m.counted()
			if fn := m.cfg.resync; fn != nil {
				if err := fn(ctx); err != nil && ctx.Err() == nil {
					m.cfg.logger.WithError(err).Warn("resync after subscribing failed")
				}
			}
		}
	}()
	delivered, err := m.consume(ctx, &subscription{ch: ch, errs: errs, cancel: cancel}, first)
	cancel()
	hook.Wait()
	if delivered && !hooked { // it broke before the hook saw it: no resync against a broken stream
		m.counted()
	}
	return hooked || delivered, err
}

// established waits until the subscription delivered (first closes) or was
// not refused within the initial resubscribe delay.
func (m *Monitor) established(ctx context.Context, first <-chan struct{}) bool {
	timer := m.cfg.clock.NewTimer(m.cfg.resubInitial)
	defer timer.Stop() // an idle monitor holds no timer
	select {
	case <-first:
		return true
	case <-ctx.Done():
		return false
	case <-timer.C():
		return ctx.Err() == nil
	}
}

// counted counts an established subscription that follows another.
func (m *Monitor) counted() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.stream.hadOne {
		m.stats.Resubscribed++
	}
	m.stream.hadOne = true
}

// consume reads sub until it breaks or ctx ends, then takes what sub had
// already delivered, so that nothing delivered is lost: queued while intake
// is open or Shutdown drains, dropped after Stop. It closes first at the
// first envelope it reads.
func (m *Monitor) consume(ctx context.Context, sub *subscription, first chan struct{}) (delivered bool, err error) {
	defer func() { delivered = m.drain(ctx, sub.ch) || delivered }()
	defer context.AfterFunc(ctx, m.wakeWaiters)() // an envelope waiting for room is taken at once
	for {
		select {
		case <-ctx.Done():
			return delivered, nil
		case env, ok := <-sub.ch:
			if !ok {
				select { // a subscriber may send its error and close both channels at once
				case err := <-sub.errs:
					return delivered, cmp.Or(err, errStreamClosed)
				default:
					return delivered, errStreamClosed
				}
			}
			if !delivered && first != nil {
				close(first)
			}
			delivered = true
			m.ingest(ctx, env)
		case err, ok := <-sub.errs:
			if !ok || err != nil {
				return delivered, cmp.Or(err, errStreamClosed)
			}
		}
	}
}

// drain ingests what ch holds, without waiting for more nor taking what a
// subscriber that ignores its ctx goes on sending, reporting whether it
// held any.
func (m *Monitor) drain(ctx context.Context, ch <-chan *Envelope) (took bool) {
	for n := len(ch); n > 0; n-- {
		select {
		case env, ok := <-ch:
			if !ok {
				return took
			}
			took = true
			m.ingest(ctx, env)
		default:
			return took
		}
	}
	return took
}

func (m *Monitor) setReader(r reader) {
	m.mu.Lock()
	m.stream.reader = r
	m.changed()
	m.mu.Unlock()
}
