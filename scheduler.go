package eventmonitor

import (
	"context"
	"time"

	"github.com/containerd/log"
	"k8s.io/utils/clock"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// The scheduler is the one goroutine that watches the clock: it replays
// backoff queues when due and ends calls at their deadline, from one timer
// set for the earliest of the two (no periodic scan: 100 000 keys in
// backoff cost one timer). It runs only while there is something to time:
// an idle monitor has no timer and no goroutine.

// schedulerState is guarded by Monitor.mu.
type schedulerState struct {
	running bool          // a scheduler goroutine runs
	armed   time.Time     // what it sets its timer for, from its last look; zero: none
	set     bool          // its timer is set for armed
	wake    chan struct{} // makes it look again
}

// clockSlack is how far a clock may move while the scheduler arms its timer
// and still be trusted: far above a real clock's drift over a few
// instructions, far below any delay; a fake clock stepped meanwhile makes
// it look again.
const clockSlack = time.Millisecond

// wakeAt is when the scheduler must look next: the first retry due (unless
// the monitor is held or stopping), the earliest deadline of a call still
// in time, or the end of the grace of a call past its deadline. Zero if
// none. Calls are in start order, so the first of each stage is the
// earliest. mu is held.
func (m *Monitor) wakeAt() (at time.Time) {
	earlier := func(t time.Time) {
		if at.IsZero() || t.Before(at) {
			at = t
		}
	}
	if k := m.keys.Earliest(); k != nil && m.state == running {
		earlier(k.Due())
	}
	if m.cfg.handleTimeout == 0 {
		return at
	}
	var seenInTime, seenLate bool
	for c := m.calls.head; c != nil && !(seenInTime && seenLate); c = c.next {
		switch {
		case c.stage == inTime && !seenInTime:
			seenInTime = true
			earlier(c.deadline)
		case c.stage == late && !seenLate:
			seenLate = true
			earlier(m.overrunAt(c))
		}
	}
	return at
}

// overrunAt is when a call still running past its deadline counts as
// stuck. The grace spares a handler whose own timeout, started a moment
// after the monitor's, ends just past it (containerd's handlers keep one),
// while a stuck call is still found within a second.
func (m *Monitor) overrunAt(c *call) time.Time {
	return c.deadline.Add(min(time.Second, m.cfg.handleTimeout/10))
}

// retime starts the scheduler when there is something to time, and makes
// it look again when it must wake earlier than its timer, or needs no
// timer any more. A timer later than needed is left: it fires early and is
// set again. mu is held.
func (m *Monitor) retime() {
	at := m.wakeAt()
	switch armed := m.sched.armed; {
	case !m.sched.running:
		if !at.IsZero() {
			m.sched.running = true
			go m.schedule()
		}
	case at.IsZero() != armed.IsZero() || at.Before(armed):
		m.poke()
	}
}

// timerRight reports whether the scheduler's timer is exactly as wakeAt
// wants it, as WaitIdle needs. mu is held.
func (m *Monitor) timerRight() bool {
	at := m.wakeAt()
	if at.IsZero() {
		return !m.sched.running
	}
	return m.sched.running && m.sched.set && m.sched.armed.Equal(at)
}

func (m *Monitor) poke() {
	select {
	case m.sched.wake <- struct{}{}:
	default:
	}
}

func (m *Monitor) schedule() {
	var timer clock.Timer
	for spins := 0; ; {
		now, at := m.pass()
		// Drain before Reset: a FakeClock timer's channel holds one value,
		// and its Step blocks on a second.
		if timer != nil && !timer.Stop() {
			select {
			case <-timer.C():
			default:
			}
		}
		if at.IsZero() {
			if m.leaveScheduler() {
				return
			}
			continue
		}
		if timer == nil {
			timer = m.cfg.clock.NewTimer(at.Sub(now))
		} else {
			timer.Reset(at.Sub(now))
		}
		// Reset counts from the clock's time when it runs: if the clock
		// moved since now, the timer is late by as much (and a fake timer
		// whose target has passed never fires), so look again.
		if moved := m.cfg.clock.Since(now); moved >= clockSlack || moved > 0 && spins < 2 {
			spins++
			continue
		}
		spins = 0
		m.mu.Lock()
		m.sched.set = m.sched.armed.Equal(at)
		m.cond.Broadcast() // WaitIdle may be waiting for the timer
		m.mu.Unlock()
		select {
		case <-timer.C():
		case <-m.sched.wake:
		}
	}
}

// pass replays what is due and expires calls past their deadline, at the
// clock's now, and returns when to look next.
func (m *Monitor) pass() (now, next time.Time) {
	m.mu.Lock()
	now = m.cfg.clock.Now()
	for k := m.keys.Earliest(); k != nil && m.state == running && !k.Due().After(now); k = m.keys.Earliest() {
		m.replay(k)
	}
	stuck := m.expire(now)
	m.changed()
	overruns := overruns(stuck)
	next = m.wakeAt()
	// Recorded now, under the lock: a change from here on that needs an
	// earlier wake compares against it, and pokes.
	m.sched.armed, m.sched.set = next, false
	m.mu.Unlock()
	m.reportOverruns(overruns, now)
	return now, next
}

// leaveScheduler ends the scheduler, its timer stopped, unless something
// came to time meanwhile.
func (m *Monitor) leaveScheduler() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.wakeAt().IsZero() {
		return false
	}
	m.sched.running, m.sched.armed, m.sched.set = false, time.Time{}, false
	m.cond.Broadcast()
	return true
}

// replay starts k's backoff replay. mu is held.
func (m *Monitor) replay(k *keyq.Key[item]) {
	m.keys.Replay(k)
	m.stats.Retried++
}

// overrun is a call that newly passed its deadline and grace, as its log
// line tells it.
type overrun struct {
	key      string
	started  time.Time
	replaced bool // a new worker took its worker's place
	limited  bool // WithMaxOverruns was reached: it keeps its worker
}

// expire ends the context of calls past their deadline and, after the
// grace, marks them overrunning. It returns those newly overrunning. mu is
// held.
func (m *Monitor) expire(now time.Time) []*call {
	var stuck []*call
	for c := m.calls.head; c != nil; c = c.next {
		if c.deadline.IsZero() || now.Before(c.deadline) {
			continue
		}
		if c.stage == inTime {
			m.calls.setStage(c, late)
			c.cancel(context.DeadlineExceeded)
		}
		if c.stage == late && !now.Before(m.overrunAt(c)) {
			m.calls.setStage(c, overran)
			stuck = append(stuck, c)
		}
	}
	return stuck
}

// replaceStuck gives the worker slots of overrunning calls to new workers,
// so that n keys keep moving with WithWorkers(n), while fewer than
// WithMaxOverruns calls have been replaced: each costs a goroutine until it
// returns. A call the bound left holding its slot is replaced once a
// replaced one returns. mu is held.
func (m *Monitor) replaceStuck() {
	if m.calls.stages[overran] == 0 || m.state == stopped {
		return
	}
	replaced := 0
	for c := m.calls.head; c != nil; c = c.next {
		if c.replaced && c.stage == overran {
			replaced++
		}
	}
	for c := m.calls.head; c != nil && replaced < m.cfg.maxOverruns; c = c.next {
		if c.stage == overran && c.slot {
			c.replaced = true
			m.calls.freeSlot(c)
			replaced++
		}
	}
}

// overruns describes newly overrunning calls for the log. mu is held.
func overruns(stuck []*call) []overrun {
	var out []overrun
	for _, c := range stuck {
		out = append(out, overrun{key: c.key.Name(), started: c.start, replaced: c.replaced, limited: c.slot})
	}
	return out
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
