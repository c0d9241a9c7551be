package eventmonitor

import (
	"container/heap"
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// keyState is where a key is. A key with nothing queued and no call in
// progress is idle: it is not in keySet at all.
type keyState uint8

const (
	keyReady   keyState = iota // events queued, in the run queue for a worker
	keyRunning                 // a handler call of its head event is in progress
	keyWaiting                 // in backoff: in the heap until its due time
)

// item is one accepted event in its key's queue; what only some need is
// behind pointers, as queues hold many.
type item struct {
	event  any
	origin *origin  // the envelope it came in; nil for Submit, Backoff and exits
	failed *failure // nil until the event fails, or is given to Backoff
}

// failure is an event's failed handler calls so far. It is replaced, not
// changed: a report may still read the one before without the lock.
type failure struct {
	attempts int // Backoff counts one
	first    time.Time
	last     error // nil for an event given to Backoff
}

func (it item) attempts() int {
	if it.failed == nil {
		return 0
	}
	return it.failed.attempts
}

// origin is the envelope an event came in: its topic and namespace for drop
// and log lines, its timestamp for the handler's ctx.
type origin struct {
	topic, namespace string
	at               time.Time
}

func (it item) from() (topic, namespace string) {
	if it.origin == nil {
		return "", ""
	}
	return it.origin.topic, it.origin.namespace
}

// key is one key's FIFO queue and state.
type key struct {
	name   string
	state  keyState
	events []item // queued, head first; a running call's event is not here
	// due: while waiting, when the key retries; while running, when it
	// must wait once its call ends (Backoff during the call), zero if not.
	due        time.Time
	prev, next *key // run queue links, while ready
	index      int  // heap index, while waiting
}

// backoffPolicy computes delays: initial × 2^(attempts−1), capped at max,
// spread by ±jitter.
type backoffPolicy struct {
	initial, max time.Duration
	jitter       float64
}

// delay is how long an event that failed attempts times waits.
func (p backoffPolicy) delay(attempts int) time.Duration {
	d := p.initial
	for i := 1; i < attempts && d < p.max; i++ {
		d = doubled(d, p.max)
	}
	return min(d, p.max)
}

// dueAfter is now plus d spread by the jitter, saturating rather than
// overflowing.
func (p backoffPolicy) dueAfter(now time.Time, d time.Duration) time.Time {
	if p.jitter > 0 {
		spread := float64(d) * (1 + p.jitter*(2*rand.Float64()-1))
		if spread >= math.MaxInt64 { // float64(math.MaxInt64) is 2^63: no Duration
			d = math.MaxInt64
		} else {
			d = time.Duration(max(1, spread))
		}
	}
	return now.Add(d)
}

// doubled is 2d capped at limit, without overflowing.
func doubled(d, limit time.Duration) time.Duration {
	if d > limit/2 {
		return limit
	}
	return 2 * d
}

// keySet holds every key that is not idle: ready keys in a FIFO run queue,
// waiting keys in a heap by due time. It has no lock and no clock: the
// monitor serialises every call and passes the time in.
type keySet struct {
	policy   backoffPolicy
	byName   map[string]*key
	run      runQueue
	due      dueHeap
	queued   int // events in every key's queue
	inHeap   int // of queued, those of waiting keys
	maxQueue int // per key, counting a running call's event; 0: no bound
}

func newKeySet(p backoffPolicy, maxQueue int) *keySet {
	return &keySet{policy: p, byName: make(map[string]*key), maxQueue: maxQueue}
}

// full reports whether name holds maxQueue events, its call's included.
func (s *keySet) full(name string) bool {
	k := s.byName[name]
	if k == nil || s.maxQueue == 0 {
		return false
	}
	n := len(k.events)
	if k.state == keyRunning {
		n++
	}
	return n >= s.maxQueue
}

// push appends it to name's queue; an idle key becomes ready.
func (s *keySet) push(name string, it item) *key {
	k := s.byName[name]
	if k == nil {
		k = &key{name: name, index: -1}
		s.byName[name] = k
		s.run.push(k)
	}
	k.events = append(k.events, it)
	s.queued++
	if k.state == keyWaiting {
		s.inHeap++
	}
	return k
}

// pushBackoff appends it to name's queue and makes the key wait the
// initial delay from now, if it does not wait already: at once if it is
// ready, once its call ends if it is running.
func (s *keySet) pushBackoff(name string, it item, now time.Time) {
	k := s.push(name, it)
	due := s.policy.dueAfter(now, s.policy.initial)
	switch {
	case k.state == keyReady:
		s.run.remove(k)
		s.wait(k, due)
	case k.state == keyRunning && k.due.IsZero():
		k.due = due
	}
}

// anyReady tells whether a key is ready.
func (s *keySet) anyReady() bool { return s.run.head != nil }

// take makes the first ready key running and returns it with its head
// event; nil if no key is ready.
func (s *keySet) take() (*key, item) {
	k := s.run.head
	if k == nil {
		return nil, item{}
	}
	s.run.remove(k)
	return k, s.pop(k)
}

// takeAlone takes k as take would if its one event was just pushed to an
// idle key, so that nothing of the key comes before it.
func (s *keySet) takeAlone(k *key) (item, bool) {
	if k.state != keyReady || len(k.events) != 1 {
		return item{}, false
	}
	s.run.remove(k)
	return s.pop(k), true
}

func (s *keySet) pop(k *key) item {
	k.state = keyRunning
	it := k.events[0]
	k.events[0] = item{} // the array no longer holds the event
	if len(k.events) == 1 {
		k.events = k.events[:0] // reused from its start by a key that keeps up
	} else {
		k.events = k.events[1:]
	}
	s.queued--
	return it
}

// done ends k's call: its event was handled or given up on. The key waits
// if Backoff came during the call, goes to the back of the run queue if it
// holds events (keys take turns, an event each), or becomes idle.
func (s *keySet) done(k *key) {
	switch {
	case !k.due.IsZero():
		s.wait(k, k.due)
	case len(k.events) > 0:
		s.run.push(k)
	default:
		delete(s.byName, k.name)
	}
}

// failed ends k's call with it back at the head of its queue, the key
// waiting the delay of its failures from now (not less than a wait that
// Backoff asked for during the call).
func (s *keySet) failed(k *key, it item, now time.Time) time.Duration {
	k.events = slices.Insert(k.events, 0, it) // failures are rare: a copy is fine
	s.queued++
	d := s.policy.delay(it.attempts())
	due := s.policy.dueAfter(now, d)
	if k.due.After(due) {
		due = k.due
	}
	s.wait(k, due)
	return d
}

func (s *keySet) wait(k *key, due time.Time) {
	k.state, k.due = keyWaiting, due
	heap.Push(&s.due, k)
	s.inHeap += len(k.events)
}

func (s *keySet) unwait(k *key) {
	heap.Remove(&s.due, k.index)
	s.inHeap -= len(k.events)
	k.due = time.Time{}
}

// retryDue makes every key due by now ready, or every waiting key if all.
func (s *keySet) retryDue(now time.Time, all bool) {
	for len(s.due) > 0 && (all || !s.due[0].due.After(now)) {
		k := s.due[0]
		s.unwait(k)
		s.run.push(k)
	}
}

// nextDue is when the earliest waiting key retries; zero if none waits.
func (s *keySet) nextDue() time.Time {
	if len(s.due) == 0 {
		return time.Time{}
	}
	return s.due[0].due
}

// forget removes and returns name's queued events. A running key stays
// running, and will not wait for a Backoff given during its call.
func (s *keySet) forget(name string) []item {
	k := s.byName[name]
	if k == nil {
		return nil
	}
	switch k.state {
	case keyReady:
		s.run.remove(k)
	case keyWaiting:
		s.unwait(k)
	}
	events := k.events
	s.queued -= len(events)
	k.events, k.due = nil, time.Time{}
	if k.state != keyRunning {
		delete(s.byName, name)
	}
	return events
}
