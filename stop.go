package eventmonitor

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// Stop ends intake, cancels every call in progress and waits for them to
// return, abandoning (and dropping the event of) a call that overruns (see
// WithHandleTimeout): it returns within about the handle timeout whatever
// handlers do. Every event left, queued or in backoff, then goes to the
// drop handler with ErrStopped. Stop is idempotent and safe for concurrent
// use.
//
// Stop also waits for what is already under way outside the handler: the
// reports of returned calls, envelopes being taken and exits being read,
// so a blocking drop handler, logger, Metrics, converter, exit builder or
// ExitStatus.Result holds it up. An envelope Run's reader takes as Stop
// returns is dropped with ErrStopped, maybe just after.
//
// Do not call Stop from a handler, which it would wait for until it
// overruns (forever, without a timeout), nor from the drop handler,
// Metrics, a log hook, a converter, an exit builder or ExitStatus.Result,
// which it may be waiting for: call go m.Stop() there.
func (m *Monitor) Stop() { m.stop(context.Background()) }

// stop is Stop, abandoning every call still running once ctx, from
// waitingOn, ends.
func (m *Monitor) stop(ctx context.Context) {
	m.mu.Lock()
	m.beginStop()
	for len(m.calls) > 0 {
		if ctx.Err() != nil {
			m.abandon("still running when Shutdown's ctx ended", inTime, late, overran)
		} else {
			m.abandon("overran its deadline", overran)
		}
		if len(m.calls) > 0 {
			m.cond.Wait()
		}
	}
	m.mu.Unlock()
	m.stopOnce.Do(m.finishStop) // a second Stop waits here for the first's
}

// beginStop ends intake and cancels every call. mu is held.
func (m *Monitor) beginStop() {
	shutdownCalled := m.intake.Err() != nil
	m.endIntake()
	if m.state == stopped {
		return
	}
	m.drainCut = shutdownCalled && !m.drained()
	m.state = stopped
	close(m.stopping)
	for _, c := range m.calls {
		c.cancel(context.Canceled)
	}
	m.changed()
}

// abandon gives up, at Stop, on the calls in the given stages whose
// handler is still running: their events are dropped, saying why, and their
// goroutines leave unseen if they ever return. A call whose handler
// returned is waited for: it settles as soon as it has the lock. mu is
// held.
func (m *Monitor) abandon(why string, stages ...stage) {
	before := len(m.calls)
	m.calls = slices.DeleteFunc(m.calls, func(c *call) bool {
		if !c.runningIn(stages...) {
			return false
		}
		reason := fmt.Errorf("%w: handler %s, abandoned", ErrStopped, why)
		if c.progress.CompareAndSwap(notBegun, withdrawn) {
			reason = fmt.Errorf("%w: call withdrawn before its handler began", ErrStopped)
		}
		c.stage = abandoned
		m.abandonedDrops = append(m.abandonedDrops, m.drop(c.key.Name(), reason, c.it)...)
		return true
	})
	if len(m.calls) < before {
		m.changed() // not otherwise: two Stops waiting would wake each other for ever
	}
}

// finishStop, once no call is left, waits for envelopes being taken, drops
// every event left and waits for the scheduler and watchers to leave.
func (m *Monitor) finishStop() {
	m.mu.Lock()
	for m.accepting > 0 {
		m.cond.Wait()
	}
	drops := m.abandonedDrops
	m.abandonedDrops = nil
	var names []string
	m.keys.Keys(func(k *keyq.Key[item]) { names = append(names, k.Name()) })
	slices.Sort(names)
	for _, name := range names {
		drops = append(drops, m.drop(name, ErrStopped, m.keys.Forget(name)...)...)
	}
	m.changed()
	m.poke() // the scheduler leaves: nothing is left to time
	m.mu.Unlock()
	m.watchers.Wait()
	m.emit(drops...)
	close(m.lifetime)
}

// Shutdown stops intake (Submit, Backoff and exits are refused with
// ErrStopped; it waits for the stream reader to see intake end, queueing
// what it takes until then), handles everything queued, replays every
// backoff queue once at once, then Stops. An event failing meanwhile, or
// still waiting at the stop, is dropped with ErrStopped. Overrunning calls
// do not hold it up: once nothing else can move, it stops. If ctx ends
// first it stops at once, abandoning every call in progress; what else
// Stop waits for (a returned call's report, a converter, an exit being
// read or built) it still waits for.
//
// It returns nil if it lost nothing: its drain was done, or a Stop had
// begun before it was called (what that Stop loses is its own). It
// returns ctx's error if ctx ended with calls in progress, events left, a
// Stop that cut its drain short or the stream reader still reading;
// otherwise an error wrapping ErrStopped that says what its drain lost:
// calls abandoned as they overran, events that stuck calls kept from every
// worker, or a Stop that began before the drain was done. An event that
// fails during the drain goes to the drop handler; it is not in the error.
func (m *Monitor) Shutdown(ctx context.Context) error {
	ctx, done := m.waitingOn(ctx)
	defer done()
	m.mu.Lock()
	drainer := m.state != stopped // else a Stop left it nothing to drain
	m.endIntake()
	for m.stream.reader == consuming && ctx.Err() == nil {
		m.cond.Wait() // what the reader takes until it sees intake end is queued, then drained
	}
	if m.state.accepts() && ctx.Err() == nil { // ctx ended: no drain to start, stop at once
		m.state = draining
		m.changed()
	}
	for m.state == draining && ctx.Err() == nil && m.drainable() {
		m.cond.Wait()
	}
	// What is left as the stop begins, noted under the same lock so that no
	// call starts between; the calls may yet return or be abandoned (by
	// this stop or a Stop begun meanwhile).
	o := drainOutcome{drainer: drainer, cut: drainer && m.drainCut, reading: m.stream.reader == consuming,
		calls: len(m.calls), left: m.keys.Events()}
	calls := slices.Clone(m.calls)
	m.beginStop()
	m.mu.Unlock()
	m.stop(ctx) // a Stop already waiting does not hold it past ctx
	m.mu.Lock()
	for _, c := range calls {
		if c.stage == abandoned {
			o.gaveUp++
		}
	}
	m.mu.Unlock()
	return o.err(ctx)
}

// drainOutcome is what a Shutdown's drain left as its stop began, and what
// the stop then abandoned, from which Shutdown's result follows.
type drainOutcome struct {
	drainer bool // no Stop had begun when Shutdown was called
	cut     bool // a Stop began after Shutdown was called, with work left
	reading bool // the stream reader was still consuming: ctx ended first
	calls   int  // calls in progress
	left    int  // events queued, which the stop drops
	gaveUp  int  // of the calls, those abandoned
}

// err is Shutdown's result, as its doc says.
func (o drainOutcome) err(ctx context.Context) error {
	switch {
	case ctx.Err() != nil && (o.calls > 0 || o.drainer && (o.left > 0 || o.cut || o.reading)):
		return fmt.Errorf("eventmonitor: shutdown: %w", ctx.Err())
	case !o.drainer:
		return nil // what a Stop begun before lost is not this Shutdown's to report
	}
	var lost []string
	if o.gaveUp > 0 {
		lost = append(lost, fmt.Sprintf("abandoned %d handler calls that overran their timeout", o.gaveUp))
	}
	switch {
	case o.cut:
		lost = append(lost, "was cut short: Stop began before its drain was done")
	case o.left > 0:
		lost = append(lost, fmt.Sprintf("dropped %d events that stuck calls kept from every worker", o.left))
	}
	if len(lost) == 0 {
		return nil
	}
	return fmt.Errorf("%w: shutdown %s", ErrStopped, strings.Join(lost, " and "))
}

// drained reports whether nothing is left to drain: no call, no event
// queued, no stream reader that may yet take one. mu is held.
func (m *Monitor) drained() bool {
	return len(m.calls) == 0 && m.keys.Events() == 0 && m.stream.reader != consuming
}

// drainable reports whether a drain can still move: a call not stuck
// (overran and still running: a returned one settles once it has the
// lock) may finish, or a ready key has a free slot. mu is held.
func (m *Monitor) drainable() bool {
	for _, c := range m.calls {
		if !c.runningIn(overran) {
			return true
		}
	}
	return m.keys.HasReady() && m.slotsHeld() < m.cfg.workers
}

// releaseHold ends WithDeferredStart's hold. mu is held.
func (m *Monitor) releaseHold() {
	if m.state == held {
		m.state = running
		m.changed()
	}
}
