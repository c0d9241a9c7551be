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
// handlers do, as the monitor's clock counts it (with a fake clock, a
// handler that ignores its ctx holds Stop until the test steps the clock).
// Every event left, queued or in backoff, then goes to the drop handler
// with ErrStopped. Stop is idempotent and safe for concurrent use.
//
// Stop also waits for what is already under way outside the handler: the
// reports of returned calls, envelopes being taken and exits being read,
// so a blocking drop handler, logger, Metrics, converter, exit builder or
// ExitStatus.Result holds it up, and so does a returned error whose Error
// method blocks when the report logs it. An envelope Run's reader takes
// as Stop returns is dropped with ErrStopped, maybe just after.
//
// Do not call Stop from a handler, which it would wait for until it
// overruns (forever, without a timeout), nor from the drop handler,
// Metrics, a log hook, a converter, an exit builder or ExitStatus.Result,
// which it may be waiting for: call go m.Stop() there.
func (m *Monitor) Stop() { m.stop(context.Background()) }

// stop is Stop, also abandoning every call still running once ctx, from
// waitingOn, ends; it returns how many calls it abandoned for that. After
// Shutdown's own beginStop, its beginStop only ends intake again.
func (m *Monitor) stop(ctx context.Context) (byCtx int) {
	m.mu.Lock()
	m.beginStop(m.cutsDrain())
	for len(m.calls) > 0 {
		m.abandon("overran its deadline", overran)
		if ctx.Err() != nil {
			byCtx += m.abandon("still running when Shutdown's ctx ended", inTime, late)
		}
		if len(m.calls) > 0 {
			m.cond.Wait()
		}
	}
	m.mu.Unlock()
	m.stopOnce.Do(m.finishStop) // a second Stop waits here for the first's
	return byCtx
}

// beginStop ends intake, records what the stop begins with (cut: it ends a
// Shutdown's drain that could still move), for Shutdown's result and
// WaitIdle, and cancels every call. mu is held.
func (m *Monitor) beginStop(cut bool) {
	m.endIntake()
	if m.state == stopped {
		return
	}
	m.atStop = atStop{cut: cut, reading: m.stream.reader == consuming, left: m.keys.Events(),
		busy: !m.idle() || m.sched.overdue(m.cfg.clock.Now())}
	m.state = stopped
	close(m.stopping)
	for _, c := range m.calls {
		if c.runningIn(inTime, late) {
			m.atStop.running++
		}
		c.cancel(context.Canceled)
	}
	m.reconcile()
}

// abandon gives up, at Stop, on the calls in the given stages whose
// handler is still running (see returned): their events are dropped, saying
// why, their keys' calls end, and their goroutines leave unseen. It
// returns how many. mu is held.
func (m *Monitor) abandon(why string, stages ...stage) (gaveUp int) {
	for _, c := range m.calls {
		if !c.runningIn(stages...) {
			continue
		}
		reason := fmt.Errorf("%w: handler %s, abandoned", ErrStopped, why)
		if c.progress.CompareAndSwap(notBegun, withdrawn) {
			reason = fmt.Errorf("%w: call withdrawn before its handler began", ErrStopped)
		}
		c.stage = abandoned
		m.abandonedDrops = append(m.abandonedDrops, m.drop(c.key.Name(), reason, c.it)...)
		m.keys.Done(c.key) // no other call starts: the monitor is stopped
		gaveUp++
	}
	if gaveUp > 0 {
		m.calls = slices.DeleteFunc(m.calls, func(c *call) bool { return c.stage == abandoned })
		m.reconcile() // not otherwise: two Stops waiting would wake each other for ever
	}
	return gaveUp
}

// finishStop, once no call is left, waits for envelopes being taken, drops
// every event left and waits for the scheduler and watchers to leave.
func (m *Monitor) finishStop() {
	defer close(m.lifetime) // deferred: the drop handler may end the goroutine
	m.mu.Lock()
	for m.accepting > 0 {
		m.cond.Wait()
	}
	drops := slices.Clip(m.abandonedDrops) // appending leaves them be
	var names []string
	m.keys.Keys(func(k *keyq.Key[item]) { names = append(names, k.Name()) })
	slices.Sort(names)
	for _, name := range names {
		items := m.keys.Forget(name)
		m.atStop.dropped += len(items)
		drops = append(drops, m.drop(name, ErrStopped, items...)...)
	}
	m.reconcile()
	m.poke() // the scheduler leaves: nothing is left to time
	m.mu.Unlock()
	m.watchers.Wait()
	m.emit(drops...)
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
// Its result, the first of these that applies:
//   - an error wrapping ctx's error, if ctx's end is what stopped the
//     drain before it was done (handlers not yet overrunning still
//     running, events left, or the stream reader not yet done: it may take
//     an envelope, which the stop drops), or its stop abandoned a call as
//     ctx ended;
//   - nil, if a Stop had begun before it was called: what that Stop loses
//     is its own;
//   - an error wrapping ErrStopped that says what its drain lost: calls
//     abandoned (as they overran, or by another stop), events that stuck
//     calls held back and the stop dropped, or a stop that began first and
//     cut the drain short: a Stop, or another Shutdown whose ctx ended,
//     even if this one's ctx (say, the same) had ended too;
//   - nil: the drain was done.
//
// An event that fails during the drain goes to the drop handler; it is not
// in the error.
func (m *Monitor) Shutdown(ctx context.Context) error {
	ctx, done := m.waitingOn(ctx)
	defer done()
	m.mu.Lock()
	stoppedFirst := m.state == stopped // a Stop left it nothing to drain
	m.endIntake()
	for m.stream.reader == consuming && m.state != stopped && ctx.Err() == nil {
		m.cond.Wait() // what the reader takes until it sees intake end is queued, then drained
	}
	if m.state.accepts() && ctx.Err() == nil { // ctx ended: no drain to start, stop at once
		m.state = draining
		m.reconcile()
	}
	for m.state == draining && ctx.Err() == nil && m.drainable() {
		m.cond.Wait()
	}
	// ctx counts only if it is what ends the drain: not if another stop
	// came first, nor if the drain was already done when ctx's wake-up won
	// the race. beginStop runs under this lock, so no call starts between.
	ended := ctx.Err() != nil && m.state != stopped && m.cutsDrain()
	m.beginStop(ended)
	o := drainOutcome{atStop: m.atStop, stoppedFirst: stoppedFirst, ended: ended}
	m.mu.Unlock()
	o.byCtx = m.stop(ctx) // a Stop already waiting does not hold it past ctx
	m.mu.Lock()
	o.gaveUp = len(m.abandonedDrops) // by any stop: no call is left to abandon
	o.dropped = m.atStop.dropped
	m.mu.Unlock()
	return o.err(ctx)
}

// atStop is what was left as the stop began, and what finishStop dropped
// of it.
type atStop struct {
	cut     bool // a Stop, or a Shutdown whose ctx ended, began it while a Shutdown's drain could move
	reading bool // the stream reader was consuming
	left    int  // events queued
	dropped int  // of left, the events finishStop dropped: Forget may take some back first
	running int  // calls whose handler had not returned and had not overrun
	busy    bool // work WaitIdle waits for was left: not idle, or a replay due
}

// drainOutcome is what a Shutdown's drain left as the stop began, and what
// the stop then abandoned, from which Shutdown's result follows.
type drainOutcome struct {
	atStop
	stoppedFirst bool // a Stop had begun when Shutdown was called
	ended        bool // ctx had ended when the drain did (so no Stop had)
	byCtx        int  // calls its stop abandoned as ctx ended, not overrunning
	gaveUp       int  // calls abandoned, by any stop
}

// unfinished reports whether the stop began with work left to drain.
func (s atStop) unfinished() bool { return s.left > 0 || s.reading || s.running > 0 }

// err is Shutdown's result, its doc's cases in order.
func (o drainOutcome) err(ctx context.Context) error {
	switch {
	case o.byCtx > 0 || o.ended && o.unfinished():
		return fmt.Errorf("eventmonitor: shutdown: %w", ctx.Err())
	case o.stoppedFirst:
		return nil // what a Stop begun before lost is not this Shutdown's to report
	}
	var lost []string
	if o.gaveUp > 0 {
		lost = append(lost, "abandoned "+counted(o.gaveUp, "handler call"))
	}
	switch {
	case o.cut && o.unfinished():
		lost = append(lost, "was cut short: the monitor stopped before its drain was done")
	case o.dropped > 0:
		lost = append(lost, "dropped "+counted(o.dropped, "event")+" that stuck calls held back")
	}
	if len(lost) == 0 {
		return nil
	}
	return fmt.Errorf("%w: shutdown %s", ErrStopped, strings.Join(lost, " and "))
}

// drainable reports whether a drain can still move: a call that is not an
// overrunning handler (a returned one is being settled) will finish. A
// ready key never waits for a free slot: reconcile gives it one. mu is held.
func (m *Monitor) drainable() bool {
	return slices.ContainsFunc(m.calls, func(c *call) bool { return !c.runningIn(overran) })
}

// cutsDrain reports whether a stop now cuts a Shutdown's drain short: one
// was called, and its drain can still move. A Stop, or ctx's end, may win
// the lock from a Shutdown woken because its drain is done. mu is held.
func (m *Monitor) cutsDrain() bool {
	return m.intakeEnded() && !(m.state == draining && !m.drainable())
}
