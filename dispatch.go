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
		if m.ready.len() > 0 {
			k := m.ready.pop()
			k.ready = false
			if k.running == nil && k.heapIndex < 0 && k.queue.len() > 0 {
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

// worker runs ready keys until Stop. It reads the clock once per call: the
// reading taken when a call returns also starts the next call, unless the
// worker slept in between. The next call's deadline is then early by the
// bookkeeping between the two (stricter, never later than asked).
func (m *Monitor) worker() {
	m.mu.Lock()
	defer m.mu.Unlock()
	var now time.Duration
	for first := true; ; first = false {
		k, waited := m.nextReady()
		if k == nil {
			m.busy--
			m.signalProgress()
			return
		}
		if waited || first {
			now = m.sinceEpoch()
		}
		for turn := 1; ; turn++ {
			var ok bool
			if now, ok = m.handleNext(k, now); !ok {
				return // Stop abandoned this goroutine's call; it no longer counts
			}
			if !m.mayContinue(k, turn) {
				break
			}
		}
		m.handBack(k)
	}
}

// maxTurn is how many events in a row a worker handles for one key while
// other keys wait. Staying on a key saves the trip through the run queue;
// the bound keeps turns fair.
const maxTurn = 32

// mayContinue reports whether the worker that just handled k's turn-th
// event in a row may handle k's next one at once. mu is held.
func (m *Monitor) mayContinue(k *keyState, turn int) bool {
	if m.state == stateStopped || k.running != nil || k.ready || k.heapIndex >= 0 || k.queue.len() == 0 {
		return false
	}
	return turn < maxTurn || m.ready.len() == 0
}

// handBack puts k in the run queue if it has more to run, and forgets it if
// it is idle. mu is held.
func (m *Monitor) handBack(k *keyState) {
	if !m.schedule(k) {
		m.releaseIfIdle(k)
	}
}

// handleNext runs the head of k's queue on the calling goroutine, started at
// now, and settles the outcome; the caller then runs k on or hands it back.
// mu is held on entry and on return; it is released around the handler call
// and any logging or drop callbacks. It returns the clock's reading when the
// handler returned, and false if Stop abandoned the call while it ran. Both
// readings count from the monitor's epoch (see sinceEpoch).
func (m *Monitor) handleNext(k *keyState, now time.Duration) (time.Duration, bool) {
	wasReplay := k.replayLeft > 0
	var starting *retry
	if k.replayStarting && wasReplay {
		k.replayStarting = false
		starting = &retry{key: k.key, events: k.replayLeft, delay: k.delay}
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
	k.running = it.event
	call := m.startCall(k.key, now)
	m.mu.Unlock()

	if starting != nil {
		m.logRetry(*starting)
	}

	err := m.invoke(call, it.event)
	call.end(endedCanceled) // as a deferred cancel would: what the handler started with ctx stops
	end := m.sinceEpoch()
	if mt := m.cfg.metrics; mt != nil {
		m.observe(mt, call.start, end, it, err) // before taking mu again
	}

	m.mu.Lock()
	if call.abandoned {
		return end, false // already unlinked and accounted for by abandon
	}
	m.calls.remove(call)
	out := m.complete(k, it, err, end)
	if call.expired {
		out.overran = end - call.start
	}
	if out.needsReport() {
		m.mu.Unlock()
		m.report(out)
		m.mu.Lock()
	}
	return end, true
}

// startCall registers a call starting at now and returns its context. mu is
// held.
func (m *Monitor) startCall(key string, now time.Duration) *handlerContext {
	c := &handlerContext{monitor: m, key: key, start: now}
	m.rearm(c.deadline()) // a no-op unless the scheduler would wake later
	m.calls.push(c)
	return c
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
		mt.Recovered(m.epoch.Add(end).Sub(it.trail.failedAt))
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
	} else {
		m.stats.Failed++
		it.failed(m.epoch.Add(end), err) // a time only failures need
		out.topic, out.namespace, out.attempts = it.trail.topic, it.trail.namespace, it.trail.attempts
		if reason := m.giveUp(it, err); reason != nil {
			out.drop = &Drop{Key: k.key, Events: []any{it.event}, Reason: reason}
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
// the key wait: the initial delay after a fresh failure, double the last one
// after a failed replay. A key that Backoff put in the heap while this call
// ran keeps its due time. mu is held.
func (m *Monitor) requeue(k *keyState, it item, wasReplay bool) {
	k.queue.pushFront(it)
	m.queued++
	if k.heapIndex >= 0 {
		return
	}
	switch {
	case wasReplay:
		k.delay = nextDelay(k.delay, m.cfg.maxBackoff)
	case k.delay == 0:
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
		entry.WithError(out.err).WithField("delay", out.delay).Warn("event handling failed; backing off")
	}
}

// expireCalls cancels the contexts of calls whose deadline has passed and,
// once Stop is waiting, abandons them. It returns the calls that newly
// overran, for logging outside mu. mu is held.
func (m *Monitor) expireCalls(now time.Time) []*handlerContext {
	var overruns []*handlerContext
	for c := m.calls.head; c != nil; {
		next := c.link.next
		if c.deadline().After(now) {
			break
		}
		if !c.expired {
			c.expired = true
			c.end(endedDeadline)
			overruns = append(overruns, c)
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
	m.busy--
	m.stats.Dropped++
	m.abandonedDrops = append(m.abandonedDrops, Drop{
		Key:    c.key,
		Events: []any{m.keys[c.key].running},
		Reason: fmt.Errorf("%w: handler still running at its deadline, abandoned", ErrStopped),
	})
	m.signalProgress()
}

func (m *Monitor) reportOverruns(calls []*handlerContext, now time.Time) {
	for _, c := range calls {
		m.cfg.logger.WithFields(log.Fields{"key": c.key, "running": now.Sub(c.started())}).
			Warn("event handler overran its timeout; its key stays held until it returns")
	}
}

func (m *Monitor) signalProgress() {
	if m.progressWaiters > 0 {
		m.progress.Broadcast()
	}
}
