package eventmonitor

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"

	"github.com/containerd/log"
)

// Handler handles typed events.
type Handler interface {
	// HandleEvent handles one event. ctx carries the per-event deadline and
	// ends when HandleEvent returns. An error (or a panic) sends the event
	// to its key's backoff queue; an error wrapping ErrUnsupportedEvent
	// ignores it.
	HandleEvent(ctx context.Context, event any) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, event any) error

// HandleEvent calls f.
func (f HandlerFunc) HandleEvent(ctx context.Context, event any) error { return f(ctx, event) }

// Mux routes each event to the function registered for its Go type. For a
// type with no route it returns ErrUnsupportedEvent (the event is ignored),
// and logs the type once at debug level. Register routes before the first
// event.
type Mux struct {
	routes   map[reflect.Type]func(ctx context.Context, event any) error
	unrouted logOnce[reflect.Type]
}

// NewMux returns an empty Mux.
func NewMux() *Mux {
	return &Mux{routes: make(map[reflect.Type]func(context.Context, any) error)}
}

// On routes events of exactly type T (usually a pointer such as
// *events.TaskExit) to fn, replacing any earlier route for T. It panics on
// a nil m or fn, and on an interface T, which no event's type equals.
func On[T any](m *Mux, fn func(ctx context.Context, event T) error) {
	t := reflect.TypeFor[T]()
	switch {
	case m == nil || m.routes == nil:
		panic("eventmonitor: On with a nil Mux (make it with NewMux)")
	case fn == nil:
		panic(fmt.Sprintf("eventmonitor: On[%v] with a nil function", t))
	case t.Kind() == reflect.Interface:
		panic(fmt.Sprintf("eventmonitor: On[%v]: an interface type never matches an event's type; route its concrete types", t))
	}
	m.routes[t] = func(ctx context.Context, event any) error { return fn(ctx, event.(T)) }
}

// HandleEvent implements Handler.
func (m *Mux) HandleEvent(ctx context.Context, event any) error {
	t := reflect.TypeOf(event)
	if route, ok := m.routes[t]; ok {
		return route(ctx, event)
	}
	if m.unrouted.first(t) {
		log.G(ctx).WithField("type", fmt.Sprint(t)).
			Debug("ignoring events of a type the Mux has no route for; logged once per type")
	}
	return fmt.Errorf("%w: no route for %T", ErrUnsupportedEvent, event)
}

// isNil reports whether v is nil or holds a nil pointer, func or map (say
// HandlerFunc(nil)), for New to refuse rather than panic on every event.
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

// checkRoutes, given this package's Mux and converter, refuses a route for
// T beside a key for *T (or the reverse) with no route for the keyed type:
// its events would all be ignored.
func checkRoutes(h Handler, conv Converter) error {
	mux, ok := h.(*Mux)
	tc, ok2 := conv.(*typeConverter)
	if !ok || !ok2 {
		return nil
	}
	var mismatched []string
	for keyed := range tc.keys {
		twin := reflect.PointerTo(keyed)
		if keyed.Kind() == reflect.Pointer {
			twin = keyed.Elem()
		}
		_, routed := mux.routes[keyed]
		if _, twinRouted := mux.routes[twin]; twinRouted && !routed {
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
