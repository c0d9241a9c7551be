package eventmonitor

import (
	"errors"
	"fmt"
	"reflect"

	"github.com/containerd/typeurl/v2"
)

// Converter turns an envelope's payload into a typed event and its key.
type Converter interface {
	// Convert unmarshals the payload and names the key that orders and backs
	// it off. An error wrapping ErrUnsupportedEvent ignores the envelope;
	// any other drops it.
	Convert(payload typeurl.Any) (key string, event any, err error)
}

// ConverterFunc adapts a function to Converter.
type ConverterFunc func(payload typeurl.Any) (string, any, error)

// Convert calls f.
func (f ConverterFunc) Convert(payload typeurl.Any) (string, any, error) { return f(payload) }

// TypeKey tells NewConverter how to key one Go type. Make it with KeyOf.
type TypeKey struct {
	typ reflect.Type
	key func(event any) string
}

// Type is the keyed Go type, for helpers that ask a runtime for only the
// keyed events (such as the containerd module's Filters).
func (k TypeKey) Type() reflect.Type { return k.typ }

// KeyOf keys events of type T, as typeurl unmarshals them (usually a pointer
// such as *events.TaskExit), with key. It panics on a nil key and on an
// interface T, which no event's type equals.
func KeyOf[T any](key func(T) string) TypeKey {
	t := reflect.TypeFor[T]()
	switch {
	case key == nil:
		panic(fmt.Sprintf("eventmonitor: KeyOf[%v] with a nil key function", t))
	case t.Kind() == reflect.Interface:
		panic(fmt.Sprintf("eventmonitor: KeyOf[%v]: an interface type never matches an event's type; key its concrete types", t))
	}
	return TypeKey{typ: t, key: func(event any) string { return key(event.(T)) }}
}

type typeConverter struct {
	keys map[reflect.Type]func(any) string
}

// NewConverter returns a Converter that unmarshals with typeurl.UnmarshalAny
// and keys the result by its Go type; a later TypeKey for a type wins. It is
// safe for concurrent use, so monitors may share one. A zero TypeKey panics.
func NewConverter(keys ...TypeKey) Converter {
	conv := &typeConverter{keys: make(map[reflect.Type]func(any) string, len(keys))}
	for i, k := range keys {
		if k.typ == nil {
			panic(fmt.Sprintf("eventmonitor: NewConverter: TypeKey %d is zero (make it with KeyOf)", i))
		}
		conv.keys[k.typ] = k.key
	}
	return conv
}

// Convert returns ErrUnsupportedEvent for a type URL typeurl does not know
// or a type with no key, and ErrDecode for bytes that do not unmarshal.
func (conv *typeConverter) Convert(payload typeurl.Any) (key string, event any, err error) {
	if payload == nil {
		return "", nil, fmt.Errorf("%w: nil payload", ErrInvalidEvent)
	}
	event, err = typeurl.UnmarshalAny(payload)
	switch {
	case errors.Is(err, typeurl.ErrNotFound):
		return "", nil, fmt.Errorf("%w: %w", ErrUnsupportedEvent, err)
	case err != nil:
		return "", nil, fmt.Errorf("%w: type %q: %w", ErrDecode, payload.GetTypeUrl(), err)
	}
	keyOf, ok := conv.keys[reflect.TypeOf(event)]
	if !ok {
		return "", nil, fmt.Errorf("%w: no key for %T (%s)", ErrUnsupportedEvent, event, payload.GetTypeUrl())
	}
	return keyOf(event), event, nil
}
