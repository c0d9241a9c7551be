// Package keyq is the monitor's data structure: each key's FIFO queue,
// phase and backoff, the run queue of ready keys and the heap of waiting
// ones. It has no locks, goroutines or clock (the monitor serialises every
// call and passes the time in), so every rule of a key's life is here,
// testable on plain times.
//
// A key is in exactly one phase:
//
//	Idle     nothing queued, not in backoff: the key is forgotten
//	Ready    events queued, in the run queue, waiting for a worker
//	Running  a handler call for its head event is in progress
//	Waiting  in backoff, in the heap until its due time
//
// Only Take and TakeAlone move a key to Running and only a call's end
// (Done, Failed) moves it out again, so a key is never on two goroutines
// (the monitor ends a call it abandons at Stop while its goroutine runs
// on, but takes no key once stopped).
//
// Backoff, rule by rule; a due time is the time passed in plus a delay:
//
//	Failed            the event goes back to the head and the key waits the
//	                  delay doubled (up to the cap) if the call was a
//	                  replay's first (the head of the queue that waited),
//	                  else the initial delay, so independent failures keep
//	                  moving
//	Replay (when due) the events then queued are the replay; events pushed
//	                  later wait behind it, outside it
//	Done (the         the key leaves backoff, its delay reset
//	replay's last)
//	PushBackoff       not in backoff: due the initial delay from the push
//	                  (a Running key waits once its call ends); waiting:
//	                  keeps its due time; replaying: waits again once the
//	                  replay is done, due the initial delay from the push
//	Forget            the key leaves backoff, at once if no replay's call
//	                  runs, else when that call ends: it is the replay's
//	                  last, and its failure is the replay's, as above
package keyq

import (
	"slices"
	"time"
)

// Phase is where a key is in its life; see the package doc.
type Phase uint8

const (
	Idle Phase = iota
	Ready
	Running
	Waiting
)

// Key is one key's queue and state; only Set changes it.
type Key[T any] struct {
	name    string
	phase   Phase
	items   []T      // in order; the head is the next to handle
	backoff *backoff // set while the key is in backoff: waiting or replaying
	prev    *Key[T]  // run queue links, while Ready
	next    *Key[T]
	index   int // in the heap, while Waiting
}

func (k *Key[T]) Name() string    { return k.name }
func (k *Key[T]) Phase() Phase    { return k.phase }
func (k *Key[T]) Len() int        { return len(k.items) }
func (k *Key[T]) Items() []T      { return k.items }
func (k *Key[T]) InBackoff() bool { return k.backoff != nil }

// Set holds every key that is not Idle.
type Set[T any] struct {
	delays  Delays
	keys    map[string]*Key[T]
	ready   runQueue[T]
	waiting dueHeap[T]

	// Gauges: uncount and count bracket every change to a key.
	events, backoffKeys, backoffEvents int
}

// New returns an empty Set.
func New[T any](d Delays) *Set[T] {
	return &Set[T]{delays: d, keys: make(map[string]*Key[T])}
}

// Get returns key's state, nil if it is Idle.
func (s *Set[T]) Get(name string) *Key[T] { return s.keys[name] }

// Keys calls fn for every key that is not Idle, in no order.
func (s *Set[T]) Keys(fn func(*Key[T])) {
	for _, k := range s.keys {
		fn(k)
	}
}

// Events is the number of events held, in backoff or not.
func (s *Set[T]) Events() int { return s.events }

// Queued is the number of events waiting outside backoff.
func (s *Set[T]) Queued() int { return s.events - s.backoffEvents }

// InBackoff is the number of keys in backoff and of the events they hold.
func (s *Set[T]) InBackoff() (keys, events int) { return s.backoffKeys, s.backoffEvents }

// HasReady reports whether a key waits in the run queue.
func (s *Set[T]) HasReady() bool { return s.ready.head != nil }

// Earliest is the waiting key due first, nil if none waits.
func (s *Set[T]) Earliest() *Key[T] {
	if len(s.waiting) == 0 {
		return nil
	}
	return s.waiting[0]
}

// Push appends it to key's queue. An Idle key becomes Ready.
func (s *Set[T]) Push(name string, it T) *Key[T] {
	k := s.keys[name]
	if k == nil {
		k = &Key[T]{name: name, index: -1}
		s.keys[name] = k
	}
	s.uncount(k)
	k.items = append(k.items, it)
	if k.phase == Idle {
		s.moveTo(k, Ready)
	}
	s.count(k)
	return k
}

// PushBackoff appends it to key's queue and puts the key in backoff, as
// the package doc's rule says.
func (s *Set[T]) PushBackoff(name string, it T, now time.Time) *Key[T] {
	k := s.Push(name, it)
	if b := k.backoff; b != nil {
		if k.replaying() && b.afterReplay.IsZero() {
			b.afterReplay = s.dueAfter(now, s.delays.Initial)
		}
		return k
	}
	s.uncount(k)
	k.backoff = &backoff{delay: s.delays.Initial, due: s.dueAfter(now, s.delays.Initial)}
	if k.phase == Ready {
		s.moveTo(k, Waiting)
	}
	s.count(k)
	return k
}

// Take moves the first Ready key to Running and returns it with its head
// event (nil if none is ready); replayStart: the event starts a replay.
func (s *Set[T]) Take() (k *Key[T], it T, replayStart bool) {
	if k = s.ready.head; k != nil {
		it, replayStart = s.take(k)
	}
	return k, it, replayStart
}

func (s *Set[T]) take(k *Key[T]) (it T, replayStart bool) {
	s.uncount(k)
	s.moveTo(k, Running)
	it = k.pop()
	if b := k.backoff; b != nil { // a Ready key in backoff is replaying
		replayStart = b.taken == 0
		b.replayLeft, b.taken = b.replayLeft-1, b.taken+1
	}
	s.count(k)
	return it, replayStart
}

// TakeAlone takes k, as Take would, if its one event is the one just
// pushed and it is not in backoff: nothing of the key comes before it, so
// the caller may handle it at once on its own goroutine.
func (s *Set[T]) TakeAlone(k *Key[T]) (it T, ok bool) {
	if k.phase != Ready || len(k.items) != 1 || k.backoff != nil {
		return it, false
	}
	it, _ = s.take(k)
	return it, true
}

// Done ends k's call, its event handled or given up on. After a replay's
// last call the key leaves backoff, then waits if PushBackoff came during
// the replay. A key with events left goes to the back of the run queue:
// keys take turns, an event each.
func (s *Set[T]) Done(k *Key[T]) {
	s.uncount(k)
	if b := k.backoff; k.inReplayCall() && b.replayLeft == 0 {
		k.backoff = nil
		if !b.afterReplay.IsZero() {
			k.backoff = &backoff{delay: s.delays.Initial, due: b.afterReplay}
		}
	}
	switch {
	case k.backoff != nil && k.backoff.replayLeft == 0: // given PushBackoff during the call, or afterReplay
		s.moveTo(k, Waiting)
	case len(k.items) > 0:
		s.moveTo(k, Ready)
	default:
		s.moveTo(k, Idle)
	}
	s.count(k)
}

// Failed ends k's call with its event it back at the head; the key waits
// from now, as the package doc's rule says. That wait replaces any that
// PushBackoff gave during the call or replay.
func (s *Set[T]) Failed(k *Key[T], it T, now time.Time) {
	s.uncount(k)
	k.items = slices.Insert(k.items, 0, it) // failures are rare: a copy is fine
	delay := s.delays.Initial
	if k.inReplayCall() && k.backoff.taken == 1 { // the replay's first call: the key still fails, so it waits longer
		delay = Doubled(k.backoff.delay, s.delays.Max)
	}
	k.backoff = &backoff{delay: delay, due: s.dueAfter(now, delay)}
	s.moveTo(k, Waiting)
	s.count(k)
}

// Replay makes Waiting k Ready, every event it holds now its replay.
func (s *Set[T]) Replay(k *Key[T]) {
	s.uncount(k)
	k.backoff.replayLeft, k.backoff.taken = len(k.items), 0
	s.moveTo(k, Ready)
	s.count(k)
}

// Forget removes and returns key's queued events, in order; the key leaves
// backoff, as the package doc says. A Running key stays Running until its
// call ends.
func (s *Set[T]) Forget(name string) []T {
	k := s.keys[name]
	if k == nil {
		return nil
	}
	s.uncount(k)
	items := k.items
	switch {
	case k.phase != Running:
		s.moveTo(k, Idle) // first: the heap orders keys by their backoff's due time
		k.backoff = nil
	case k.inReplayCall():
		k.backoff.replayLeft, k.backoff.afterReplay = 0, time.Time{}
	default:
		k.backoff = nil
	}
	k.items = nil
	s.count(k)
	return items
}

// moveTo changes k's phase, and its place in the run queue, heap and map.
func (s *Set[T]) moveTo(k *Key[T], p Phase) {
	switch k.phase {
	case Ready:
		s.ready.remove(k)
	case Waiting:
		s.waiting.remove(k)
	}
	k.phase = p
	switch p {
	case Ready:
		s.ready.push(k)
	case Waiting:
		s.waiting.add(k)
	case Idle:
		k.items = nil // a burst's array is not kept
		delete(s.keys, k.name)
	}
}

// pop removes the head event. An emptied array is reused from its start;
// otherwise append's next growth leaves the part popped behind.
func (k *Key[T]) pop() T {
	var zero T
	it := k.items[0]
	k.items[0] = zero // the event is the caller's now, not the array's
	if len(k.items) == 1 {
		k.items = k.items[:0]
	} else {
		k.items = k.items[1:]
	}
	return it
}

func (s *Set[T]) count(k *Key[T])   { s.gauge(k, 1) }
func (s *Set[T]) uncount(k *Key[T]) { s.gauge(k, -1) }

func (s *Set[T]) gauge(k *Key[T], sign int) {
	s.events += sign * len(k.items)
	if k.backoff != nil {
		s.backoffKeys += sign
		s.backoffEvents += sign * len(k.items)
	}
}
