package keyq

import (
	"slices"
	"strconv"
	"testing"
	"time"
)

// maxFuzzOps bounds the operations one input runs: a few hundred already
// reach every state, and the checks are linear in the length.
const maxFuzzOps = 512

// FuzzDueHeap checks the backoff heap against a sorted list: pushes with
// arbitrary due times, removals from the middle (Forget) and pops of the
// minimum (a replay becoming due), in any order.
func FuzzDueHeap(f *testing.F) {
	f.Add([]byte{0, 5, 0, 3, 0, 9, 2, 0, 1, 1, 2, 0})
	f.Add([]byte{0, 1, 0, 1, 0, 1, 1, 0, 2, 2, 2})
	f.Fuzz(func(t *testing.T, ops []byte) {
		ops = ops[:min(len(ops), 2*maxFuzzOps)] // an operation and its argument
		var h dueHeap[int]
		var model []*Key[int] // sorted by due
		for i := 0; i+1 < len(ops); i += 2 {
			op, arg := ops[i]%3, int(ops[i+1])
			switch {
			case op == 0:
				k := &Key[int]{index: -1, backoff: &backoff{due: time.Unix(int64(arg), 0)}}
				h.add(k)
				at, _ := slices.BinarySearchFunc(model, k, func(a, b *Key[int]) int { return a.backoff.due.Compare(b.backoff.due) })
				model = slices.Insert(model, at, k)
			case op == 1 && len(model) > 0:
				k := model[arg%len(model)]
				h.remove(k)
				model = slices.DeleteFunc(model, func(x *Key[int]) bool { return x == k })
				if k.index != -1 {
					t.Fatalf("removed key still has index %d", k.index)
				}
			case op == 2 && len(model) > 0:
				k := h[0] // what the scheduler replays next
				h.remove(k)
				if !k.backoff.due.Equal(model[0].backoff.due) {
					t.Fatalf("popped due %v, want the minimum %v", k.backoff.due, model[0].backoff.due)
				}
				model = slices.DeleteFunc(model, func(x *Key[int]) bool { return x == k })
			}
			if len(h) != len(model) {
				t.Fatalf("heap holds %d keys, model %d", len(h), len(model))
			}
			for j, k := range h {
				if k.index != j {
					t.Fatalf("key at %d thinks it is at %d", j, k.index)
				}
			}
			if len(h) > 0 && !h[0].backoff.due.Equal(model[0].backoff.due) {
				t.Fatalf("heap minimum %v, model %v", h[0].backoff.due, model[0].backoff.due)
			}
		}
	})
}

// FuzzFifo checks a key's event queue against a plain slice: appends,
// returns to the head (a failed event) and pops, in any order.
func FuzzFifo(f *testing.F) {
	f.Add([]byte{0, 0, 0, 2, 1, 2, 2, 0, 2})
	f.Add([]byte{1, 1, 1, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 2})
	f.Fuzz(func(t *testing.T, ops []byte) {
		ops = ops[:min(len(ops), maxFuzzOps)]
		var q fifo[int]
		var model []int
		for i, op := range ops {
			switch op % 3 {
			case 0:
				q.push(i)
				model = append(model, i)
			case 1:
				q.pushFront(i)
				model = slices.Insert(model, 0, i)
			case 2:
				if len(model) == 0 {
					continue
				}
				if got := q.pop(); got != model[0] {
					t.Fatalf("popped %d, want %d", got, model[0])
				}
				model = model[1:]
			}
			if !slices.Equal(q.all(), model) && !(q.len() == 0 && len(model) == 0) {
				t.Fatalf("queue %v, model %v", q.all(), model)
			}
		}
	})
}

// BenchmarkFifoSlidingWindow pushes and pops a queue that holds a steady
// backlog, as a key's queue does under a flood: the cost per item must not
// grow with the backlog.
func BenchmarkFifoSlidingWindow(b *testing.B) {
	for _, backlog := range []int{100, 10_000} {
		b.Run("backlog="+strconv.Itoa(backlog), func(b *testing.B) {
			var q fifo[[4]any]
			for range backlog {
				q.push([4]any{})
			}
			b.ReportAllocs()
			for i := range b.N {
				q.push([4]any{})
				if i%8 == 0 { // a worker's turn takes a few at a time
					for range 8 {
						q.pop()
					}
				}
			}
		})
	}
}
