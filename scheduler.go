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
// set for the earliest of the two (100 000 keys in backoff cost one timer,
// and no scan). It runs only while there is something to time.

// schedulerState is guarded by Monitor.mu.
type schedulerState struct {
	running bool          // a scheduler goroutine runs
	armed   time.Time     // when its timer fires, from its last look; zero: none
	set     bool          // its timer is set for armed
	wake    chan struct{} // makes it look again
}

// clockSlack is how far the clock may move while the scheduler sets its
// timer, which is then that much late: nothing next to any delay, while a
// fake clock stepped meanwhile makes it look again.
const clockSlack = time.Millisecond

// wakeAt is when the scheduler must look next (zero: never): the first
// retry due unless held or stopping, the first deadline of a call in time,
// the first end of grace of a call past its deadline. Calls are in start
// order, so the first of a stage is its earliest. mu is held.
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

// overrunAt is when a call past its deadline counts as stuck. The grace
// spares a handler whose own equal timeout started a moment after ours
// (containerd's keep one), and still finds a stuck call within a second.
func (m *Monitor) overrunAt(c *call) time.Time {
	return c.deadline.Add(min(time.Second, m.cfg.handleTimeout/10))
}

// retime starts the scheduler when there is something to time, or pokes
// it when it must wake earlier or not at all. A timer later than needed is
// left: it fires early and is set again. mu is held.
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

// timerRight reports whether the timer is exactly as wakeAt wants it, for
// WaitIdle. mu is held.
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
		// Reset counts from the clock's time when it runs: if the clock has
		// moved since now, look again (a fake timer whose target passed
		// never fires).
		if moved := m.cfg.clock.Since(now); moved >= clockSlack || moved > 0 && spins < 2 {
			spins++
			continue
		}
		spins = 0
		m.mu.Lock()
		m.sched.set = m.sched.armed.Equal(at)
		m.cond.Broadcast() // WaitIdle may wait for the timer
		m.mu.Unlock()
		select {
		case <-timer.C():
		case <-m.sched.wake:
		}
	}
}

// pass replays what is due and expires calls past their deadline, and
// returns the clock's now and when to look next.
func (m *Monitor) pass() (now, next time.Time) {
	m.mu.Lock()
	now = m.cfg.clock.Now()
	for k := m.keys.Earliest(); k != nil && m.state == running && !k.Due().After(now); k = m.keys.Earliest() {
		m.replay(k)
	}
	overruns := m.expire(now)
	m.changed()
	next = m.wakeAt()
	// Recorded under this lock: a change needing an earlier wake compares
	// against it, and pokes.
	m.sched.armed, m.sched.set = next, false
	m.mu.Unlock()
	for _, o := range overruns {
		entry := m.cfg.logger.WithFields(o.fields)
		entry.Warn("event handler overran its timeout; its key stays held until it returns")
		if o.limited {
			entry.WithField("limit", m.cfg.maxOverruns).
				Error("too many handler calls overrunning their timeout (WithMaxOverruns): this one keeps its worker")
		}
	}
	return now, next
}

// leaveScheduler ends the scheduler unless something came to time.
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

// overrun is the log line of a call newly past its deadline and grace.
type overrun struct {
	fields  log.Fields
	limited bool // WithMaxOverruns was reached: it keeps its worker
}

// expire ends the context of calls past their deadline and, after the
// grace, marks them overran and has replaceStuck give their slots to new
// workers. mu is held.
func (m *Monitor) expire(now time.Time) []overrun {
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
	m.replaceStuck()
	var out []overrun
	for _, c := range stuck {
		// At Stop no slot is given away, and no limit was reached.
		out = append(out, overrun{limited: c.slot && m.state != stopped, fields: log.Fields{
			"key": c.key.Name(), "running": now.Sub(c.start), "replaced": c.replaced}})
	}
	return out
}

// replaceStuck gives the worker slots of overran calls to new workers, so
// that n keys keep moving with WithWorkers(n), while fewer than
// WithMaxOverruns calls are replaced: each costs a goroutine until it
// returns. One the bound left holding its slot is replaced once a replaced
// one returns. mu is held.
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
