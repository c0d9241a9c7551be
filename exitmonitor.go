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

// WatchExit waits in its own goroutine for the exit on exitCh and hands m
// the event that event(code, exitedAt) builds, under key: at once on that
// goroutine if the key is idle, else behind the key's queue. If Result
// fails, or exitCh closes empty, code is UnknownExitCode and exitedAt the
// monitor clock's now. The channel closes once the exit was handled,
// queued or dropped, or ctx ended.
func WatchExit[S ExitStatus](ctx context.Context, m *Monitor, key string, exitCh <-chan S,
	event func(code uint32, exitedAt time.Time) any) <-chan struct{} {
	if ctx == nil || m == nil || exitCh == nil || event == nil {
		panic("eventmonitor: WatchExit with a nil ctx, monitor, channel or builder")
	}
	done := make(chan struct{})
	m.mu.Lock()
	if m.state == stopped {
		m.mu.Unlock()
		close(done)
		return done
	}
	m.work.Add(1)
	m.mu.Unlock()
	go func() {
		defer close(done)
		if c := awaitExit(ctx, m, key, exitCh, event); c != nil {
			m.handle(c) // on this goroutine, holding no worker slot
		}
	}()
	return done
}

// awaitExit waits for the exit, ctx or Stop, and queues the exit's event,
// returning a call to make at once if its key was idle. An exit already
// waiting as Stop begins is taken, so that it is dropped rather than lost.
func awaitExit[S ExitStatus](ctx context.Context, m *Monitor, key string, exitCh <-chan S,
	build func(uint32, time.Time) any) *call {
	defer m.work.Done() // before the call, which counts itself
	var s S
	var received bool
	if ctx.Err() != nil {
		return nil // none is taken once ctx has ended
	}
	select {
	case <-ctx.Done():
		return nil
	case s, received = <-exitCh:
	case <-m.stopping:
		select {
		case s, received = <-exitCh:
		default:
			return nil
		}
	}
	if !received && ctx.Err() != nil {
		return nil // closed empty as the watch was cancelled (WaitExit's does): no exit
	}
	var status ExitStatus
	if received {
		status = s
	}
	return m.queueExit(key, status, build)
}

// queueExit reads s (nil: no status came), builds the exit's event and
// accepts it, never refusing it for WithMaxQueuedPerKey.
func (m *Monitor) queueExit(key string, s ExitStatus, build func(uint32, time.Time) any) *call {
	code, at := m.exitStatus(key, s)
	var it item
	err := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("%w: exit event builder panicked: %v", ErrInvalidEvent, r)
			}
		}()
		it.event = build(code, at)
		return nil
	}()
	m.mu.Lock()
	if err == nil {
		err = m.accept(key, it, fromExit)
	}
	var drops []Drop
	var c *call
	if err != nil {
		drops = m.refuse(key, it, err)
	} else if k := m.keys.byName[key]; m.state == running {
		if it, ok := m.keys.takeAlone(k); ok {
			c = m.startCall(k, it, noSlot, nil)
		}
	}
	m.changed()
	m.mu.Unlock()
	m.handOver(drops)
	return c
}

// exitStatus reads s, falling back to UnknownExitCode at the clock's now
// when there is no status or Result fails.
func (m *Monitor) exitStatus(key string, s ExitStatus) (code uint32, at time.Time) {
	err := errors.New("exit channel closed without a status")
	if s != nil {
		code, at, err = s.Result()
	}
	if err != nil {
		m.cfg.logger.WithField("key", key).WithError(err).Warn("cannot read exit status; exit code unknown")
		return UnknownExitCode, m.cfg.clock.Now()
	}
	return code, at
}
