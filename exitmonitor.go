package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ExitStatus is a process's exit as a runtime reports it; containerd's
// ExitStatus satisfies it, so WatchExit takes containerd's exit channel as it is.
type ExitStatus interface {
	Result() (code uint32, exitedAt time.Time, err error)
}

// UnknownExitCode is the code reported when the exit status cannot be read.
const UnknownExitCode = 255

// WatchExit waits in its own goroutine for the exit on exitCh, builds its
// event with event(code, exitedAt) and hands it to m under key.
//
// The exit does not wait for a worker: when the key is idle it is handled at
// once in the watcher's goroutine, with the handle timeout. When the key is
// busy (a call in progress, events queued, or backoff) the exit joins the
// tail of the key's queue, so it is never handled beside another call for
// the key nor ahead of earlier events. A failure sends it to the key's
// backoff queue like any event.
//
// If Result fails, or exitCh is closed without a value, the exit is reported
// with UnknownExitCode at the monitor clock's now. The returned channel is
// closed when the exit was handled or queued, when ctx ends (the exit is
// then not handled), or when the monitor stops. An exit that arrives as the
// monitor stops goes to the drop handler with ErrStopped.
//
// A nil m, exitCh or event is a programming error: WatchExit panics at once
// rather than in its goroutine or never.
func WatchExit[S ExitStatus](ctx context.Context, m *Monitor, key string, exitCh <-chan S,
	event func(code uint32, exitedAt time.Time) any) <-chan struct{} {
	if event == nil {
		panic("eventmonitor: WatchExit with a nil event builder")
	}
	return WatchExitResult(ctx, m, key, exitCh, func(code uint32, exitedAt time.Time, _ error) any {
		return event(code, exitedAt)
	})
}

// WatchExitResult is WatchExit with a builder that also sees why the status
// could not be read: err is nil for a real status, and otherwise Result's
// error (or one saying exitCh closed without a value), with code
// UnknownExitCode and exitedAt the monitor clock's now.
func WatchExitResult[S ExitStatus](ctx context.Context, m *Monitor, key string, exitCh <-chan S,
	event func(code uint32, exitedAt time.Time, err error) any) <-chan struct{} {
	switch {
	case m == nil:
		panic("eventmonitor: WatchExit with a nil Monitor")
	case exitCh == nil:
		panic("eventmonitor: WatchExit with a nil exit channel")
	case event == nil:
		panic("eventmonitor: WatchExit with a nil event builder")
	}
	done := make(chan struct{})
	m.mu.Lock()
	if m.state == stateStopped {
		m.mu.Unlock()
		close(done)
		return done
	}
	m.goroutines.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.goroutines.Done()
		defer close(done)
		var code uint32
		var at time.Time
		var err error
		select {
		case <-ctx.Done():
			return
		case <-m.intake.Done():
			return
		case s, ok := <-exitCh:
			code, at, err = m.exitResult(key, s, ok)
		}
		m.handleExit(key, func(code uint32, at time.Time) any { return event(code, at, err) }, code, at)
	}()
	return done
}

// ErrNoExitStatus: an exit channel closed without a value.
var ErrNoExitStatus = errors.New("eventmonitor: exit channel closed without a status")

func (m *Monitor) exitResult(key string, s ExitStatus, received bool) (code uint32, at time.Time, err error) {
	if !received {
		m.cfg.logger.WithField("key", key).Warn("exit channel closed without a status; exit code unknown")
		return UnknownExitCode, m.cfg.clock.Now(), ErrNoExitStatus
	}
	func() {
		defer func() {
			if r := recover(); r != nil { // a nil status, for one
				err = fmt.Errorf("reading the exit status panicked: %v", r)
			}
		}()
		code, at, err = s.Result()
	}()
	if err != nil {
		m.cfg.logger.WithField("key", key).WithError(err).Warn("cannot read exit status; exit code unknown")
		return UnknownExitCode, m.cfg.clock.Now(), err
	}
	return code, at, nil
}

func (m *Monitor) handleExit(key string, build func(uint32, time.Time) any, code uint32, at time.Time) {
	var event any
	err := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("%w: exit event builder panicked: %v", ErrInvalidEvent, r)
			}
		}()
		event = build(code, at)
		return nil
	}()
	m.mu.Lock()
	var k *keyState
	if err == nil {
		k, err = m.accept(key, item{event: event})
	}
	if err != nil {
		d := m.refuseLocked(key, event, err)
		m.mu.Unlock()
		m.emit(d)
		return
	}
	defer m.mu.Unlock()
	if m.held || k.running != nil || k.ready || k.inBackoff() || k.queue.len() > 1 {
		m.schedule(k)
		return
	}
	m.busy++
	m.holding++
	if _, fate := m.handleNext(k, m.callStart(), exitCaller()); fate != callAbandoned {
		m.handBack(k)
		m.leave()
	}
}

// exitCaller is the caller of an exit handled on its watcher's goroutine:
// one call, so one context rather than a worker's slab of them.
func exitCaller() *caller {
	return &caller{contexts: contextSlab{free: make([]handlerContext, 1)}}
}
