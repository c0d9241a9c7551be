package eventmonitor

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// FuzzEnvelopeIntake feeds arbitrary envelopes through the monitor's intake:
// it must never panic, and an envelope it does not accept must reach the
// drop handler with one of the documented reasons.
func FuzzEnvelopeIntake(f *testing.F) {
	for _, v := range []any{wrapperspb.String("c1"), &jsonEvent{ID: "c2"}, wrapperspb.Int64(1)} {
		a := payload(f, v)
		f.Add("ns", a.GetTypeUrl(), a.GetValue())
	}
	f.Add("ns", "eventmonitor.test/jsonEvent", []byte(`{"id":""}`))
	f.Add("other", "type.googleapis.com/google.protobuf.StringValue", []byte{0x0a, 0x05})
	f.Add("", "", []byte(nil))

	var lastDrop error
	m, err := New(HandlerFunc(func(context.Context, any) error { return nil }),
		WithConverter(testConverter), WithNamespace("ns"),
		WithDropHandler(func(d Drop) { lastDrop = d.Reason }))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(m.Stop)
	reasons := []error{ErrUnsupportedEvent, ErrDecode, ErrInvalidEvent}

	f.Fuzz(func(t *testing.T, ns, typeURL string, value []byte) {
		before := m.Stats()
		lastDrop = nil
		in := m.newIntake()
		in.add(&Envelope{Namespace: ns, Topic: "/fuzz", Event: &anypb.Any{TypeUrl: typeURL, Value: value}})
		in.flush(context.Background())
		after := m.Stats()
		if after.Received != before.Received+1 {
			t.Fatalf("received %d -> %d", before.Received, after.Received)
		}
		filtered, dropped := after.Filtered-before.Filtered, after.Dropped-before.Dropped
		if filtered+dropped > 1 || (ns != "ns") != (filtered == 1) {
			t.Fatalf("namespace %q: filtered %d, dropped %d", ns, filtered, dropped)
		}
		if dropped == 1 && !slices.ContainsFunc(reasons, func(r error) bool { return errors.Is(lastDrop, r) }) {
			t.Fatalf("drop reason %v wraps no documented error", lastDrop)
		}
	})
}

// maxFuzzOps bounds the operations one input runs. The model is checked
// after every operation in time linear in its length, so a long input would
// cost quadratic time, while a few hundred operations already reach every
// state the code has.
const maxFuzzOps = 512

// FuzzDueHeap checks the backoff heap against a sorted list: pushes with
// arbitrary due times, removals from the middle (Forget) and pops of the
// minimum (a replay becoming due), in any order.
func FuzzDueHeap(f *testing.F) {
	f.Add([]byte{0, 5, 0, 3, 0, 9, 2, 0, 1, 1, 2, 0})
	f.Add([]byte{0, 1, 0, 1, 0, 1, 1, 0, 2, 2, 2})
	f.Fuzz(func(t *testing.T, ops []byte) {
		ops = ops[:min(len(ops), 2*maxFuzzOps)] // an operation and its argument
		var h dueHeap
		var model []*keyState // sorted by due
		for i := 0; i+1 < len(ops); i += 2 {
			op, arg := ops[i]%3, int(ops[i+1])
			switch {
			case op == 0:
				k := &keyState{heapIndex: -1, due: time.Duration(arg) * time.Second}
				h.add(k)
				at, _ := slices.BinarySearchFunc(model, k, func(a, b *keyState) int { return cmp.Compare(a.due, b.due) })
				model = slices.Insert(model, at, k)
			case op == 1 && len(model) > 0:
				k := model[arg%len(model)]
				h.remove(k)
				model = slices.DeleteFunc(model, func(x *keyState) bool { return x == k })
				if k.heapIndex != -1 {
					t.Fatalf("removed key still has index %d", k.heapIndex)
				}
			case op == 2 && len(model) > 0:
				k := h[0] // what the scheduler replays next
				h.remove(k)
				if k.due != model[0].due {
					t.Fatalf("popped due %v, want the minimum %v", k.due, model[0].due)
				}
				model = slices.DeleteFunc(model, func(x *keyState) bool { return x == k })
			}
			if len(h) != len(model) {
				t.Fatalf("heap holds %d keys, model %d", len(h), len(model))
			}
			for j, k := range h {
				if int(k.heapIndex) != j {
					t.Fatalf("key at %d thinks it is at %d", j, k.heapIndex)
				}
			}
			if len(h) > 0 && h[0].due != model[0].due {
				t.Fatalf("heap minimum %v, model %v", h[0].due, model[0].due)
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
