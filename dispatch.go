package eventmonitor

import (
	"fmt"
	"runtime/debug"
	"time"

	"github.com/containerd/log"
)

// schedule puts k in the run queue if it has work a worker may start now.
// mu is held.
func (m *Monitor) schedule(k *keyState) bool {
	if k.running != nil || k.ready || k.heapIndex >= 0 || k.queue.len() == 0 {
		return false
	}
	k.ready = true
	m.ready.push(k)
	if m.idleWorkers > 0 {
		m.workAvailable.Signal()
	}
	return true
}

// nextReady waits for a runnable key; nil means the worker should exit.
// waited reports whether it had to sleep. mu is held.
func (m *Monitor) nextReady() (k *keyState, waited bool) {
	for {
		if m.state == stateStopped {
			return nil, waited
		}
		if m.ready.len() > 0 && !m.held {
			k := m.ready.pop()
			k.ready = false
			if k.running == nil && k.heapIndex < 0 && k.queue.len() > 0 {
				m.holding++
				return k, waited
			}
			m.releaseIfIdle(k)
			continue
		}
		m.idleWorkers++
		m.workAvailable.Wait()
		m.idleWorkers--
		waited = true
	}
}

// worker runs ready keys until Stop, or until a call it runs overruns its
// deadline and a new worker takes its place. It reads the clock once per
// call: the reading taken when a call returns also starts the next call,
// unless the worker slept in between. The next call's deadline is then early
// by the bookkeeping between the two (stricter, never later than asked).
func (m *Monitor) worker() {
	m.mu.Lock()
	defer m.mu.Unlock()
	w := &caller{pooled: true}
	var now time.Duration
	for first := true; ; first = false {
		k, waited := m.nextReady()
		if k == nil {
			m.leave()
			return
		}
		if waited || first {
			now = m.callStart()
		}
		for turn := 0; ; {
			if m.mayRun(k) {
				room := maxTurn - turn
				if room <= 0 {
					room = maxTurn // nobody else waits: a run more
				}
				turn += m.runEvents(k, room, w)
			} else {
				var fate callFate
				now, fate = m.handleNext(k, now, w)
				switch fate {
				case callAbandoned:
					return // Stop gave up on this goroutine; it no longer counts
				case callReplaced:
					m.handBack(k)
					m.leave()
					return
				}
				turn++
			}
			if !m.mayContinue(k, turn) {
				break
			}
		}
		m.handBack(k)
	}
}

// leave is the last thing a goroutine Stop waits for does. mu is held.
func (m *Monitor) leave() {
	m.busy--
	m.signalProgress()
}

// maxTurn is how many events in a row a worker handles for one key while
// other keys wait. Staying on a key saves the trip through the run queue;
// the bound keeps turns fair.
const maxTurn = 32

// mayContinue reports whether the worker that just handled turn of k's
// events in a row may handle k's next one at once. mu is held.
func (m *Monitor) mayContinue(k *keyState, turn int) bool {
	if m.state == stateStopped || k.running != nil || k.ready || k.heapIndex >= 0 || k.queue.len() == 0 {
		return false
	}
	return turn < maxTurn || m.ready.len() == 0
}

// handBack ends a goroutine's hold on k: it puts k in the run queue if it
// has more to run, and forgets it if it is idle. mu is held.
func (m *Monitor) handBack(k *keyState) {
	if !m.schedule(k) {
		m.releaseIfIdle(k)
	}
	if m.holding--; m.holding == 0 {
		m.signalProgress() // WaitIdle may be waiting for this
	}
}

// callFate is what the goroutine that ran a call does next.
type callFate uint8

const (
	callSettled   callFate = iota // the outcome is settled: go on
	callReplaced                  // settled, but another worker took this one's place while it overran: exit
	callAbandoned                 // Stop gave up waiting for the call: exit without touching the monitor
)

// caller is a goroutine that runs handler calls: a worker, or an exit
// watcher handling its exit at once (see exitCaller).
type caller struct {
	pooled   bool        // a worker: replaced if its call overruns
	contexts contextSlab // where its calls' contexts come from
	running  item        // the event of its call in progress; guarded by Monitor.mu
	run      []item      // the events of its run in progress (see run.go)
	runner   runner
}

// handleNext runs the head of k's queue on the calling goroutine, started at
// now, and settles the outcome; the caller then runs k on or hands it back.
// mu is held on entry and on return; it is released around the handler call
// and any logging or drop callbacks. It returns the clock's reading when the
// handler returned (see callStart), and what the calling goroutine does
// next. Both readings count from the monitor's epoch (see sinceEpoch).
func (m *Monitor) handleNext(k *keyState, now time.Duration, by *caller) (time.Duration, callFate) {
	wasReplay := k.replayLeft > 0
	var starting *retry
	if k.replayStarting && wasReplay {
		k.replayStarting = false
		starting = &retry{key: k.key, events: int(k.replayLeft), delay: k.delay}
		if t := k.queue.peek().trail; t != nil {
			starting.trail = *t
		}
	}
	it := k.queue.pop()
	m.queued--
	if wasReplay {
		k.replayLeft--
		k.replayInFlight = true
	}
	m.recount(k)
	m.signalProgress() // stream intake may be waiting for the room this frees
	call := m.startCall(k.key, now, by)
	by.running = it
	k.running = call
	m.mu.Unlock()

	if starting != nil {
		m.logRetry(*starting)
	}

	err := m.invoke(call, it.event)
	call.end(endedCanceled) // as a deferred cancel would: what the handler started with ctx stops
	end := m.callEnd(err)
	if mt := m.cfg.metrics; mt != nil {
		m.observe(mt, call.start, end, it, err) // before taking mu again
	}

	m.mu.Lock()
	if call.abandoned {
		return end, callAbandoned // already unlinked and accounted for by abandon
	}
	by.running = item{}
	m.calls.remove(call)
	if call.expired {
		m.overrunning--
	}
	if call.replaced {
		m.replaced--
	}
	out := m.complete(k, it, err, end)
	if call.expired {
		out.overran = end - call.start
	}
	if out.needsReport() {
		m.mu.Unlock()
		m.report(out)
		m.mu.Lock()
	}
	if call.replaced && !m.takeOverSeat() {
		return end, callReplaced
	}
	return end, callSettled
}

// takeOverSeat lets a worker whose overrunning call returned stay on in
// place of a worker held by another overrunning call that the bound left
// unreplaced. It reports whether there was one. mu is held.
func (m *Monitor) takeOverSeat() bool {
	for c := m.calls.head; c != nil && c.expired; c = c.link.next {
		if c.by.pooled && !c.replaced && m.state != stateStopped {
			c.replaced = true
			m.replaced++
			return true
		}
	}
	return false
}

// startCall registers a call by by starting at now and returns its context.
// mu is held.
func (m *Monitor) startCall(key string, now time.Duration, by *caller) *handlerContext {
	c := by.contexts.next()
	*c = handlerContext{monitor: m, key: key, by: by, start: now}
	if m.cfg.handleTimeout > 0 {
		m.rearm(c.deadline()) // a no-op unless the scheduler would wake later
	}
	m.calls.push(c)
	return c
}

// callStart reads the clock for a handler call's start, if anything needs
// the reading: a deadline or metrics.
func (m *Monitor) callStart() time.Duration {
	if !m.timesCalls {
		return 0
	}
	return m.sinceEpoch()
}

// callEnd reads the clock when a call returned with err, if anything needs
// the reading: a deadline or metrics, or a failure's trail.
func (m *Monitor) callEnd(err error) time.Duration {
	if !m.timesCalls && err == nil {
		return 0
	}
	return m.sinceEpoch()
}

// invoke calls the handler, turning a panic into ErrHandlerPanic.
func (m *Monitor) invoke(ctx *handlerContext, event any) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v", ErrHandlerPanic, r)
			m.cfg.logger.WithFields(log.Fields{"key": ctx.key, "stack": string(debug.Stack())}).
				WithError(err).Error("event handler panicked")
		}
	}()
	return m.handler.HandleEvent(ctx, event)
}

// observe reports one finished call, which ran from start to end (readings
// of sinceEpoch), to the metrics.
func (m *Monitor) observe(mt Metrics, start, end time.Duration, it item, err error) {
	mt.HandlerDone(end-start, err)
	if err == nil && it.trail != nil && it.trail.attempts > 0 {
		mt.Recovered(end - it.trail.failedAt)
	}
}

// outcome is what a finished call leaves to report once mu is released. It
// copies what it needs of the event's trail: once mu is released the event
// may already be running again.
type outcome struct {
	key              string
	topic, namespace string
	attempts         int
	err              error         // the handler's error, nil on success
	delay            time.Duration // the backoff the failed event now waits
	drop             *Drop         // set when the monitor gave up on the event
	overran          time.Duration // how long a call that passed its deadline ran
}

func (o *outcome) needsReport() bool { return o.err != nil || o.overran > 0 }

// complete settles a call that returned at end (a reading of sinceEpoch):
// on success the replay advances; on failure the event returns to the head
// of the queue and the key waits, or the monitor gives up on it. mu is held.
func (m *Monitor) complete(k *keyState, it item, err error, end time.Duration) outcome {
	out := outcome{key: k.key, err: err}
	k.running = nil
	wasReplay := k.replayInFlight
	k.replayInFlight = false
	if err == nil {
		m.stats.Handled++
		k.replayProgressed = k.replayProgressed || wasReplay
	} else {
		m.stats.Failed++
		it.failed(end, err) // a time only failures need
		out.topic, out.namespace, out.attempts = it.trail.topic, it.trail.namespace, int(it.trail.attempts)
		if reason := m.giveUp(it, err); reason != nil {
			d := it.drop(k.key, reason)
			out.drop = &d
			m.stats.Dropped++
		} else {
			m.requeue(k, it, wasReplay)
			out.delay = k.delay
		}
	}
	m.recount(k)
	m.signalProgress()
	return out
}

// giveUp returns why the monitor stops retrying a failed event, or nil.
func (m *Monitor) giveUp(it item, err error) error {
	if m.state != stateRunning {
		return fmt.Errorf("%w: failed while shutting down: %w", ErrStopped, err)
	}
	if max := m.cfg.maxAttempts; max > 0 && it.attempts() >= max {
		return fmt.Errorf("%w (%d): %w", ErrMaxAttempts, it.attempts(), err)
	}
	return nil
}

// requeue puts a failed event back at the head of its key's queue and makes
// the key wait. A replay that failed on the very event that failed before
// made no progress: its delay doubles. Any other failure, a fresh one or a
// replay that handled events before failing on a later one, waits the
// initial delay: under independent failures a key with a backlog then keeps
// moving instead of crawling at one event per maximum delay. A key that
// Backoff put in the heap while this call ran keeps its due time. mu is held.
func (m *Monitor) requeue(k *keyState, it item, wasReplay bool) {
	k.queue.pushFront(it)
	m.queued++
	if k.heapIndex >= 0 {
		return
	}
	if wasReplay && !k.replayProgressed {
		k.delay = nextDelay(k.delay, m.cfg.maxBackoff)
	} else {
		k.delay = m.cfg.initialBackoff
	}
	k.replayLeft = 0 // the events behind it wait with it
	m.wait(k)
}

// report logs a finished call's failure or overrun and hands a drop over.
// Failures log once per handler call: a key in backoff makes at most one
// call per delay, so a failing key cannot flood the log.
func (m *Monitor) report(out outcome) {
	fields := log.Fields{"key": out.key, "attempt": out.attempts}
	if out.topic != "" {
		fields["topic"], fields["namespace"] = out.topic, out.namespace
	}
	entry := m.cfg.logger.WithFields(fields)
	if out.overran > 0 {
		entry.WithField("ran", out.overran).Warn("event handler returned after its deadline")
	}
	switch {
	case out.drop != nil:
		entry.WithError(out.err).Warn("giving up on event")
		m.emit(*out.drop)
	case out.err != nil:
		entry.WithError(out.err).WithField("delay", out.delay).Error("event handling failed; backing off")
	}
}

// overrun is a call that passed its deadline, as its log line tells it.
type overrun struct {
	key      string
	started  time.Time
	replaced bool // a new worker took its worker's place
	limited  bool // a worker's call, not replaced: WithMaxOverruns was reached
}

// expireCalls cancels the contexts of calls whose deadline has passed,
// replaces the workers stuck in them while the monitor runs, and, once Stop
// is waiting, abandons them. It returns the calls that newly overran, for
// logging outside mu. mu is held.
func (m *Monitor) expireCalls(now time.Time) []overrun {
	if m.cfg.handleTimeout == 0 {
		return nil // no deadlines
	}
	var overruns []overrun
	for c := m.calls.head; c != nil; {
		next := c.link.next
		if c.deadline().After(now) {
			break
		}
		if !c.late {
			c.late = true
			c.end(endedDeadline)
		}
		if !c.expired && c.overrunAt().After(now) {
			c = next // within its grace; a later call may have reached its deadline
			continue
		}
		if !c.expired {
			c.expired = true
			m.overrunning++
			o := overrun{key: c.key, started: c.started()}
			if c.by.pooled && m.state != stateStopped {
				if m.replaced < m.cfg.maxOverruns {
					c.replaced, o.replaced = true, true
					m.replaced++
					m.busy++
					go m.worker()
				} else {
					o.limited = true
				}
			}
			overruns = append(overruns, o)
			m.signalProgress() // Shutdown no longer waits for this call
		}
		if m.state == stateStopped {
			m.abandon(c)
		}
		c = next
	}
	return overruns
}

// abandon stops waiting for a call that overran its deadline during Stop:
// its event goes to the drop handler, and its goroutine, when the handler
// finally returns, exits without touching the monitor. mu is held.
func (m *Monitor) abandon(c *handlerContext) {
	c.abandoned = true
	m.calls.remove(c)
	m.overrunning--
	if c.replaced {
		m.replaced--
	}
	m.busy--
	m.abandonedCalls++
	m.stats.Dropped++
	m.abandonedDrops = append(m.abandonedDrops, c.by.running.drop(c.key,
		fmt.Errorf("%w: handler still running at its deadline, abandoned", ErrStopped)))
	m.signalProgress()
}

func (m *Monitor) reportOverruns(overruns []overrun, now time.Time) {
	for _, o := range overruns {
		entry := m.cfg.logger.WithFields(log.Fields{"key": o.key, "running": now.Sub(o.started), "replaced": o.replaced})
		entry.Warn("event handler overran its timeout; its key stays held until it returns")
		if o.limited {
			entry.WithField("limit", m.cfg.maxOverruns).
				Error("too many handler calls overrunning their timeout (WithMaxOverruns): this one keeps its worker")
		}
	}
}

func (m *Monitor) signalProgress() {
	if m.progressWaiters > 0 {
		m.progress.Broadcast()
	}
}
