package eventmonitor

// fifo is a slice-backed queue that reuses its array: popping advances a head
// index, and the dead prefix is reclaimed when the array would otherwise grow,
// so a queue that never fully drains does not leak its past.
type fifo[T any] struct {
	items []T
	head  int
}

func (q *fifo[T]) len() int { return len(q.items) - q.head }

func (q *fifo[T]) push(v T) {
	if q.head > 0 && len(q.items) == cap(q.items) {
		n := copy(q.items, q.items[q.head:])
		clear(q.items[n:])
		q.items, q.head = q.items[:n], 0
	}
	q.items = append(q.items, v)
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
