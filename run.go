package eventmonitor

// Runs: a worker handles several of a key's events without taking the
// monitor's lock between them.
//
// A call that needs nothing from the monitor while it runs (no deadline to
// watch, no duration to measure) needs the lock only to take its event and
// to settle its outcome. A run takes up to a turn's worth of a key's events
// at once, calls the handler on each in order without the lock, and settles
// them all at once: two lock round trips a run instead of two an event,
// which under a flood is most of what the lock costs, the submitters
// contending for it. Every call still has its own context, ended when it
// returns; a failure ends the run at once, and the events after it go back
// to the head of the key's queue, untouched, behind the failed one.
//
// What a run changes, observably: Stats counts a run's events as queued
// until the run settles (Handled lags by at most a run), Forget does not
// return the events a run has taken, and Stop cancels the call in progress
// and hands the run's remaining events over with the rest.

import "sync/atomic"

// runner is the part of a worker that Stop reaches while it runs: the
// context of the call in progress, read without the monitor's lock.
type runner struct {
	current atomic.Pointer[handlerContext]
	link    listLinks[runner]
}

func (r *runner) links() *listLinks[runner] { return &r.link }

// mayRun reports whether k's next events may go as a run: calls need no
// clock (no deadline, no metrics), k is not replaying its backoff queue (a
// replay's first failure decides its next delay, so it goes call by call),
// and more than one event waits. mu is held.
func (m *Monitor) mayRun(k *keyState) bool {
	return !m.timesCalls && k.replayLeft == 0 && !k.replayStarting && m.state != stateStopped && k.queue.len() > 1
}

// runEvents takes up to limit of k's events as a run, handles them in order
// without mu and settles them, and returns how many it took. mu is held on
// entry and on return.
func (m *Monitor) runEvents(k *keyState, limit int, by *caller) int {
	n := min(k.queue.len(), limit)
	by.run = append(by.run[:0], k.queue.all()[:n]...)
	for range n {
		k.queue.pop()
	}
	m.queued -= n
	m.reserved += n
	m.runners.push(&by.runner)
	m.recount(k)
	m.signalProgress() // stream intake may be waiting for the room this frees
	first := by.contexts.next()
	k.running = first // holds the key, as a call does
	m.mu.Unlock()

	handled := 0
	var err error
	for i, it := range by.run {
		if m.stopping.Load() {
			break
		}
		c := first
		if i > 0 {
			c = by.contexts.next()
		}
		*c = handlerContext{monitor: m, key: k.key, by: by}
		by.runner.current.Store(c)
		if m.stopping.Load() { // Stop may have looked for this call before it was stored
			c.end(endedCanceled)
		}
		err = m.invoke(c, it.event)
		c.end(endedCanceled)
		if err != nil {
			break
		}
		handled++
	}
	by.runner.current.Store(nil)
	failedAt := m.callEnd(err) // the failure's time, for its trail

	m.mu.Lock()
	m.runners.remove(&by.runner)
	m.reserved -= n
	m.stats.Handled += uint64(handled)
	rest := by.run[handled:]
	if err != nil {
		rest = rest[1:]
	}
	for i := len(rest) - 1; i >= 0; i-- { // untouched, in order, ahead of what came since
		k.queue.pushFront(rest[i])
	}
	m.queued += len(rest)
	var out outcome
	if err != nil {
		out = m.complete(k, by.run[handled], err, failedAt)
	} else {
		k.running = nil
		m.recount(k)
		m.signalProgress()
	}
	clear(by.run) // let the GC have the events
	if out.needsReport() {
		m.mu.Unlock()
		m.report(out)
		m.mu.Lock()
	}
	return n
}
