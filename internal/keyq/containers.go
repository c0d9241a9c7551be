package keyq

import (
	"container/heap"
	"slices"
)

// fifo is a key's events in order. A pop moves start rather than the slice,
// so a push that finds the array full can move the events back to its
// front instead of growing it: a key that keeps a backlog keeps one array.
type fifo[T any] struct {
	items []T // items[start:] are queued; those before are zero
	start int
}

func (q *fifo[T]) len() int { return len(q.items) - q.start }
func (q *fifo[T]) all() []T { return q.items[q.start:] }

func (q *fifo[T]) push(it T) {
	if len(q.items) == cap(q.items) && q.start > 0 {
		n := copy(q.items, q.all())
		clear(q.items[n:])
		q.items, q.start = q.items[:n], 0
	}
	q.items = append(q.items, it)
}

// pop removes the head, which the queue then no longer references.
func (q *fifo[T]) pop() T {
	var zero T
	it := q.items[q.start]
	q.items[q.start] = zero
	if q.start++; q.start == len(q.items) {
		q.items, q.start = q.items[:0], 0
	}
	return it
}

// pushFront puts it back at the head; failures are rare, so a copy is fine.
func (q *fifo[T]) pushFront(it T) {
	q.items, q.start = slices.Insert(q.all(), 0, it), 0
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
