package keyq

import "container/heap"

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
