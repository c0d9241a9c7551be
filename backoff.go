package eventmonitor

import (
	"container/heap"
	"math/rand/v2"
	"time"

	"github.com/containerd/log"
)

// dueHeap orders the keys waiting in backoff by due time. Each keyState
// knows its index, so Forget and Shutdown remove it in O(log n).
type dueHeap []*keyState

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].due < h[j].due }
func (h dueHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIndex, h[j].heapIndex = int32(i), int32(j)
}
func (h *dueHeap) Push(x any) {
	k := x.(*keyState)
	k.heapIndex = int32(len(*h))
	*h = append(*h, k)
}
func (h *dueHeap) Pop() any {
	old := *h
	k := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	k.heapIndex = -1
	return k
}

// add puts k in the heap; remove takes it out from wherever it is.
func (h *dueHeap) add(k *keyState)    { heap.Push(h, k) }
func (h *dueHeap) remove(k *keyState) { heap.Remove(h, int(k.heapIndex)) }

// nextDelay is the delay after a failed replay: doubled, capped.
func nextDelay(d, max time.Duration) time.Duration {
	if d >= max/2 {
		return max
	}
	return 2 * d
}

// jittered spreads d over ±fraction of itself.
func jittered(d time.Duration, fraction float64) time.Duration {
	if fraction == 0 {
		return d
	}
	j := time.Duration(float64(d) * fraction * (2*rand.Float64() - 1))
	if d+j <= 0 {
		return 1
	}
	return d + j
}

// wait puts k in the due heap at now + its (jittered) delay. mu is held.
func (m *Monitor) wait(k *keyState) {
	k.due = m.sinceEpoch() + jittered(k.delay, m.cfg.jitter)
	m.due.add(k)
	m.rearm(m.epoch.Add(k.due))
}

// startReplay takes k out of the heap: the events it holds now are the
// replay, handled in order until one fails. mu is held.
func (m *Monitor) startReplay(k *keyState) {
	m.due.remove(k)
	k.replayLeft = int32(k.queue.len())
	k.replayStarting, k.replayProgressed = true, false
	m.stats.Retried++
	m.recount(k)
	m.schedule(k)
}

// retry is a replay about to start, as its log line tells it.
type retry struct {
	key    string
	events int
	delay  time.Duration
	trail  trail // the first event's, copied under mu
}

// logRetry logs the start of a replay, from the worker that runs it, just
// before its first call: the line comes before that call's outcome. A key
// replays at most once per backoff delay, so a key that keeps failing
// cannot flood the log.
func (m *Monitor) logRetry(r retry) {
	fields := log.Fields{"key": r.key, "attempt": int(r.trail.attempts) + 1, "events": r.events, "delay": r.delay}
	if r.trail.topic != "" {
		fields["topic"], fields["namespace"] = r.trail.topic, r.trail.namespace
	}
	entry := m.cfg.logger.WithFields(fields)
	if r.trail.lastErr != nil {
		// Not "error": the line announces a retry, and the failure is the
		// one that put the key in backoff, not this retry's.
		entry = entry.WithField("previous_error", r.trail.lastErr.Error())
	}
	entry.Info("retrying backed-off events")
}

// rearm makes the scheduler wake by t if it would wake later. mu is held.
func (m *Monitor) rearm(t time.Time) {
	if m.armed && !t.Before(m.wakeAt) {
		return
	}
	m.armed, m.wakeAt = true, t
	m.wakeScheduler()
}

// wakeScheduler makes the scheduler look at the heap and the calls again
// and re-arm its timer; WaitIdle waits until it has. mu is held.
func (m *Monitor) wakeScheduler() {
	m.wakes++
	select {
	case m.wake <- struct{}{}:
	default:
	}
}

// clockSlack is how far a clock may move while the scheduler arms its timer
// and still be trusted after maxRearms tries: far above a real clock's drift
// over a few instructions, far below any backoff delay.
const (
	clockSlack = time.Millisecond
	maxRearms  = 2
)

// scheduler owns the monitor's one timer. It wakes at the earliest of the
// next backoff due time and the oldest running call's deadline, so an idle
// monitor costs nothing however many keys wait in backoff, and a retry runs
// as soon as it is due rather than at the next tick of a periodic scan.
func (m *Monitor) scheduler() {
	defer close(m.schedulerDone)
	timer := m.cfg.clock.NewTimer(time.Hour)
	defer timer.Stop()
	rearms := 0
	for {
		m.mu.Lock()
		seen := m.wakes
		now := m.cfg.clock.Now()
		for !m.held && len(m.due) > 0 && m.due[0].due <= now.Sub(m.epoch) {
			m.startReplay(m.due[0])
		}
		overruns := m.expireCalls(now)
		m.armed = false
		if len(m.due) > 0 && !m.held {
			m.armed, m.wakeAt = true, m.epoch.Add(m.due[0].due)
		}
		if at, ok := m.calls.nextWake(); ok && m.cfg.handleTimeout > 0 && (!m.armed || at.Before(m.wakeAt)) {
			m.armed, m.wakeAt = true, at
		}
		armed, wakeAt := m.armed, m.wakeAt
		m.mu.Unlock()

		m.reportOverruns(overruns, now)
		// Drain before Reset: a FakeClock timer's channel holds one value and
		// its Step blocks on a second.
		if !timer.Stop() {
			select {
			case <-timer.C():
			default:
			}
		}
		if armed {
			timer.Reset(wakeAt.Sub(now))
			// Reset is relative to the clock's time when it runs. If the
			// clock moved since now was read, the timer is late by that
			// much (and a fake timer whose target has passed never fires),
			// so look again. A real clock always moves a little: after a
			// few tries, a move under clockSlack is accepted.
			if moved := m.cfg.clock.Since(now); moved > 0 && (moved >= clockSlack || rearms < maxRearms) {
				rearms++
				continue
			}
		}
		rearms = 0
		m.mu.Lock()
		if m.armedFor = seen; m.armedFor == m.wakes {
			m.signalProgress() // the timer is as the heap and the calls want it: WaitIdle may return
		}
		m.mu.Unlock()
		select {
		case <-timer.C():
		case <-m.wake:
		case <-m.quit:
			return
		}
	}
}
