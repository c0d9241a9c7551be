package eventmonitor

// fifo is a slice-backed queue that reuses its array: popping advances a head
// index, and the dead prefix is reclaimed when the array is full, so a queue
// that never fully drains does not leak its past.
type fifo[T any] struct {
	items []T
	head  int
}

func (q *fifo[T]) len() int { return len(q.items) - q.head }

func (q *fifo[T]) push(v T) {
	if len(q.items) == cap(q.items) && q.head > 0 {
		q.reclaim()
	}
	q.items = append(q.items, v)
}

// reclaim drops the dead prefix of a full array. It slides the live items
// down in place only when at least half the array is dead; otherwise it
// moves them to an array twice their number. Either way each copy buys as
// many free slots as it moves items, so a queue that is pushed and popped
// as a sliding window (a key's backlog under a flood) copies each item O(1)
// times, not once per few pops.
func (q *fifo[T]) reclaim() {
	live := q.items[q.head:]
	if q.head >= len(live) {
		n := copy(q.items, live)
		clear(q.items[n:])
		q.items, q.head = q.items[:n], 0
		return
	}
	grown := make([]T, len(live), 2*len(live))
	copy(grown, live)
	q.items, q.head = grown, 0
}

// pushFront puts v back at the head, where a failed event returns to.
func (q *fifo[T]) pushFront(v T) {
	if q.head > 0 {
		q.head--
		q.items[q.head] = v
		return
	}
	var zero T
	q.items = append(q.items, zero)
	copy(q.items[1:], q.items)
	q.items[0] = v
}

// pop removes the head; the queue must not be empty.
func (q *fifo[T]) pop() T {
	var zero T
	v := q.items[q.head]
	q.items[q.head] = zero // let the GC have the event
	q.head++
	if q.head == len(q.items) {
		q.items, q.head = q.items[:0], 0
	}
	return v
}

func (q *fifo[T]) peek() T { return q.items[q.head] }

// all returns the queued values in order, without removing them.
func (q *fifo[T]) all() []T { return q.items[q.head:] }
