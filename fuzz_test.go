package eventmonitor

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// fuzzEvent is registered with typeurl, which marshals it as JSON.
type fuzzEvent struct {
	ID string `json:"id"`
}

func init() { typeurl.Register(&fuzzEvent{}, "eventmonitor.test", "jsonEvent") }

// FuzzEnvelopeIntake feeds arbitrary envelopes through the monitor's intake:
// it must never panic, and an envelope it neither filters nor accepts must
// reach the drop handler with a documented reason.
func FuzzEnvelopeIntake(f *testing.F) {
	for _, v := range []any{wrapperspb.String("c1"), &fuzzEvent{ID: "c2"}, wrapperspb.Int64(1)} {
		a, err := typeurl.MarshalAny(v)
		if err != nil {
			f.Fatal(err)
		}
		f.Add("ns", a.GetTypeUrl(), a.GetValue())
	}
	f.Add("ns", "eventmonitor.test/jsonEvent", []byte(`{"id":""}`))
	f.Add("other", "type.googleapis.com/google.protobuf.StringValue", []byte{0x0a, 0x05})
	f.Add("", "", []byte(nil))

	var lastDrop error
	m, err := New(HandlerFunc(func(context.Context, any) error { return nil }),
		WithConverter(NewConverter(KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }),
			KeyOf(func(v *fuzzEvent) string { return v.ID }))),
		WithNamespace("ns"), WithDropHandler(func(d Drop) { lastDrop = d.Reason }))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(m.Stop)
	reasons := []error{ErrDecode, ErrInvalidEvent}

	f.Fuzz(func(t *testing.T, ns, typeURL string, value []byte) {
		before := m.Stats()
		lastDrop = nil
		m.ingest(context.Background(), &Envelope{Namespace: ns, Topic: "/fuzz", Event: &anypb.Any{TypeUrl: typeURL, Value: value}})
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
