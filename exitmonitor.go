package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// ExitStatus is a process's exit as a runtime reports it; containerd's
// ExitStatus satisfies it, so WatchExit takes containerd's exit channel as it is.
type ExitStatus interface {
	Result() (code uint32, exitedAt time.Time, err error)
}

// UnknownExitCode is the code reported when the exit status cannot be read.
const UnknownExitCode = 255

// WatchExit waits in its own goroutine for the exit on exitCh and hands m,
// under key, the event built by event(code, exitedAt): with UnknownExitCode
// and the monitor clock's now if Result fails or exitCh closes empty. The exit
// needs no worker: on an idle key it is handled at once in the watcher's
// goroutine, with the handle timeout; on a busy key (a call in progress,
// events queued, or backoff), or in a held monitor (WithDeferredStart), it
// joins the tail of the key's queue, so it never runs beside another call
// for the key nor ahead of events accepted before it (an envelope the
// stream reader holds at WithIntakeLimit is not accepted yet). A failure
// backs it off like any event.
//
// The returned channel is closed once the exit was queued, or refused and
// its drop handed over, or handled in the watcher's goroutine and its
// outcome reported; once ctx ended (an exit waiting as it ends may still be
// taken, and handled) or Stop began while it waited. An exit handled in the
// watcher's goroutine that Stop abandons closes it when its handler
// returns (so does containerd's stopCh). An exit not yet queued when
// Shutdown is called (arriving later, or still being read or built) is
// dropped with ErrStopped, as is one a watcher reads once Stop began; a
// watcher that saw Stop begin reads no more, so an exit sent then may stay
// in exitCh (a WatchExit after Stop returns a closed channel). A nil ctx,
// m, exitCh or event panics at once, not in the goroutine.
func WatchExit[S ExitStatus](ctx context.Context, m *Monitor, key string, exitCh <-chan S,
	event func(code uint32, exitedAt time.Time) any) <-chan struct{} {
	mustWatch(ctx, "WatchExit", m, exitCh == nil, event == nil)
	return WatchExitResult(ctx, m, key, exitCh, func(code uint32, exitedAt time.Time, _ error) any {
		return event(code, exitedAt)
	})
}

// WatchExitResult is WatchExit with a builder that also sees why the status
// could not be read: err is nil for a real status, otherwise Result's error,
// one saying Result panicked, or ErrNoExitStatus (with code UnknownExitCode
// and exitedAt the clock's now).
func WatchExitResult[S ExitStatus](ctx context.Context, m *Monitor, key string, exitCh <-chan S,
	event func(code uint32, exitedAt time.Time, err error) any) <-chan struct{} {
	mustWatch(ctx, "WatchExitResult", m, exitCh == nil, event == nil)
	done := make(chan struct{})
	m.mu.Lock()
	if m.state == stopped {
		m.mu.Unlock()
		close(done)
		return done
	}
	m.watchers.Add(1)
	m.mu.Unlock()
	go func() {
		defer close(done)
		c := func() *call {
			// Done before the call, which Stop waits for itself (and abandons
			// if stuck); deferred, in case a callback ends the goroutine.
			defer m.watchers.Done()
			s, received, arrived := waitExit(ctx, exitCh, m.stopping)
			if !arrived {
				return nil
			}
			return m.queueExit(key, s, received, event)
		}()
		if c != nil {
			m.handle(c) // holds no slot: takes nothing on
		}
	}()
	return done
}

// waitExit waits for exitCh (arrived: a value, or its close), ctx or
// stopping. An exit already waiting as Stop begins is taken, so that it is
// dropped rather than lost; none is taken once ctx has ended.
func waitExit[S any](ctx context.Context, exitCh <-chan S, stopping <-chan struct{}) (s S, received, arrived bool) {
	if ctx.Err() != nil {
		return s, false, false
	}
	select {
	case <-ctx.Done():
		return s, false, false
	case s, received = <-exitCh:
		return s, received, true
	case <-stopping:
		select {
		case s, received = <-exitCh:
			return s, received, true
		default:
			return s, false, false
		}
	}
}

func mustWatch(ctx context.Context, caller string, m *Monitor, noChannel, noBuilder bool) {
	switch {
	case ctx == nil:
		panic("eventmonitor: " + caller + " with a nil ctx")
	case m == nil:
		panic("eventmonitor: " + caller + " with a nil Monitor")
	case noChannel:
		panic("eventmonitor: " + caller + " with a nil exit channel")
	case noBuilder:
		panic("eventmonitor: " + caller + " with a nil event builder")
	}
}

// ErrNoExitStatus is WatchExitResult's error for an exit channel closed
// without a value.
var ErrNoExitStatus = errors.New("eventmonitor: exit channel closed without a status")

var (
	errExitStatusPanic  = errors.New("reading the exit status panicked")
	errExitBuilderPanic = fmt.Errorf("%w: exit event builder panicked", ErrInvalidEvent)
)

// buildExit reads s and builds its event, turning a panic in either into
// an error.
func (m *Monitor) buildExit(key string, s ExitStatus, received bool, build func(uint32, time.Time, error) any) (event any, err error) {
	code, at, statusErr := uint32(UnknownExitCode), time.Time{}, error(ErrNoExitStatus)
	if received {
		statusErr = errOnPanic(errExitStatusPanic, func() (err error) { // a nil status panics, for one
			code, at, err = s.Result()
			return checked(err)
		})
	}
	if statusErr != nil {
		m.cfg.logger.WithField("key", key).WithError(statusErr).Warn("cannot read exit status; exit code unknown")
		code, at = UnknownExitCode, m.cfg.clock.Now()
	}
	err = errOnPanic(errExitBuilderPanic, func() error { event = build(code, at, statusErr); return nil })
	return event, err
}

// queueExit reads s (received: exitCh was not closed empty) and accepts
// the event build makes. On an idle key it returns a call for the watcher
// to make at once, through a worker's call path but holding no slot.
func (m *Monitor) queueExit(key string, s ExitStatus, received bool, build func(uint32, time.Time, error) any) *call {
	m.beginAccepting()
	defer m.endAccepting()
	event, err := m.buildExit(key, s, received, build)
	it := item{event: event}
	m.mu.Lock()
	var k *keyq.Key[item]
	if err == nil {
		k, err = m.accept(key, it, submitted)
	}
	var c *call
	var drops []Drop
	if err != nil {
		drops = m.refuse(key, it, err)
	} else if m.state.handles() { // accepted, so not draining: running
		if it, ok := m.keys.TakeAlone(k); ok {
			c = m.startCall(k, it, false, noSlot)
		}
	}
	m.reconcile()
	m.mu.Unlock()
	m.emit(drops...)
	return c
}
