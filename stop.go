package eventmonitor

import (
	"context"
	"fmt"
	"maps"
	"slices"
)

// Stop ends intake, cancels the calls in progress and waits for them,
// abandoning one that overruns; then every event left goes to the drop
// handler with ErrStopped. It is idempotent and safe for concurrent use;
// see the package doc for what it waits for.
func (m *Monitor) Stop() { m.stop(context.Background()) }

// stop is Stop, abandoning every call still running once ctx ends; it
// reports whether it did.
func (m *Monitor) stop(ctx context.Context) (cut bool) {
	m.mu.Lock()
	if m.state != stopped {
		m.state = stopped
		m.endIntake()
		close(m.stopping)
		for _, c := range m.calls {
			c.cancel(context.Canceled)
		}
		m.changed()
	}
	for len(m.calls) > 0 {
		all := ctx.Err() != nil
		cut = cut || (all && slices.ContainsFunc(m.calls, func(c *call) bool { return c.state == inTime || c.state == late }))
		// finishStop hands them over: every Stop waits for it, so none
		// returns while another still delivers an abandoned call's drop.
		m.abandonedDrops = append(m.abandonedDrops, m.abandon(all)...)
		if len(m.calls) > 0 {
			m.cond.Wait()
		}
	}
	m.mu.Unlock()
	m.stopOnce.Do(m.finishStop) // a second Stop waits here for the first's
	return cut
}

// abandon gives up on the calls that overran (all that run, if all): their
// events are dropped, their keys move on, and their goroutines leave
// unseen. mu is held.
func (m *Monitor) abandon(all bool) (drops []Drop) {
	for _, c := range m.calls {
		if c.state == settling || c.state != overran && !all {
			continue
		}
		why := "overran its deadline"
		if c.state != overran {
			why = "still running when Shutdown's ctx ended"
		}
		c.state = abandoned
		m.stats.Dropped++
		drops = append(drops, dropsOf(c.key.name, fmt.Errorf("%w: handler %s, abandoned", ErrStopped, why), c.it)...)
		m.keys.done(c.key)
		m.work.Done()
	}
	if drops != nil {
		m.calls = slices.DeleteFunc(m.calls, func(c *call) bool { return c.state == abandoned })
		m.changed()
	}
	return drops
}

// finishStop, once no call is left, drops every event left and waits for
// the monitor's goroutines to leave.
func (m *Monitor) finishStop() {
	m.mu.Lock()
	drops := m.abandonedDrops // first: they are of earlier events of their keys
	m.abandonedDrops = nil
	for _, name := range slices.Sorted(maps.Keys(m.keys.byName)) {
		items := m.keys.forget(name)
		m.stats.Dropped += uint64(len(items))
		drops = append(drops, dropsOf(name, ErrStopped, items...)...)
	}
	if m.sched.state == looping {
		m.poke() // it sees nothing left to time, and leaves
	}
	m.changed()
	m.mu.Unlock()
	m.work.Wait() // first: a call's report hands over an earlier event of its key
	m.emit(drops...)
	close(m.lifetime)
}

// Shutdown stops intake, handles what is queued (retrying every key in
// backoff at once), then stops as Stop does, abandoning every call once ctx
// ends. It returns an error wrapping ctx's if ctx ended first; every event
// it could not handle reaches the drop handler with ErrStopped.
func (m *Monitor) Shutdown(ctx context.Context) error {
	ctx, done := m.waitingOn(ctx)
	defer done()
	m.mu.Lock()
	if m.state == held || m.state == running {
		m.state = draining
		m.endIntake()
		m.changed()
	}
	for m.state == draining && ctx.Err() == nil && !m.drained() {
		m.cond.Wait()
	}
	cut := m.state == draining && !m.drained()
	m.mu.Unlock()
	if m.stop(ctx) || cut {
		return fmt.Errorf("eventmonitor: shutdown: %w", ctx.Err())
	}
	return nil
}

// drained reports whether a drain can no longer move: the stream reader
// is done, and no call is left but overran ones, which hold the key (and
// maybe the slot) of every event still queued. mu is held.
func (m *Monitor) drained() bool {
	return m.stream.reader != consuming && !slices.ContainsFunc(m.calls, func(c *call) bool { return c.state != overran })
}

// waitingOn wraps ctx for a wait on cond: its Err is the standard
// library's, safe to call under mu, and its end wakes the waiters.
func (m *Monitor) waitingOn(ctx context.Context) (_ context.Context, done func()) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(ctx, m.wakeWaiters)
	return ctx, func() { stop(); cancel() }
}

// wakeWaiters wakes all who wait on cond, for a waiter whose ctx ended.
func (m *Monitor) wakeWaiters() {
	m.mu.Lock()
	m.cond.Broadcast()
	m.mu.Unlock()
}
