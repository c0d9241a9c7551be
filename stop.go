package eventmonitor

import (
	"context"
	"fmt"
	"slices"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// Stop ends intake, cancels the context of every call in progress and waits
// for those calls to return; a call still running when it overruns (its
// deadline plus a grace, see WithHandleTimeout) is abandoned (its event
// dropped), so Stop returns within about the handle timeout even if a
// handler ignores its context. Then every event not yet handled, queued or
// in backoff, goes to the drop handler with ErrStopped. Stop is idempotent
// and safe to call from several goroutines. It also waits for the reports
// of calls that returned (their log lines and drops): a drop handler or
// logger that blocks holds it up.
//
// Do not call Stop from a handler: it would wait for that very call until
// it overruns, then report its event dropped (with WithHandleTimeout(0), for
// ever). Call go m.Stop() instead.
func (m *Monitor) Stop() {
	m.mu.Lock()
	m.beginStop()
	for m.calls.n > 0 {
		m.abandon(overran)
		if m.calls.n > 0 {
			m.cond.Wait()
		}
	}
	m.mu.Unlock()
	m.stopOnce.Do(m.finishStop)
	<-m.done
}

// beginStop ends intake and cancels every call. mu is held.
func (m *Monitor) beginStop() {
	m.endIntake()
	if m.state == stopped {
		return
	}
	m.state = stopped
	close(m.stopping)
	for c := m.calls.head; c != nil; c = c.next {
		c.cancel(context.Canceled)
	}
	m.changed()
}

// abandon gives up on the calls in a stage from which they may never
// return, at Stop: each event goes to the drop handler, and the call's
// goroutine, when the handler finally returns, leaves without touching the
// monitor. mu is held.
func (m *Monitor) abandon(stages ...stage) {
	for c := m.calls.head; c != nil; {
		next := c.next
		if slices.Contains(stages, c.stage) {
			m.calls.remove(c)
			c.stage = abandoned
			d := m.drop(c.key.Name(), []any{c.it.event},
				fmt.Errorf("%w: handler still running at its deadline, abandoned", ErrStopped))
			d.Topic, d.Namespace = c.it.from()
			m.abandonedDrops = append(m.abandonedDrops, d)
		}
		c = next
	}
	m.changed()
}

// finishStop hands every event left over to the drop handler, once no
// call is left, and ends the goroutines Stop waits for.
func (m *Monitor) finishStop() {
	m.mu.Lock()
	drops := m.abandonedDrops
	m.abandonedDrops = nil
	var names []string
	m.keys.Keys(func(k *keyq.Key[item]) { names = append(names, k.Name()) })
	slices.Sort(names)
	for _, name := range names {
		drops = append(drops, m.dropByOrigin(name, m.keys.Forget(name))...)
	}
	m.changed()
	for m.sched.running {
		m.cond.Wait()
	}
	lifetime := m.stream.lifetime
	m.mu.Unlock()
	m.watchers.Wait()
	for _, d := range drops {
		m.emit(d)
	}
	if lifetime != nil {
		close(lifetime)
	}
	close(m.done)
}

// Shutdown stops intake (Submit returns ErrStopped from now on), handles
// everything queued, replays every backoff queue once at once, then Stops.
// An event that fails during the shutdown, or is still waiting when it
// stops, goes to the drop handler with ErrStopped.
//
// A handler call that overruns its timeout does not hold Shutdown up: once
// no call is within its deadline and nothing else can move (no worker free
// for what is queued), Shutdown stops, abandoning the stuck calls. If ctx
// ends first, Shutdown stops at once, abandoning every call in progress,
// and returns ctx's error. It returns an error wrapping ErrStopped if it
// abandoned calls that overran.
func (m *Monitor) Shutdown(ctx context.Context) error {
	m.endIntake()
	defer context.AfterFunc(ctx, m.wakeWaiters)()
	m.mu.Lock()
	if m.state == held || m.state == running {
		m.state = draining
		m.changed()
	}
	for m.state == draining && ctx.Err() == nil && m.drainable() {
		m.cond.Wait()
	}
	stuck := m.calls.stages[overran]
	_, inBackoff := m.keys.InBackoff()
	drained := m.state == draining && m.calls.n == 0 && m.keys.Queued()+inBackoff == 0
	if ctx.Err() != nil {
		m.beginStop()
		m.abandon(inTime, late, overran)
	}
	m.mu.Unlock()
	m.Stop()
	switch {
	case drained:
		return nil
	case ctx.Err() != nil:
		return fmt.Errorf("eventmonitor: shutdown: %w", ctx.Err())
	case stuck > 0:
		return fmt.Errorf("%w: shutdown abandoned %d handler calls that overran their timeout", ErrStopped, stuck)
	}
	return nil
}

// drainable reports whether a drain can still move: a call within its
// deadline (or being settled) may yet finish, or a ready key has a worker
// slot free. Calls that overran hold their keys, and possibly slots, for
// as long as they like. mu is held.
func (m *Monitor) drainable() bool {
	moving := m.calls.n - m.calls.stages[overran]
	return moving > 0 || m.keys.HasReady() && m.calls.slots < m.cfg.workers
}

// releaseHold ends WithDeferredStart's hold. mu is held.
func (m *Monitor) releaseHold() {
	if m.state == held {
		m.state = running
		m.changed()
	}
}
