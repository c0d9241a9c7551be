package eventmonitor

import "time"

// item is one accepted event waiting in its key's queue. It is kept to two
// words because queues hold many of them: what only logs and metrics need
// lives behind trail, which stays nil for an event submitted directly that
// has not failed yet.
type item struct {
	event any
	trail *trail
}

// trail is where an event came from and how it has fared. Every key in
// backoff holds one: it is kept to 64 bytes.
type trail struct {
	topic, namespace string        // the envelope's, for logs; "" for Submit
	lastErr          error         // the latest failure, for the retry's log line
	failedAt         time.Duration // first failure, since the monitor's epoch, for Metrics.Recovered
	attempts         int32         // failed handler calls so far
	shared           bool          // one stream's events of this origin share it; never changed
}

func (it item) attempts() int {
	if it.trail == nil {
		return 0
	}
	return int(it.trail.attempts)
}

// origin is the topic and namespace of the envelope the event came in; ""
// for events from Submit, Backoff and WatchExit.
func (it item) origin() (topic, namespace string) {
	if it.trail == nil {
		return "", ""
	}
	return it.trail.topic, it.trail.namespace
}

// drop is a Drop of this event alone, saying where it came from.
func (it item) drop(key string, reason error) Drop {
	d := Drop{Key: key, Events: []any{it.event}, Reason: reason}
	d.Topic, d.Namespace = it.origin()
	return d
}

// failed records one more failed call, returning err at now (since the
// monitor's epoch).
func (it *item) failed(now time.Duration, err error) {
	if it.trail == nil {
		it.trail = &trail{}
	} else if it.trail.shared {
		it.trail = &trail{topic: it.trail.topic, namespace: it.trail.namespace}
	}
	if it.trail.attempts == 0 {
		it.trail.failedAt = now
	}
	it.trail.attempts++
	it.trail.lastErr = err
}

// keyState is everything the monitor knows about one key; every key in
// backoff holds one, so it is kept to 112 bytes. A key exists in
// Monitor.keys while it holds events, runs, or is in backoff, and for a while
// after it goes idle (see maxIdleKeys).
//
// A key is in exactly one of these places at a time: idle, in the run queue
// (ready), in a handler call (running), or in the due heap (heapIndex >= 0).
// That is what keeps one key on one goroutine.
type keyState struct {
	key       string
	queue     fifo[item]
	running   *handlerContext     // the call handling the key's event, nil if none
	due       time.Duration       // when the queue replays, since the monitor's epoch
	delay     time.Duration       // current backoff delay; 0 outside backoff
	idleLink  listLinks[keyState] // in Monitor.idleKeys while idle
	heapIndex int32

	// replayLeft counts the events at the head of the queue that belong to
	// the replay in progress; replayInFlight is set while one of them is in
	// a handler call. When both are done the key leaves backoff.
	replayLeft int32

	// countedEvents is what this key adds to Monitor.eventsInBackoff, and
	// countedInBackoff whether it adds to keysInBackoff; recount keeps them.
	countedEvents int32

	// The flags sit together so that they share one word: every waiting key
	// carries this struct.
	ready            bool
	replayInFlight   bool
	replayStarting   bool // the replay's first call is yet to start
	replayProgressed bool // the replay in progress has handled an event
	countedInBackoff bool
}

func (k *keyState) links() *listLinks[keyState] { return &k.idleLink }

func (k *keyState) inBackoff() bool {
	return k.heapIndex >= 0 || k.replayLeft > 0 || k.replayInFlight
}

// idle reports whether k can be forgotten: nothing queued, running or due.
func (k *keyState) idle() bool {
	return k.running == nil && !k.ready && k.queue.len() == 0 && !k.inBackoff()
}

// maxIdleKeys bounds how many idle keys stay in Monitor.keys. A key that
// gets events again soon (the common case: one container's start, exit and
// delete) then costs neither a map insert and delete nor an allocation; a
// key that does not is evicted once maxIdleKeys newer ones went idle.
const maxIdleKeys = 1024

// maxIdleQueue is the largest queue array an idle key keeps for reuse.
const maxIdleQueue = 256

// keyFor returns key's state, creating it if needed. mu is held.
func (m *Monitor) keyFor(key string) *keyState {
	if k, ok := m.keys[key]; ok {
		if m.listedIdle(k) {
			m.idleKeys.remove(k)
		}
		return k
	}
	var k *keyState
	if m.idleKeys.n >= maxIdleKeys {
		k = m.evictIdle() // the oldest idle key's state serves the new key
	} else {
		k = &keyState{heapIndex: -1}
	}
	k.key = key
	m.keys[key] = k
	return k
}

// releaseIfIdle lists k as idle if it is. mu is held.
func (m *Monitor) releaseIfIdle(k *keyState) {
	if m.listedIdle(k) || !k.idle() {
		return
	}
	k.due, k.delay, k.replayStarting = 0, 0, false
	if cap(k.queue.items) > maxIdleQueue {
		k.queue = fifo[item]{} // a burst's array is not kept for ever
	}
	m.idleKeys.push(k)
	if m.idleKeys.n > maxIdleKeys {
		m.evictIdle()
	}
}

// listedIdle reports whether k is in the idle list. mu is held.
func (m *Monitor) listedIdle(k *keyState) bool {
	return k.idleLink.prev != nil || m.idleKeys.head == k
}

// evictIdle forgets the key that has been idle longest and returns its state
// for reuse. mu is held.
func (m *Monitor) evictIdle() *keyState {
	k := m.idleKeys.head
	m.idleKeys.remove(k)
	delete(m.keys, k.key)
	k.key = ""
	return k
}

// recount brings the backoff gauges up to date with k's state after any
// change to it, and resets the delay of a key that has left backoff. mu is held.
func (m *Monitor) recount(k *keyState) {
	in := k.inBackoff()
	events := 0
	if in {
		events = k.queue.len()
	}
	m.eventsInBackoff += events - int(k.countedEvents)
	k.countedEvents = int32(events)
	if in != k.countedInBackoff {
		k.countedInBackoff = in
		if in {
			m.keysInBackoff++
		} else {
			m.keysInBackoff--
			k.delay = 0
		}
	}
}
