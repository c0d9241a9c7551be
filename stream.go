package eventmonitor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// streamState is stream intake's part of the monitor, guarded by its mu.
type streamState struct {
	reader      reader
	subscribed  *subscription   // by Subscribe, for Start
	ignoredURLs logOnce[string] // type URLs the converter has no key for (under a lock of its own)
	read        bool            // a Run or Start has read a stream: a later Run's first subscription follows an outage
}

// reader is where the one stream reader, a Run or a Start with a
// subscription, is.
type reader uint8

const (
	noReader  reader = iota
	reserved         // subscribing, resyncing or waiting to re-subscribe: takes nothing
	consuming        // in consume: Shutdown waits for it to see intake end
)

// subscription is one stream opened on a Subscriber.
type subscription struct {
	ch     <-chan *Envelope
	errs   <-chan error
	cancel context.CancelFunc
}

// Subscribe subscribes to s for Start, as containerd's CRI monitor does, until
// Stop or Shutdown. Subscribing again before Start ends the earlier stream.
// Without WithConverter it opens no stream, which nothing could read:
// Start reports ErrNoConverter.
func (m *Monitor) Subscribe(s Subscriber, filters ...string) {
	if isNil(s) {
		panic("eventmonitor: Subscribe with a nil Subscriber")
	}
	sub := &subscription{cancel: func() {}}
	if m.cfg.converter != nil {
		ctx, cancel := context.WithCancel(m.intake)
		sub.ch, sub.errs = s.Subscribe(ctx, filters...)
		sub.cancel = cancel
	}
	m.mu.Lock()
	previous := m.stream.subscribed
	m.stream.subscribed = sub
	m.mu.Unlock()
	if previous != nil {
		previous.cancel() // never started: nobody would read it
	}
}

// Start reads the stream opened by Subscribe, as containerd's CRI monitor
// does. Its channel delivers the stream's error if it breaks (wrapping
// ErrStreamClosed if a callback on the reader, such as the converter or
// drop handler, ends its goroutine), and is closed when reading ends; a
// Stop or Shutdown closes it with no error. A Start called once they were
// gets ErrStopped; without WithConverter, ErrNoConverter; while a Run or
// another Start reads a stream, ErrAlreadyRunning. A Start that fails
// leaves the subscription for the next. After a stream error, Submit,
// WatchExit and replays go on until Stop.
//
// Without Subscribe, Start reads nothing and needs no converter: its channel
// stays open until Stop, standing for the monitor's lifetime as containerd's
// podsandbox controller uses it.
func (m *Monitor) Start() <-chan error {
	m.mu.Lock()
	sub := m.stream.subscribed
	if sub == nil && !m.intakeEnded() { // else refused: Shutdown or Stop was called
		defer m.mu.Unlock()
		m.releaseHold()
		return m.lifetime
	}
	_, err := m.beginReading()
	if err == nil {
		m.stream.subscribed = nil
		m.watchers.Add(1)
	}
	m.mu.Unlock()
	errCh := make(chan error, 1)
	if err != nil { // the subscription waits for a Start that can read it, or Stop
		errCh <- err
		close(errCh)
		return errCh
	}
	go func() {
		defer m.watchers.Done()
		defer close(errCh)
		report := func(err error) {
			if err != nil && !m.intakeEnded() {
				errCh <- err
				m.cfg.logger.WithError(err).Error("event stream failed")
			}
		}
		var err error
		onGoexit(func() { err = m.readSubscribed(sub) }, func() { report(errReaderExited) })
		report(err)
	}()
	return errCh
}

var errReaderExited = fmt.Errorf("%w: a callback ended the stream reader's goroutine (runtime.Goexit)", ErrStreamClosed)

// readSubscribed is Start's reading of sub. It frees the reader's place
// before Start reports (whoever reads its channel may Run or Start at once),
// in defers, as a callback may end the goroutine.
func (m *Monitor) readSubscribed(sub *subscription) error {
	defer m.setReader(noReader)
	defer sub.cancel()
	_, err := m.consume(m.intake, sub, nil)
	return err
}

// beginReading takes the one stream reader's place, for a Run or Start,
// reporting whether a stream was read before: what was published since
// went unread, an outage for Run to resync. mu is held.
func (m *Monitor) beginReading() (outage bool, err error) {
	switch {
	case m.intakeEnded(): // Shutdown or Stop was called
		return false, ErrStopped
	case m.cfg.converter == nil:
		return false, ErrNoConverter
	case m.stream.reader != noReader:
		return false, ErrAlreadyRunning
	}
	m.stream.reader = reserved
	outage, m.stream.read = m.stream.read, true
	m.releaseHold()
	return outage, nil
}

// setReader moves the stream reader to r, waking Shutdown waiting for it.
func (m *Monitor) setReader(r reader) {
	m.mu.Lock()
	m.stream.reader = r
	m.reconcile()
	m.mu.Unlock()
}

// Run subscribes to s and handles its events until ctx ends. When the stream
// breaks it re-subscribes after a backoff (WithResubscribe, reset once a
// subscription delivers) and, once the new subscription is established,
// calls the WithResync hook to relist what the broken stream missed.
//
// Run returns ErrAlreadyRunning at once while a Run or Start is reading a
// stream, ErrNoConverter without WithConverter, nil when ctx ends, and
// ErrStopped once Shutdown or Stop is called (Shutdown's drain goes on).
// It may be called again after it returned, or after a Start's stream
// broke: the time between counts as an outage. Returning does not stop
// the monitor: Shutdown or Stop does.
func (m *Monitor) Run(ctx context.Context, s Subscriber, filters ...string) error {
	if isNil(s) {
		return fmt.Errorf("%w: Run needs a subscriber", ErrInvalidOption)
	}
	m.mu.Lock()
	outage, err := m.beginReading()
	m.mu.Unlock()
	if err != nil {
		return err
	}
	defer m.setReader(noReader)

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(m.intake, cancel)()

	ended := func() bool { return runCtx.Err() != nil || m.intakeEnded() } // runCtx ends an instant after intake
	delay := m.cfg.resubInitial
	for ; ; outage = true {
		delivered, err := m.runOnce(runCtx, s, filters, outage)
		if ended() {
			break
		}
		if delivered {
			delay = m.cfg.resubInitial
		}
		m.cfg.logger.WithError(err).WithField("delay", delay).
			Warn("event stream broke; re-subscribing")
		wait := m.cfg.clock.NewTimer(delay) // not After: a fake clock would keep its waiter after ctx ends
		select {
		case <-runCtx.Done():
		case <-wait.C():
		}
		wait.Stop()
		if ended() {
			break
		}
		m.mu.Lock()
		m.stats.Resubscribed++
		m.mu.Unlock()
		delay = keyq.Doubled(delay, m.cfg.resubMax)
	}
	if ctx.Err() == nil {
		return ErrStopped
	}
	return nil
}

// runOnce reads one subscription of Run's until it breaks or ctx ends; after
// an outage, it runs the resync hook beside it once established (see
// WithResync), and waits for the hook.
func (m *Monitor) runOnce(ctx context.Context, s Subscriber, filters []string, outage bool) (delivered bool, err error) {
	subCtx, cancelSub := context.WithCancel(ctx)
	var resyncs sync.WaitGroup
	defer func() { cancelSub(); resyncs.Wait() }() // deferred: user code may end the goroutine
	ch, errs := s.Subscribe(subCtx, filters...)
	var first chan struct{} // closed by consume at the first envelope
	if hook := m.cfg.resync; outage && hook != nil {
		first = make(chan struct{})
		establishedBy := m.cfg.clock.NewTimer(m.cfg.resubInitial) // not refused by then
		resyncs.Add(1)
		go func() {
			defer resyncs.Done()
			select {
			case <-subCtx.Done():
			case <-first:
			case <-establishedBy.C():
			}
			establishedBy.Stop() // an idle monitor holds no timer
			if subCtx.Err() != nil {
				return // refused, or ended: nothing to relist against
			}
			err := errOnPanic(errResyncPanic, func() error { return checked(hook(subCtx)) })
			if err != nil && subCtx.Err() == nil {
				m.cfg.logger.WithError(err).Warn("resync after re-subscription failed")
			}
		}()
	}
	return m.consume(subCtx, &subscription{ch: ch, errs: errs, cancel: cancelSub}, first)
}

var errResyncPanic = errors.New("resync hook panicked")

// consume reads sub until it breaks or ctx ends, reporting whether any
// envelope arrived and the stream's error (ErrStreamClosed if it ended
// without one; nil when ctx ended). A non-nil first is closed at the first
// envelope. It reads only if intake is open as it begins: Shutdown, which
// ends intake, waits for it to end only if it began.
func (m *Monitor) consume(ctx context.Context, sub *subscription, first chan struct{}) (delivered bool, err error) {
	m.mu.Lock()
	open := !m.intakeEnded()
	if open {
		m.stream.reader = consuming
	}
	m.mu.Unlock()
	if !open {
		return false, nil
	}
	defer m.setReader(reserved)
	defer context.AfterFunc(ctx, m.wakeWaiters)() // intake waiting for room gives up
	for {
		select {
		case <-ctx.Done():
			return delivered, nil
		case env, ok := <-sub.ch:
			if !ok {
				select { // a subscriber may send its error and close both channels at once
				case err := <-sub.errs:
					return delivered, checked(cmp.Or(err, ErrStreamClosed))
				default:
					return delivered, ErrStreamClosed
				}
			}
			if !delivered && first != nil {
				close(first)
			}
			delivered = true
			m.ingest(ctx, env)
		case err, ok := <-sub.errs:
			if !ok || err != nil {
				return m.ingestBuffered(ctx, sub.ch) || delivered, checked(cmp.Or(err, ErrStreamClosed))
			}
		}
	}
}

// ingestBuffered ingests what the subscriber sent before its error, which may
// wait in a buffered channel still (containerd.NewSubscriber's does), until
// none is ready, reporting whether any was.
func (m *Monitor) ingestBuffered(ctx context.Context, ch <-chan *Envelope) (delivered bool) {
	for ctx.Err() == nil {
		select {
		case env, ok := <-ch:
			if !ok {
				return delivered
			}
			delivered = true
			m.ingest(ctx, env)
		default:
			return delivered
		}
	}
	return delivered
}
