package eventmonitor

import (
	"context"
	"time"

	"github.com/containerd/log"
	"k8s.io/utils/clock"
)

// The scheduler times two things: backoff queues coming due (reconcile
// replays them) and calls reaching their deadline (expire ends their ctx)
// or overrunning it. One clock timer is set for the earliest, under mu, by
// whoever changes what is due (retime, from reconcile). One goroutine at a
// time (started with the first timer, ended by Stop, replaced if a log
// hook ends it) runs a pass each time the timer fires or it is poked. An
// idle monitor holds no timer.

// schedulerState is guarded by Monitor.mu.
type schedulerState struct {
	timer clock.Timer   // nil until there is something to time
	at    time.Time     // when timer fires; zero: stopped. Never later than wakeAt
	wake  chan struct{} // makes the scheduler run a pass now
}

// wakeAt is when the scheduler must run next (zero: never). mu is held.
func (m *Monitor) wakeAt() (at time.Time) {
	earlier := func(t time.Time) {
		if at.IsZero() || t.Before(at) {
			at = t
		}
	}
	if k := m.keys.Earliest(); k != nil && m.state == running {
		earlier(k.Due())
	}
	for _, c := range m.calls {
		switch {
		case c.deadline.IsZero():
		case c.runningIn(inTime):
			earlier(c.deadline)
		case c.runningIn(late):
			earlier(m.overrunAt(c))
		}
	}
	return at
}

// overrunAt is when a call past its deadline counts as stuck. The grace
// spares a handler whose own equal timeout started a moment after ours
// (containerd's are 10 s too), and still finds a stuck call within a second.
func (m *Monitor) overrunAt(c *call) time.Time {
	return c.deadline.Add(min(time.Second, m.cfg.handleTimeout/10))
}

// retime keeps the timer set no later than wakeAt, and stopped when there is
// nothing to time. A timer set earlier than needed is left: its pass sets
// it again. mu is held.
func (m *Monitor) retime() {
	at, s := m.wakeAt(), &m.sched
	switch {
	case at.IsZero():
		if !s.at.IsZero() {
			s.disarm()
		}
	case s.at.IsZero() || at.Before(s.at):
		m.arm(at)
	}
}

// arm sets the timer for at, starting the scheduler with the first timer.
// mu is held. Its care is for fake clocks, where a fire not read blocks
// the next Step, a timer set for a time passed fires only at the next Step,
// and a Step between reading the time and setting the timer leaves it late:
//   - Reset moves the timer in place (a test sees a timer all along);
//   - a fire Reset finds unread is discarded, and the scheduler poked: it
//     may have been this setting's; so is it for a time already passed;
//   - the timer is set again while the clock moved by a microsecond or
//     more meanwhile, up to armTries times (WaitIdle sets it right after).
func (m *Monitor) arm(at time.Time) {
	s := &m.sched
	var now time.Time
	discarded := false
	for tries := 0; tries < armTries; tries++ {
		now = m.cfg.clock.Now()
		if s.timer == nil {
			s.timer = m.cfg.clock.NewTimer(at.Sub(now))
			m.watchers.Add(1)
			go m.schedule(s.timer.C())
		} else if !s.timer.Reset(at.Sub(now)) && s.discardFire() {
			discarded = true
		}
		if m.cfg.clock.Since(now) < time.Microsecond {
			break
		}
	}
	s.at = at
	if discarded || !at.After(now) {
		m.poke()
	}
}

const armTries = 4

// overdue reports whether the timer is set for now or earlier: it fired and
// its pass is yet to run, or a fake clock passed it unseen. The timer is
// never later than what it times, so one not overdue leaves nothing due.
// mu is held.
func (s *schedulerState) overdue(now time.Time) bool {
	return !s.at.IsZero() && !s.at.After(now)
}

// disarm stops the timer. mu is held.
func (s *schedulerState) disarm() {
	s.at = time.Time{}
	if s.timer != nil && !s.timer.Stop() {
		s.discardFire()
	}
}

// discardFire takes a fire not yet read, reporting whether there was one.
// mu is held.
func (s *schedulerState) discardFire() bool {
	select {
	case <-s.timer.C():
		return true
	default:
		return false
	}
}

// poke makes the scheduler run a pass now.
func (m *Monitor) poke() {
	select {
	case m.sched.wake <- struct{}{}:
	default:
	}
}

// schedule is the scheduler's goroutine: a pass each time the timer fires or
// it is poked, until Stop left nothing to time.
func (m *Monitor) schedule(fired <-chan time.Time) {
	defer m.watchers.Done()
	for {
		timerFired := false
		select {
		case <-fired:
			timerFired = true
		case <-m.sched.wake:
		}
		m.mu.Lock()
		now := m.cfg.clock.Now()
		stuck := m.expire(now)
		switch {
		case m.sched.overdue(now): // due: reconcile sets the timer anew
			m.sched.disarm()
		case timerFired && !m.sched.at.IsZero(): // a stale fire, or the clock went back
			m.arm(m.sched.at)
		}
		m.reconcile() // gives stuck calls' slots to new workers
		lines := m.overruns(stuck, now)
		done := m.state == stopped && len(m.calls) == 0
		m.mu.Unlock()
		m.logOverruns(lines)
		if done {
			return
		}
	}
}

// expire ends the ctx of calls past their deadline and, after the grace,
// marks them overran, returning those newly so. mu is held.
func (m *Monitor) expire(now time.Time) (stuck []*call) {
	for _, c := range m.calls {
		if c.deadline.IsZero() || now.Before(c.deadline) || !c.runningIn(inTime, late) {
			continue
		}
		if c.stage == inTime {
			c.stage = late
			c.cancel(context.DeadlineExceeded)
		}
		if !now.Before(m.overrunAt(c)) {
			c.stage = overran
			stuck = append(stuck, c)
		}
	}
	return stuck
}

// replaceStuck gives the slots of overran calls to new workers, so that n
// keys keep moving with WithWorkers(n), while fewer than WithMaxOverruns
// calls are replaced: each costs a goroutine until it returns. mu is held.
func (m *Monitor) replaceStuck() {
	if m.state == stopped {
		return // no call starts: a slot is worth nothing
	}
	replaced := 0
	for _, c := range m.calls {
		if c.slot == gaveSlot && c.stage == overran {
			replaced++
		}
	}
	for _, c := range m.calls {
		if c.stage == overran && c.slot == ownSlot && replaced < m.cfg.maxOverruns {
			c.slot = gaveSlot
			replaced++
		}
	}
}

// overrun is the log line of a call newly stuck.
type overrun struct {
	fields  log.Fields
	limited bool // WithMaxOverruns was reached: it keeps its worker
}

// overruns are the log lines of the calls expire found stuck, once reconcile
// gave away what slots it may. mu is held.
func (m *Monitor) overruns(stuck []*call, now time.Time) (lines []overrun) {
	// No slot is given away at Stop, and with WithMaxOverruns(0) keeping
	// the worker is the user's choice: no limit was reached.
	limitReached := m.state != stopped && m.cfg.maxOverruns > 0
	for _, c := range stuck {
		lines = append(lines, overrun{limited: limitReached && c.slot == ownSlot, fields: log.Fields{
			"key": c.key.Name(), "running": now.Sub(c.start), "replaced": c.slot == gaveSlot}})
	}
	return lines
}

// logOverruns logs overruns' lines without mu: a log hook is user code. If
// a hook ends the scheduler's goroutine (runtime.Goexit), a new scheduler
// takes over; a hook's panic is the process's.
func (m *Monitor) logOverruns(lines []overrun) {
	onGoexit(func() {
		for _, o := range lines {
			entry := m.cfg.logger.WithFields(o.fields)
			entry.Warn("event handler overran its timeout; its key stays held until it returns or Stop abandons it")
			if o.limited {
				entry.WithField("limit", m.cfg.maxOverruns).
					Error("too many handler calls overrunning their timeout (WithMaxOverruns): this one keeps its worker until a replaced call returns")
			}
		}
	}, m.replaceScheduler)
}

// replaceScheduler hands the timer to a new scheduler, for one whose
// goroutine a log hook ended.
func (m *Monitor) replaceScheduler() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sched.disarm()
	m.sched.timer = nil // so that retime starts a new scheduler
	m.reconcile()
}
