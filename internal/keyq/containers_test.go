package keyq

import (
	"slices"
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
