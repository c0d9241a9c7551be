package eventmonitor

import (
	"errors"
	"fmt"
	"reflect"

	"github.com/containerd/typeurl/v2"
)

// Converter turns an envelope's payload into a typed event and its key.
type Converter interface {
	// Convert unmarshals the payload and names the key that orders and backs it off.
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

// Type is the Go type the key is for, such as *events.TaskExit. Helpers
// use it to ask a runtime for only the events a converter keys (see the
// containerd module's Filters).
func (k TypeKey) Type() reflect.Type { return k.typ }

// KeyOf keys events of type T (the type typeurl unmarshals to, usually a
// pointer such as *events.TaskExit) with key. A nil key panics at once.
func KeyOf[T any](key func(T) string) TypeKey {
	if key == nil {
		panic(fmt.Sprintf("eventmonitor: KeyOf[%v] with a nil key function", reflect.TypeFor[T]()))
	}
	return TypeKey{
		typ: reflect.TypeFor[T](),
		key: func(event any) string { return key(event.(T)) },
	}
}

type typeConverter struct {
	keys map[reflect.Type]func(any) string
}

// NewConverter returns a Converter that unmarshals as typeurl.UnmarshalAny
// does and keys the result by its Go type. A payload whose type URL typeurl
// does not know, or whose type has no TypeKey, is ErrUnsupportedEvent (the
// monitor ignores it); bytes that do not unmarshal are ErrDecode (a drop).
// A later TypeKey for the same type wins. A zero TypeKey (not made by
// KeyOf) panics at once.
func NewConverter(keys ...TypeKey) Converter {
	conv := &typeConverter{keys: make(map[reflect.Type]func(any) string, len(keys))}
	for i, k := range keys {
		if k.typ == nil || k.key == nil {
			panic(fmt.Sprintf("eventmonitor: NewConverter: TypeKey %d is zero (make it with KeyOf)", i))
		}
		conv.keys[k.typ] = k.key
	}
	return conv
}

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
