package eventmonitor

// runQueue is the ready keys in the order they became ready, linked
// through the keys so that Forget and exits take one out in O(1).
type runQueue struct{ head, tail *key }

func (q *runQueue) push(k *key) {
	k.state, k.prev, k.next = keyReady, q.tail, nil
	if q.tail == nil {
		q.head = k
	} else {
		q.tail.next = k
	}
	q.tail = k
}

func (q *runQueue) remove(k *key) {
	if k.prev == nil {
		q.head = k.next
	} else {
		k.prev.next = k.next
	}
	if k.next == nil {
		q.tail = k.prev
	} else {
		k.next.prev = k.prev
	}
	k.prev, k.next = nil, nil
}

// dueHeap is the waiting keys, earliest due first.
type dueHeap []*key

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h dueHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *dueHeap) Push(x any) {
	k := x.(*key)
	k.index = len(*h)
	*h = append(*h, k)
}
func (h *dueHeap) Pop() any {
	old := *h
	k := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	k.index = -1
	return k
}
