package eventmonitor

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"
)

// Handler handles one typed event.
type Handler interface {
	// HandleEvent handles one typed event. ctx carries the per-event timeout
	// and is cancelled when HandleEvent returns; log.G(ctx) is the monitor's
	// logger with the event's key as a field. A non-nil error (or a panic)
	// sends the event to its key's backoff queue.
	HandleEvent(ctx context.Context, event any) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, event any) error

// HandleEvent calls f.
func (f HandlerFunc) HandleEvent(ctx context.Context, event any) error { return f(ctx, event) }

// Mux routes each event to the function registered for its Go type. Events of
// a type with no function are not ours to handle: HandleEvent returns
// ErrUnsupportedEvent for them, which the monitor counts in Stats.Ignored
// without retrying, as containerd's monitor skips topics it does not know.
//
// Register every type with On before the Mux handles its first event; a Mux
// is not safe for registration concurrent with handling.
type Mux struct {
	routes map[reflect.Type]func(ctx context.Context, event any) error
}

// NewMux returns an empty Mux.
func NewMux() *Mux {
	return &Mux{routes: make(map[reflect.Type]func(context.Context, any) error)}
}

// On routes events of type T to fn, replacing an earlier route for T. T is
// the exact dynamic type (usually a pointer such as *events.TaskExit). A nil
// m or fn is a programming error: On panics at once, as http.HandleFunc
// does, rather than when the first event arrives.
func On[T any](m *Mux, fn func(ctx context.Context, event T) error) {
	if m == nil || m.routes == nil {
		panic("eventmonitor: On with a nil Mux (make it with NewMux)")
	}
	if fn == nil {
		panic(fmt.Sprintf("eventmonitor: On[%v] with a nil function", reflect.TypeFor[T]()))
	}
	m.routes[reflect.TypeFor[T]()] = func(ctx context.Context, event any) error {
		return fn(ctx, event.(T))
	}
}

// HandleEvent implements Handler.
func (m *Mux) HandleEvent(ctx context.Context, event any) error {
	if route, ok := m.routes[reflect.TypeOf(event)]; ok {
		return route(ctx, event)
	}
	return fmt.Errorf("%w: no route for %T", ErrUnsupportedEvent, event)
}

// isNil reports whether v is nil or an interface holding a nil pointer,
// func or map, such as HandlerFunc(nil) or (*Mux)(nil): either would panic
// on every event rather than once, at New.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Func, reflect.Map, reflect.Interface, reflect.Chan, reflect.Slice:
		return rv.IsNil()
	}
	return false
}

// checkRoutes reports a route that can never be called, when the handler
// and the converter are both this package's own: a route for T beside a
// converter that keys *T, with no route for *T (or the reverse). Events of
// *T would all be ignored. A keyed type with no route at all is fine (a
// converter that keys every runtime event beside a Mux for a few), and so
// is a route for a type no converter keys (Submit and WatchExit bring them).
func checkRoutes(h Handler, conv Converter) error {
	mux, ok := h.(*Mux)
	tc, ok2 := conv.(*typeConverter)
	if !ok || !ok2 {
		return nil
	}
	var mismatched []string
	for keyed := range tc.keys {
		if _, routed := mux.routes[keyed]; routed {
			continue
		}
		twin := reflect.PointerTo(keyed)
		if keyed.Kind() == reflect.Pointer {
			twin = keyed.Elem()
		}
		if _, routed := mux.routes[twin]; routed {
			mismatched = append(mismatched, fmt.Sprintf("the converter yields %v but the Mux routes %v", keyed, twin))
		}
	}
	if len(mismatched) == 0 {
		return nil
	}
	slices.Sort(mismatched)
	return fmt.Errorf("%w: %s (On routes the exact type: a pointer and its value type differ)",
		ErrInvalidOption, strings.Join(mismatched, "; "))
}
