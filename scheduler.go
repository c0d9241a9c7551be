package eventmonitor

import (
	"context"
	"time"

	"github.com/containerd/log"
	"k8s.io/utils/clock"
)

// The scheduler is one goroutine, started by the first thing to time and
// ended by Stop. Each pass, under mu, it retries the keys whose backoff is
// due, ends the ctx of calls past their deadline, marks those past the
// grace as overran (giving their worker slots to new workers), and sets
// one clock timer for whatever comes next: none when nothing does.

// scheduler is guarded by Monitor.mu.
type scheduler struct {
	state schedulerState
	poked bool          // a change the loop has yet to see
	armed time.Time     // when its timer fires; zero: no timer
	wake  chan struct{} // makes the loop run a pass now
}

type schedulerState uint8

const (
	notStarted schedulerState = iota
	looping
	exited
)

// wakeBy makes the scheduler run a pass by t, if its timer is not set
// earlier. mu is held.
func (m *Monitor) wakeBy(t time.Time) {
	if s := &m.sched; s.armed.IsZero() || t.Before(s.armed) {
		m.poke()
	}
}

// retime pokes the scheduler when a retry is due before its timer, or when
// its timer is set with nothing left to time. mu is held.
func (m *Monitor) retime() {
	var next time.Time
	if m.state == running {
		next = m.keys.nextDue()
	}
	switch s := &m.sched; {
	case !next.IsZero():
		m.wakeBy(next)
	case len(m.calls) == 0 && !s.armed.IsZero():
		m.poke()
	}
}

// poke makes the scheduler run a pass now, starting it the first time.
// mu is held.
func (m *Monitor) poke() {
	s := &m.sched
	switch s.state {
	case exited:
		return
	case notStarted:
		s.state, s.wake = looping, make(chan struct{}, 1)
		m.work.Add(1)
		go m.schedule()
	}
	s.poked = true
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// schedule is the scheduler's loop: a pass each time its timer fires or it
// is poked, until Stop has left nothing to time.
func (m *Monitor) schedule() {
	defer m.work.Done()
	var timer clock.Timer
	for {
		m.mu.Lock()
		now := m.cfg.clock.Now()
		if m.state == running {
			m.keys.retryDue(now, false)
		}
		lines := m.expire(now)
		m.changed()
		s := &m.sched
		s.poked = false // what changed started is timed below
		select {
		case <-s.wake:
		default:
		}
		if timer != nil {
			timer.Stop()
		}
		timer, s.armed = nil, m.nextWake()
		var fired <-chan time.Time
		if !s.armed.IsZero() {
			timer = m.cfg.clock.NewTimer(s.armed.Sub(now))
			fired = timer.C()
		}
		if m.cfg.clock.Since(now) > time.Millisecond {
			m.poke() // a fake clock stepped during the pass: the timer may be late
		}
		done := m.state == stopped && len(m.calls) == 0
		if done {
			s.state = exited
		}
		m.mu.Unlock()
		m.logOverruns(lines)
		if done {
			return
		}
		select {
		case <-fired:
		case <-s.wake:
		}
	}
}

// nextWake is when the scheduler must run next: zero for never. mu is held.
func (m *Monitor) nextWake() (at time.Time) {
	earlier := func(t time.Time) {
		if at.IsZero() || t.Before(at) {
			at = t
		}
	}
	if next := m.keys.nextDue(); !next.IsZero() && m.state == running {
		earlier(next)
	}
	for _, c := range m.calls {
		switch {
		case c.ctx.deadline.IsZero():
		case c.state == inTime:
			earlier(c.ctx.deadline)
		case c.state == late:
			earlier(m.overrunAt(c))
		}
	}
	return at
}

// overrunAt is when a call past its deadline counts as stuck. The grace
// spares a handler whose own equal timeout began a moment after ours, and
// still finds a stuck call within a second.
func (m *Monitor) overrunAt(c *call) time.Time {
	return c.ctx.deadline.Add(min(time.Second, m.cfg.handleTimeout/10))
}

// overrun is the log line of a call newly past its grace.
type overrun struct {
	key      string
	running  time.Duration
	replaced bool // it gave its slot to a new worker
	limited  bool // it kept its slot as WithMaxOverruns calls have given theirs
}

// expire ends the ctx of calls past their deadline, marks those past the
// grace overran, and gives their slots to new workers while fewer than
// WithMaxOverruns calls have given theirs (none once stopped). It returns
// the newly overran calls' log lines. mu is held.
func (m *Monitor) expire(now time.Time) (lines []overrun) {
	replaced := 0
	var stuck []*call
	for _, c := range m.calls {
		if c.state == inTime && !c.ctx.deadline.IsZero() && !now.Before(c.ctx.deadline) {
			c.state = late
			c.cancel(context.DeadlineExceeded)
		}
		if c.state == late && !now.Before(m.overrunAt(c)) {
			c.state = overran
			stuck = append(stuck, c)
		}
		if c.slot == gaveSlot {
			replaced++
		}
	}
	for _, c := range m.calls {
		if c.state == overran && c.slot == ownSlot && replaced < m.cfg.maxOverruns && m.state != stopped {
			c.slot = gaveSlot
			replaced++
		}
	}
	for _, c := range stuck {
		lines = append(lines, overrun{key: c.key.name, running: now.Sub(c.start), replaced: c.slot == gaveSlot,
			limited: c.slot == ownSlot && m.cfg.maxOverruns > 0 && m.state != stopped})
	}
	return lines
}

// logOverruns logs expire's lines, without mu.
func (m *Monitor) logOverruns(lines []overrun) {
	for _, o := range lines {
		entry := m.cfg.logger.WithFields(log.Fields{"key": o.key, "running": o.running, "replaced": o.replaced})
		entry.Warn("event handler overran its timeout; its key stays held until it returns")
		if o.limited {
			entry.WithField("limit", m.cfg.maxOverruns).
				Error("too many handler calls overrunning their timeout (WithMaxOverruns): this one keeps its worker until a replaced call returns")
		}
	}
}
