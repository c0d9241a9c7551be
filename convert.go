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

// KeyOf keys events of type T (the type typeurl unmarshals to, usually a
// pointer such as *events.TaskExit) with key.
func KeyOf[T any](key func(T) string) TypeKey {
	return TypeKey{
		typ: reflect.TypeFor[T](),
		key: func(event any) string { return key(event.(T)) },
	}
}

type typeConverter map[reflect.Type]func(any) string

// NewConverter returns a Converter that unmarshals with typeurl.UnmarshalAny
// and keys the result by its Go type. A payload whose type URL typeurl does
// not know, or whose type has no TypeKey, is ErrUnsupportedEvent; bytes that
// do not unmarshal are ErrDecode. A later TypeKey for the same type wins.
func NewConverter(keys ...TypeKey) Converter {
	conv := make(typeConverter, len(keys))
	for _, k := range keys {
		conv[k.typ] = k.key
	}
	return conv
}

func (conv typeConverter) Convert(payload typeurl.Any) (key string, event any, err error) {
	if payload == nil {
		return "", nil, fmt.Errorf("%w: nil payload", ErrInvalidEvent)
	}
	event, err = typeurl.UnmarshalAny(payload)
	if errors.Is(err, typeurl.ErrNotFound) {
		return "", nil, fmt.Errorf("%w: %w", ErrUnsupportedEvent, err)
	}
	if err != nil {
		return "", nil, fmt.Errorf("%w: type %q: %w", ErrDecode, payload.GetTypeUrl(), err)
	}
	keyOf, ok := conv[reflect.TypeOf(event)]
	if !ok {
		return "", nil, fmt.Errorf("%w: no key for %T (%s)", ErrUnsupportedEvent, event, payload.GetTypeUrl())
	}
	return keyOf(event), event, nil
}
