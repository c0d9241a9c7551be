package keyq

import "container/heap"

// fifo is a queue on a slice that reuses its array: pop advances a head
// index, and a full array whose first half is dead slides its live items
// down rather than growing, so a key's backlog under a steady flow keeps
// one array.
type fifo[T any] struct {
	items []T
	head  int
}

func (q *fifo[T]) len() int { return len(q.items) - q.head }
func (q *fifo[T]) all() []T { return q.items[q.head:] }

func (q *fifo[T]) push(v T) {
	if len(q.items) == cap(q.items) && q.head > 0 && q.head >= len(q.items)/2 {
		n := copy(q.items, q.items[q.head:])
		clear(q.items[n:])
		q.items, q.head = q.items[:n], 0
	}
	q.items = append(q.items, v)
}

// pushFront puts v back at the head, where a failed event returns to.
func (q *fifo[T]) pushFront(v T) {
	if q.head == 0 {
		var zero T
		q.items = append(q.items, zero)
		copy(q.items[1:], q.items)
		q.head = 1
	}
	q.head--
	q.items[q.head] = v
}

// pop removes the head; the queue must not be empty.
func (q *fifo[T]) pop() T {
	var zero T
	v := q.items[q.head]
	q.items[q.head] = zero // the event is the caller's now, not the array's
	q.head++
	if q.head == len(q.items) {
		q.items, q.head = q.items[:0], 0
	}
	return v
}

func (q *fifo[T]) takeAll() []T {
	items := append([]T(nil), q.all()...)
	*q = fifo[T]{}
	return items
}

// runQueue is the Ready keys in the order they became ready, linked
// through the keys so that Forget takes one out in O(1).
type runQueue[T any] struct{ head, tail *Key[T] }

func (r *runQueue[T]) push(k *Key[T]) {
	k.prev, k.next = r.tail, nil
	if r.tail == nil {
		r.head = k
	} else {
		r.tail.next = k
	}
	r.tail = k
}

func (r *runQueue[T]) remove(k *Key[T]) {
	if k.prev == nil {
		r.head = k.next
	} else {
		k.prev.next = k.next
	}
	if k.next == nil {
		r.tail = k.prev
	} else {
		k.next.prev = k.prev
	}
	k.prev, k.next = nil, nil
}

// dueHeap is the Waiting keys, earliest due first; each key knows its
// index so that Forget takes one out in O(log n).
type dueHeap[T any] []*Key[T]

func (h dueHeap[T]) Len() int           { return len(h) }
func (h dueHeap[T]) Less(i, j int) bool { return h[i].backoff.due.Before(h[j].backoff.due) }
func (h dueHeap[T]) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *dueHeap[T]) Push(x any) {
	k := x.(*Key[T])
	k.index = len(*h)
	*h = append(*h, k)
}
func (h *dueHeap[T]) Pop() any {
	old := *h
	k := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	k.index = -1
	return k
}

func (h *dueHeap[T]) add(k *Key[T])    { heap.Push(h, k) }
func (h *dueHeap[T]) remove(k *Key[T]) { heap.Remove(h, k.index) }
