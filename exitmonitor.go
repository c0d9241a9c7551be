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
// then not handled), or when Stop begins. An exit that arrives once
// Shutdown began, or is in exitCh when Stop begins, goes to the drop
// handler with ErrStopped.
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
	if m.state == stopped {
		m.mu.Unlock()
		close(done)
		return done
	}
	m.watchers.Add(1)
	m.mu.Unlock()
	go func() {
		defer close(done)
		var s S
		var received bool
		select {
		case <-ctx.Done():
			m.watchers.Done()
			return
		case s, received = <-exitCh:
		case <-m.stopping:
			select { // an exit already there is accounted for: dropped, not lost
			case s, received = <-exitCh:
			default:
				m.watchers.Done()
				return
			}
		}
		code, at, err := m.exitResult(key, s, received)
		m.handleExit(key, func() any { return event(code, at, err) })
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

// handleExit accepts the exit event build makes and, when its key is idle,
// handles it at once on the watcher's goroutine, through the same call path
// as a worker's but holding no worker slot. Otherwise the exit waits its
// turn behind the key's other events. The watcher stops counting for Stop
// before it makes the call: Stop waits for calls, and abandons stuck ones.
func (m *Monitor) handleExit(key string, build func() any) {
	var event any
	err := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("%w: exit event builder panicked: %v", ErrInvalidEvent, r)
			}
		}()
		event = build()
		return nil
	}()
	m.mu.Lock()
	var k *keyq.Key[item]
	if err == nil {
		k, err = m.accept(key, item{event: event}, false)
	}
	if err != nil {
		d := m.refuse(key, event, err)
		m.mu.Unlock()
		m.emit(d)
		m.watchers.Done()
		return
	}
	var c *call
	if m.state == running {
		if it, ok := m.keys.TakeAlone(k); ok {
			c = m.startCall(k, it, false, false)
		}
	}
	m.changed()
	m.mu.Unlock()
	m.watchers.Done()
	if c != nil {
		m.handle(c) // holds no slot: takes nothing on
	}
}
