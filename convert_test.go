package eventmonitor

import (
	"fmt"
	"sync"
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

// learnedURLs is what conv decodes without asking typeurl.
func learnedURLs(conv Converter) map[string]directDecoder {
	return *conv.(*typeConverter).learned.Load()
}

func TestConverterLearnsProtobufURLs(t *testing.T) {
	conv := NewConverter(KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }))
	p := payload(t, wrapperspb.String("c1"))
	var events []any
	for range 3 { // through typeurl, then directly: the same result
		key, event, err := conv.Convert(p)
		require.NoError(t, err)
		assert.Equal(t, "c1", key)
		assert.True(t, proto.Equal(wrapperspb.String("c1"), event.(proto.Message)))
		assert.NotNil(t, learnedURLs(conv)[p.GetTypeUrl()].message, "decoded directly from now on")
		events = append(events, event)
	}
	assert.NotSame(t, events[1], events[2], "every payload gets its own message")
}

func TestConverterDecodeErrorIsTheSameLearnedOrNot(t *testing.T) {
	conv := NewConverter(KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }))
	valid := payload(t, wrapperspb.String("c1"))
	truncated := &anypb.Any{TypeUrl: valid.GetTypeUrl(), Value: []byte{0x0a, 0x05, 'a'}}
	_, _, before := conv.Convert(truncated)
	_, _, err := conv.Convert(valid)
	require.NoError(t, err)
	require.NotNil(t, learnedURLs(conv)[truncated.TypeUrl].message)
	key, event, after := conv.Convert(truncated)
	require.ErrorIs(t, after, ErrDecode)
	assert.Equal(t, before.Error(), after.Error())
	assert.Empty(t, key)
	assert.Nil(t, event)
}

func TestConverterLeavesJSONAndUnkeyedTypesToTypeurl(t *testing.T) {
	conv := NewConverter(KeyOf(func(v *jsonEvent) string { return v.ID }))
	p := payload(t, &jsonEvent{ID: "c2", Code: 3})
	for range 2 {
		key, event, err := conv.Convert(p)
		require.NoError(t, err)
		assert.Equal(t, "c2", key)
		assert.Equal(t, &jsonEvent{ID: "c2", Code: 3}, event)
	}
	assert.Equal(t, map[string]directDecoder{p.GetTypeUrl(): {}}, learnedURLs(conv), "remembered as typeurl's to decode")
	_, _, err := conv.Convert(payload(t, wrapperspb.String("unkeyed")))
	require.ErrorIs(t, err, ErrUnsupportedEvent)
	assert.Len(t, learnedURLs(conv), 1, "a type without a key is not remembered")
}

// typeurl resolves a URL by the name after its last "/", so one type has
// endless URLs: the converter learns a bounded number of them.
func TestConverterLearnsBoundedURLs(t *testing.T) {
	conv := NewConverter(KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }))
	value := payload(t, wrapperspb.String("c1")).GetValue()
	for i := range maxLearnedURLs + 10 {
		key, _, err := conv.Convert(&anypb.Any{TypeUrl: fmt.Sprintf("example.com/%d/google.protobuf.StringValue", i), Value: value})
		require.NoError(t, err)
		require.Equal(t, "c1", key)
	}
	assert.Len(t, learnedURLs(conv), maxLearnedURLs)
}

func TestConverterLearnsWhileConverting(t *testing.T) {
	conv := NewConverter(KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }))
	value := payload(t, wrapperspb.String("c1")).GetValue()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				url := fmt.Sprintf("example.com/%d/google.protobuf.StringValue", (g+i)%20)
				key, _, err := conv.Convert(&anypb.Any{TypeUrl: url, Value: value})
				assert.NoError(t, err)
				assert.Equal(t, "c1", key)
			}
		}()
	}
	wg.Wait()
	assert.Len(t, learnedURLs(conv), 20)
}
