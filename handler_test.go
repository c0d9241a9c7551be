package eventmonitor_test

// Mux, On, KeyOf, NewConverter and custom converters.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/eventmonitor/eventmonitor"
)

// unrouted is an event type no test's Mux routes.
type unrouted struct{ N int }

// twin is routed or keyed as a value or a pointer, for New's check.
type twin struct{ ID string }

// jsonEvent is registered with typeurl, which marshals it as JSON.
type jsonEvent struct {
	ID   string `json:"id"`
	Code int    `json:"code"`
}

func init() { typeurl.Register(&jsonEvent{}, "eventmonitor.test.handler", "jsonEvent") }

func anyOf(t *testing.T, v any) typeurl.Any {
	t.Helper()
	a, err := typeurl.MarshalAny(v)
	require.NoError(t, err)
	return a
}

// panicValue is what f panics with, as a string; "" if it does not panic.
func panicValue(f func()) (v string) {
	defer func() {
		if r := recover(); r != nil {
			v = fmt.Sprint(r)
		}
	}()
	f()
	return ""
}

func TestMuxRoutesByExactType(t *testing.T) {
	type named ev // same fields as ev, another type
	routeErr := errors.New("the route's own error")
	var got []string
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(_ context.Context, e ev) error { got = append(got, "ev "+e.String()); return nil })
	eventmonitor.On(mux, func(_ context.Context, e *ev) error { got = append(got, "*ev "+e.String()); return routeErr })
	ctx := context.Background()
	require.NoError(t, mux.HandleEvent(ctx, ev{"a", 1}))
	require.ErrorIs(t, mux.HandleEvent(ctx, &ev{"b", 2}), routeErr)
	for _, e := range []any{named{"c", 3}, &named{"d", 4}, unrouted{}, 42, nil} {
		assert.ErrorIs(t, mux.HandleEvent(ctx, e), eventmonitor.ErrUnsupportedEvent, "%T", e)
	}
	assert.Equal(t, []string{"ev a/1", "*ev b/2"}, got)
}

func TestOnReplacesARoute(t *testing.T) {
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(context.Context, ev) error { return errors.New("the first route") })
	eventmonitor.On(mux, func(context.Context, ev) error { return nil })
	require.NoError(t, mux.HandleEvent(context.Background(), ev{"a", 1}))
}

// An event the Mux has no route for is ignored: counted Ignored, neither
// handled nor failed, never retried; its type is logged once at debug.
func TestUnroutedEventsAreIgnoredAndTheirTypeLoggedOnce(t *testing.T) {
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(context.Context, ev) error { return nil })
	h := newHarness(t, mux)
	for key, e := range map[string]any{"a": unrouted{1}, "b": unrouted{2}, "c": ev{"c", 1}, "d": &unrouted{3}} {
		require.NoError(t, h.m.Submit(key, e))
	}
	h.step(t, 10*time.Minute) // past any backoff
	s := h.m.Stats()
	assert.Equal(t, eventmonitor.Stats{Received: 4, Ignored: 3, Handled: 1}, s)
	assert.Empty(t, h.drops.list())
	var lines []*logrus.Entry
	for _, e := range h.logs.AllEntries() {
		if e.Message == "ignoring events of a type the Mux has no route for; logged once per type" {
			lines = append(lines, e)
		}
	}
	require.Len(t, lines, 2, "one line per type")
	types := map[any]bool{}
	for _, l := range lines {
		assert.Equal(t, logrus.DebugLevel, l.Level)
		assert.Contains(t, []any{"a", "b", "d"}, l.Data["key"], "with the event's key")
		types[l.Data["type"]] = true
	}
	assert.Equal(t, map[any]bool{"eventmonitor_test.unrouted": true, "*eventmonitor_test.unrouted": true}, types)
}

func TestRegistrationPanicsOnNilArguments(t *testing.T) {
	ok := func(context.Context, ev) error { return nil }
	for name, register := range map[string]func(){
		"On with a nil Mux":                func() { eventmonitor.On(nil, ok) },
		"On with a nil function":           func() { eventmonitor.On[ev](eventmonitor.NewMux(), nil) },
		"KeyOf with a nil function":        func() { eventmonitor.KeyOf[*wrapperspb.StringValue](nil) },
		"NewConverter with a zero TypeKey": func() { eventmonitor.NewConverter(keyConverterKey(), eventmonitor.TypeKey{}) },
	} {
		msg := panicValue(register)
		assert.Regexp(t, "nil|zero", msg, "%s panics saying why", name)
	}
}

func keyConverterKey() eventmonitor.TypeKey {
	return eventmonitor.KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() })
}

// No event's dynamic type is an interface: a route or key for one would
// never match, so On and KeyOf refuse it where it is written.
func TestInterfaceTypeArgumentsPanic(t *testing.T) {
	for _, tc := range []struct {
		name, typ string
		register  func()
	}{
		{"On[fmt.Stringer]", "fmt.Stringer", func() {
			eventmonitor.On(eventmonitor.NewMux(), func(context.Context, fmt.Stringer) error { return nil })
		}},
		{"On[any]", "interface {}", func() { eventmonitor.On(eventmonitor.NewMux(), func(context.Context, any) error { return nil }) }},
		{"On[proto.Message]", "protoreflect.ProtoMessage", func() {
			eventmonitor.On(eventmonitor.NewMux(), func(context.Context, proto.Message) error { return nil })
		}},
		{"KeyOf[fmt.Stringer]", "fmt.Stringer", func() { eventmonitor.KeyOf(func(fmt.Stringer) string { return "" }) }},
		{"KeyOf[any]", "interface {}", func() { eventmonitor.KeyOf(func(any) string { return "" }) }},
		{"KeyOf[proto.Message]", "protoreflect.ProtoMessage", func() { eventmonitor.KeyOf(func(proto.Message) string { return "" }) }},
	} {
		msg := panicValue(tc.register)
		require.NotEmpty(t, msg, "%s did not panic: every event would be ignored", tc.name)
		assert.Contains(t, msg, tc.typ, tc.name)
		assert.Contains(t, msg, "interface type never matches", tc.name)
	}
}

// New refuses a Mux routing T beside a converter keying *T (or the
// reverse) with no route for the keyed type: all its events would be
// ignored. A keyed type the Mux does not route at all is fine.
func TestNewRefusesARouteForTheTwinOfAKeyedType(t *testing.T) {
	route := func(m *eventmonitor.Mux, value, pointer bool) *eventmonitor.Mux {
		if value {
			eventmonitor.On(m, func(context.Context, twin) error { return nil })
		}
		if pointer {
			eventmonitor.On(m, func(context.Context, *twin) error { return nil })
		}
		return m
	}
	byValue := eventmonitor.KeyOf(func(e twin) string { return e.ID })
	byPointer := eventmonitor.KeyOf(func(e *twin) string { return e.ID })
	for _, tc := range []struct {
		name   string
		mux    *eventmonitor.Mux
		keys   []eventmonitor.TypeKey
		refuse bool
	}{
		{"routes T, keys *T", route(eventmonitor.NewMux(), true, false), []eventmonitor.TypeKey{byPointer}, true},
		{"routes *T, keys T", route(eventmonitor.NewMux(), false, true), []eventmonitor.TypeKey{byValue}, true},
		{"routes T and *T, keys *T", route(eventmonitor.NewMux(), true, true), []eventmonitor.TypeKey{byPointer}, false},
		{"routes *T, keys *T and an unrouted type", route(eventmonitor.NewMux(), false, true),
			[]eventmonitor.TypeKey{byPointer, keyConverterKey()}, false},
	} {
		m, err := eventmonitor.New(tc.mux, eventmonitor.WithConverter(eventmonitor.NewConverter(tc.keys...)))
		if !tc.refuse {
			require.NoError(t, err, tc.name)
			m.Stop()
			continue
		}
		require.ErrorIs(t, err, eventmonitor.ErrInvalidOption, tc.name)
		assert.Contains(t, err.Error(), "twin", "%s: the error names the type", tc.name)
		assert.Nil(t, m)
	}
}

func TestNewConverterUnmarshalsAndKeysByType(t *testing.T) {
	conv := eventmonitor.NewConverter(keyConverterKey(), eventmonitor.KeyOf(func(e *jsonEvent) string { return e.ID }))
	key, event, err := conv.Convert(anyOf(t, wrapperspb.String("c1")))
	require.NoError(t, err)
	assert.Equal(t, "c1", key)
	assert.True(t, proto.Equal(wrapperspb.String("c1"), event.(proto.Message)), "%v", event)
	key, event, err = conv.Convert(anyOf(t, &jsonEvent{ID: "c2", Code: 3}))
	require.NoError(t, err)
	assert.Equal(t, "c2", key)
	assert.Equal(t, &jsonEvent{ID: "c2", Code: 3}, event)
}

func TestNewConverterErrors(t *testing.T) {
	conv := eventmonitor.NewConverter(keyConverterKey(), eventmonitor.KeyOf(func(e *jsonEvent) string { return e.ID }))
	stringURL := anyOf(t, wrapperspb.String("x")).GetTypeUrl()
	for name, tc := range map[string]struct {
		payload typeurl.Any
		want    error
	}{
		"a registered type with no key": {anyOf(t, wrapperspb.Int64(7)), eventmonitor.ErrUnsupportedEvent},
		"an unknown type URL":           {&anypb.Any{TypeUrl: "example.com/no.Such", Value: []byte{1}}, eventmonitor.ErrUnsupportedEvent},
		"truncated protobuf":            {&anypb.Any{TypeUrl: stringURL, Value: []byte{0x0a, 0x05, 'a'}}, eventmonitor.ErrDecode},
		"garbage JSON":                  {&anypb.Any{TypeUrl: anyOf(t, &jsonEvent{}).GetTypeUrl(), Value: []byte("{not json")}, eventmonitor.ErrDecode},
		"nil payload":                   {nil, eventmonitor.ErrInvalidEvent},
	} {
		key, event, err := conv.Convert(tc.payload)
		assert.ErrorIs(t, err, tc.want, name)
		assert.Empty(t, key, name)
		assert.Nil(t, event, name)
	}
}

func TestALaterTypeKeyForATypeWins(t *testing.T) {
	conv := eventmonitor.NewConverter(
		eventmonitor.KeyOf(func(*wrapperspb.StringValue) string { return "first" }),
		eventmonitor.KeyOf(func(*wrapperspb.StringValue) string { return "second" }))
	key, _, err := conv.Convert(anyOf(t, wrapperspb.String("x")))
	require.NoError(t, err)
	assert.Equal(t, "second", key)
}

// Two monitors read their streams at once through one converter (-race).
func TestAConverterIsSafeToShareBetweenMonitors(t *testing.T) {
	const n = 200
	conv := eventmonitor.NewConverter(keyConverterKey())
	h := newHarness(t, nil, eventmonitor.WithConverter(conv), eventmonitor.WithWorkers(4))
	other, err := eventmonitor.New(nopHandler, eventmonitor.WithConverter(conv), eventmonitor.WithWorkers(4),
		eventmonitor.WithLogger(quietLogger()))
	require.NoError(t, err)
	t.Cleanup(other.Stop) // before the harness's leak check: one harness per test
	var feeders sync.WaitGroup
	for _, m := range []*eventmonitor.Monitor{h.m, other} {
		sub := newFakeSubscriber(16)
		runMonitor(t, m, sub)
		st := sub.next(t)
		var envs []*eventmonitor.Envelope
		for i := range n {
			envs = append(envs, envelope(t, "ns", fmt.Sprintf("c%d", i%10)))
		}
		feeders.Add(1)
		go func() {
			defer feeders.Done()
			for _, env := range envs {
				st.ch <- env
			}
		}()
	}
	feeders.Wait()
	for _, m := range []*eventmonitor.Monitor{h.m, other} {
		waitFor(t, "every envelope handled", func() bool { return m.Stats().Handled == n })
	}
}

// envelopeOf carries payload from namespace ns, topic /test.
func envelopeOf(payload typeurl.Any) *eventmonitor.Envelope {
	return &eventmonitor.Envelope{Namespace: "ns", Topic: "/test", Event: payload}
}

// Envelopes the converter has no key for are ignored, their type URL logged
// once at debug.
func TestEnvelopesOfUnkeyedTypesAreIgnored(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithConverter(keyConverter))
	sub := newFakeSubscriber(8)
	runMonitor(t, h.m, sub)
	st := sub.next(t)
	unknown := &anypb.Any{TypeUrl: "example.com/no.Such", Value: []byte{1}}
	for _, p := range []typeurl.Any{anyOf(t, wrapperspb.Int64(1)), unknown, anyOf(t, wrapperspb.Int64(2)), unknown} {
		st.ch <- envelopeOf(p)
	}
	st.ch <- envelope(t, "ns", "c1")
	waitFor(t, "every envelope read", func() bool { return h.m.Stats().Received == 5 })
	h.settle(t)
	assert.Equal(t, eventmonitor.Stats{Received: 5, Ignored: 4, Handled: 1}, h.m.Stats())
	assert.Empty(t, h.drops.list())
	types := map[any]logrus.Level{}
	for _, e := range h.logs.AllEntries() {
		if e.Message == "ignoring events of a type the converter has no key for; logged once per type" {
			types[e.Data["type"]] = e.Level
		}
	}
	assert.Equal(t, map[any]logrus.Level{unknown.TypeUrl: logrus.DebugLevel,
		anyOf(t, wrapperspb.Int64(1)).GetTypeUrl(): logrus.DebugLevel}, types)
}

// A custom converter's error reaches the drop handler wrapping ErrDecode,
// unless it wraps a sentinel already; a converter that makes no event or no
// key, or panics, drops ErrInvalidEvent.
func TestAConvertersFailureReachesTheDropHandler(t *testing.T) {
	boom := errors.New("no such field")
	for _, tc := range []struct {
		name    string
		convert func(typeurl.Any) (string, any, error)
		want    error
		notWant error
	}{
		{"its own error", func(typeurl.Any) (string, any, error) { return "k", ev{"k", 1}, boom }, eventmonitor.ErrDecode, nil},
		{"an error wrapping ErrDecode", func(typeurl.Any) (string, any, error) {
			return "", nil, fmt.Errorf("bad bytes: %w", eventmonitor.ErrDecode)
		}, eventmonitor.ErrDecode, nil},
		{"an error wrapping ErrInvalidEvent", func(typeurl.Any) (string, any, error) {
			return "", nil, fmt.Errorf("no id: %w", eventmonitor.ErrInvalidEvent)
		}, eventmonitor.ErrInvalidEvent, eventmonitor.ErrDecode},
		{"a nil event", func(typeurl.Any) (string, any, error) { return "k", nil, nil }, eventmonitor.ErrInvalidEvent, nil},
		{"an empty key", func(typeurl.Any) (string, any, error) { return "", ev{"", 1}, nil }, eventmonitor.ErrInvalidEvent, nil},
		{"a panic", func(typeurl.Any) (string, any, error) { panic("converter bug") }, eventmonitor.ErrInvalidEvent, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithConverter(eventmonitor.ConverterFunc(tc.convert)))
			sub := newFakeSubscriber(1)
			runMonitor(t, h.m, sub)
			sub.next(t).ch <- envelope(t, "k8s.io", "k")
			waitFor(t, "the drop", func() bool { return len(h.drops.list()) == 1 })
			d := h.drops.list()[0]
			assert.ErrorIs(t, d.Reason, tc.want)
			if tc.name == "its own error" {
				assert.ErrorIs(t, d.Reason, boom, "the converter's error is kept")
			}
			if tc.notWant != nil {
				assert.NotErrorIs(t, d.Reason, tc.notWant)
			}
			assert.Equal(t, [2]string{"/test", "k8s.io"}, [2]string{d.Topic, d.Namespace})
			assert.Empty(t, h.rec.log(), "nothing reached the handler")
			s := h.m.Stats()
			assert.Equal(t, [2]uint64{1, 1}, [2]uint64{s.Received, s.Dropped})
		})
	}
}

// A converter's ErrUnsupportedEvent ignores the envelope, as NewConverter's does.
func TestAConvertersUnsupportedEventIgnoresTheEnvelope(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithConverter(eventmonitor.ConverterFunc(func(typeurl.Any) (string, any, error) {
		return "", nil, fmt.Errorf("not ours: %w", eventmonitor.ErrUnsupportedEvent)
	})))
	sub := newFakeSubscriber(1)
	runMonitor(t, h.m, sub)
	sub.next(t).ch <- envelope(t, "ns", "k")
	waitFor(t, "the envelope read", func() bool { return h.m.Stats().Received == 1 })
	assert.Equal(t, eventmonitor.Stats{Received: 1, Ignored: 1}, h.m.Stats())
	assert.Empty(t, h.drops.list())
}
