package eventmonitor

import (
	"context"
	"errors"
	"testing"

	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// jsonEvent is registered with typeurl, which marshals it as JSON.
type jsonEvent struct {
	ID   string `json:"id"`
	Code int    `json:"code"`
}

func init() { typeurl.Register(&jsonEvent{}, "eventmonitor.test", "jsonEvent") }

var testConverter = NewConverter(
	KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }),
	KeyOf(func(v *jsonEvent) string { return v.ID }),
)

func payload(t testing.TB, v any) typeurl.Any {
	t.Helper()
	a, err := typeurl.MarshalAnyToProto(v)
	require.NoError(t, err)
	return a
}

func TestConvertProtobufPayload(t *testing.T) {
	key, event, err := testConverter.Convert(payload(t, wrapperspb.String("c1")))
	require.NoError(t, err)
	assert.Equal(t, "c1", key)
	require.IsType(t, &wrapperspb.StringValue{}, event)
	assert.Equal(t, "c1", event.(*wrapperspb.StringValue).GetValue())
}

func TestConvertJSONPayload(t *testing.T) {
	key, event, err := testConverter.Convert(payload(t, &jsonEvent{ID: "c2", Code: 3}))
	require.NoError(t, err)
	assert.Equal(t, "c2", key)
	assert.Equal(t, &jsonEvent{ID: "c2", Code: 3}, event)
}

func TestConvertErrors(t *testing.T) {
	for name, tc := range map[string]struct {
		payload typeurl.Any
		want    error
	}{
		"registered type without a key": {payload(t, wrapperspb.Int64(7)), ErrUnsupportedEvent},
		"unknown type URL":              {&anypb.Any{TypeUrl: "example.com/no.Such", Value: []byte{1}}, ErrUnsupportedEvent},
		"empty type URL":                {&anypb.Any{}, ErrUnsupportedEvent},
		"truncated protobuf":            {&anypb.Any{TypeUrl: "type.googleapis.com/google.protobuf.StringValue", Value: []byte{0x0a, 0x05, 'a'}}, ErrDecode},
		"garbage JSON":                  {&anypb.Any{TypeUrl: "eventmonitor.test/jsonEvent", Value: []byte("{not json")}, ErrDecode},
		"nil payload":                   {nil, ErrInvalidEvent},
	} {
		t.Run(name, func(t *testing.T) {
			key, event, err := testConverter.Convert(tc.payload)
			require.ErrorIs(t, err, tc.want)
			assert.Empty(t, key)
			assert.Nil(t, event)
		})
	}
	_, _, err := testConverter.Convert(&anypb.Any{TypeUrl: "example.com/no.Such"})
	assert.ErrorIs(t, err, typeurl.ErrNotFound, "typeurl's own error stays inspectable")
}

func TestLaterTypeKeyWins(t *testing.T) {
	conv := NewConverter(
		KeyOf(func(v *wrapperspb.StringValue) string { return "first" }),
		KeyOf(func(v *wrapperspb.StringValue) string { return "second" }),
	)
	key, _, err := conv.Convert(payload(t, wrapperspb.String("x")))
	require.NoError(t, err)
	assert.Equal(t, "second", key)
}

func TestConverterDecodesProtobufAndJSON(t *testing.T) {
	conv := NewConverter(KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }),
		KeyOf(func(v *jsonEvent) string { return v.ID }))
	key, event, err := conv.Convert(payload(t, wrapperspb.String("c1")))
	require.NoError(t, err)
	assert.Equal(t, "c1", key)
	assert.True(t, proto.Equal(wrapperspb.String("c1"), event.(proto.Message)))
	key, event, err = conv.Convert(payload(t, &jsonEvent{ID: "c2", Code: 3}))
	require.NoError(t, err)
	assert.Equal(t, "c2", key)
	assert.Equal(t, &jsonEvent{ID: "c2", Code: 3}, event)

	truncated := &anypb.Any{TypeUrl: payload(t, wrapperspb.String("x")).GetTypeUrl(), Value: []byte{0x0a, 0x05, 'a'}}
	key, event, err = conv.Convert(truncated)
	require.ErrorIs(t, err, ErrDecode)
	assert.Empty(t, key)
	assert.Nil(t, event)
	_, _, err = conv.Convert(payload(t, wrapperspb.Int64(1)))
	require.ErrorIs(t, err, ErrUnsupportedEvent, "a type without a key")
}

// Every Drop.Reason wraps a sentinel, so errors.Is (and the prometheus
// collector's label) finds why: a converter's own error, wrapping none, is
// dropped wrapped in ErrDecode and kept (it was once dropped bare).
func TestConverterErrorDropWrapsASentinel(t *testing.T) {
	boom := errors.New("converter: no such field")
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) { return "", nil, boom })
	h := newHarness(t, newRecorder(), WithConverter(conv))
	ch := make(chan *Envelope, 1)
	ch <- &Envelope{Topic: "/t", Namespace: "ns", Event: payload(t, wrapperspb.String("k"))}
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil }))
	h.m.Start()
	waitFor(t, func() bool { return len(h.drops.all()) == 1 }, "the envelope is dropped")
	reason := h.drops.all()[0].Reason
	require.ErrorIs(t, reason, boom, "the converter's error is kept")
	var wrapsOne bool
	for _, sentinel := range []error{ErrDecode, ErrInvalidEvent, ErrMaxAttempts, ErrQueueFull, ErrStopped} {
		wrapsOne = wrapsOne || errors.Is(reason, sentinel)
	}
	assert.True(t, wrapsOne, "Drop.Reason %q wraps none of the documented sentinels", reason)
}
