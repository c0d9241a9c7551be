package eventmonitor

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"sync"
	"sync/atomic"

	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/proto"
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

// maxLearnedURLs bounds the type URLs a converter remembers. A type is
// normally sent under one URL, but typeurl resolves any prefix before the
// last "/", so a stream could otherwise grow the table without end.
const maxLearnedURLs = 256

type typeConverter struct {
	keys map[reflect.Type]func(any) string

	mu      sync.Mutex // serialises learning; lookups read learned without it
	learned atomic.Pointer[map[string]directDecoder]
}

// directDecoder decodes one type URL's payloads as typeurl would, without
// typeurl's per-payload lookup of the URL and its throwaway instance. The
// zero value remembers a URL that typeurl must go on decoding (JSON).
type directDecoder struct {
	message reflect.Type // the struct a keyed protobuf pointer type points to
	key     func(any) string
}

// NewConverter returns a Converter that unmarshals as typeurl.UnmarshalAny
// does and keys the result by its Go type. A payload whose type URL typeurl
// does not know, or whose type has no TypeKey, is ErrUnsupportedEvent (the
// monitor ignores it); bytes that do not unmarshal are ErrDecode (a drop). A later TypeKey for the same type wins.
//
// Once typeurl has resolved a type URL to a keyed protobuf type, the
// converter unmarshals that URL's payloads into the type directly, which
// saves about a third of decoding a containerd event. Register types with
// typeurl before their events arrive, as package init functions do: a
// registration that changes what an already-seen URL resolves to is not
// noticed.
//
// A zero TypeKey (not made by KeyOf) panics at once.
func NewConverter(keys ...TypeKey) Converter {
	conv := &typeConverter{keys: make(map[reflect.Type]func(any) string, len(keys))}
	for i, k := range keys {
		if k.typ == nil || k.key == nil {
			panic(fmt.Sprintf("eventmonitor: NewConverter: TypeKey %d is zero (make it with KeyOf)", i))
		}
		conv.keys[k.typ] = k.key
	}
	conv.learned.Store(&map[string]directDecoder{})
	return conv
}

func (conv *typeConverter) Convert(payload typeurl.Any) (key string, event any, err error) {
	if payload == nil {
		return "", nil, fmt.Errorf("%w: nil payload", ErrInvalidEvent)
	}
	url := payload.GetTypeUrl()
	table := *conv.learned.Load()
	d, learned := table[url]
	if d.message != nil {
		msg := reflect.New(d.message).Interface().(proto.Message)
		if err := proto.Unmarshal(payload.GetValue(), msg); err != nil {
			return "", nil, decodeError(url, err)
		}
		return d.key(msg), msg, nil
	}
	event, err = typeurl.UnmarshalAny(payload)
	if errors.Is(err, typeurl.ErrNotFound) {
		return "", nil, fmt.Errorf("%w: %w", ErrUnsupportedEvent, err)
	}
	if err != nil {
		return "", nil, decodeError(url, err)
	}
	keyOf, ok := conv.keys[reflect.TypeOf(event)]
	if !ok {
		return "", nil, fmt.Errorf("%w: no key for %T (%s)", ErrUnsupportedEvent, event, url)
	}
	if !learned && len(table) < maxLearnedURLs {
		conv.learn(url, event, keyOf)
	}
	return keyOf(event), event, nil
}

func decodeError(url string, err error) error {
	return fmt.Errorf("%w: type %q: %w", ErrDecode, url, err)
}

// learn records whether url's payloads decode directly into event's type:
// they do if typeurl decodes them as protobuf. Empty bytes are a valid empty
// message in protobuf but not in JSON, so typeurl accepting them tells which
// it uses.
func (conv *typeConverter) learn(url string, event any, keyOf func(any) string) {
	conv.mu.Lock()
	defer conv.mu.Unlock()
	learned := *conv.learned.Load()
	if _, ok := learned[url]; ok || len(learned) >= maxLearnedURLs {
		return
	}
	var d directDecoder
	typ := reflect.TypeOf(event)
	if _, isProto := event.(proto.Message); isProto && typ.Kind() == reflect.Pointer {
		if probe, err := typeurl.UnmarshalByTypeURL(url, nil); err == nil && reflect.TypeOf(probe) == typ {
			d = directDecoder{message: typ.Elem(), key: keyOf}
		}
	}
	next := make(map[string]directDecoder, len(learned)+1)
	maps.Copy(next, learned)
	next[url] = d
	conv.learned.Store(&next)
}
