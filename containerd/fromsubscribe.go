package containerd

import (
	"context"
	"fmt"
	"time"

	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/eventmonitor/eventmonitor"
)

// EnvelopeFields is any struct type with exactly the fields of containerd's
// events.Envelope (github.com/containerd/containerd/v2/core/events), which
// are eventmonitor.Envelope's: FromSubscribe converts one into the other
// field for field.
type EnvelopeFields interface {
	~struct {
		Timestamp time.Time
		Namespace string
		Topic     string
		Event     typeurl.Any
	}
}

// FromSubscribe adapts a containerd-shaped Subscribe function to an
// eventmonitor.Subscriber: the method of containerd's client
// (client.Subscribe, client.EventService().Subscribe), including the
// in-process client a plugin inside containerd has
// (containerd.New("", containerd.WithInMemoryServices(ic))), whose events
// never cross a socket, so that NewSubscriber, which needs a gRPC
// connection, cannot read them:
//
//	m.Run(ctx, containerd.FromSubscribe(client.Subscribe), filters...)
//
// E is inferred: events.Envelope for containerd's client. FromSubscribe is
// generic over the envelope's type, constrained to its fields
// (EnvelopeFields), rather than taking a conversion function, for two
// reasons: a containerd client plugs in with no code (no function to write
// per caller, none to get wrong by leaving a field out), and this module
// stays free of containerd/v2, which it would otherwise have to import for
// the type. Should containerd's Envelope ever change, the call stops
// compiling rather than losing a field. A source of another shape (an
// envelope with other fields, or containerd 1.x's typeurl v1 Any) needs an
// eventmonitor.SubscriberFunc of its own.
//
// containerd's subscriptions never close their envelope channel, and may
// send a nil error when their ctx is cancelled. The Subscriber returned
// therefore watches ctx itself: when ctx ends, its channels close (the
// source's subscription, given a ctx derived from ctx, ends too) even
// though the source's channel never does. A non-nil error from the source
// is delivered on errs (wrapped), after any envelope the source had
// buffered before it, and then both channels close; so does a source's
// errs closing, or delivering nil, while ctx lasts (the monitor's Run then
// re-subscribes). A source that closes its envelope channel is read until
// its errs says why, or ctx ends. Nothing outlives ctx, as long as the
// source's own goroutines end with the ctx they are given, as containerd's
// do.
//
// A nil subscribe is a programming error: FromSubscribe panics at once.
func FromSubscribe[E EnvelopeFields](subscribe func(ctx context.Context, filters ...string) (<-chan *E, <-chan error)) eventmonitor.Subscriber {
	if subscribe == nil {
		panic("containerd: FromSubscribe with a nil subscribe function")
	}
	return eventmonitor.SubscriberFunc(func(ctx context.Context, filters ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		ctx, cancel := context.WithCancel(ctx)
		src, srcErrs := subscribe(ctx, filters...)
		ch := make(chan *eventmonitor.Envelope)
		errs := make(chan error, 1)
		go func() {
			defer close(ch)
			defer close(errs)
			// However reading ends, the source's subscription ends with it,
			// not when the caller's ctx someday does.
			defer cancel()
			if err := bridge(ctx, src, srcErrs, ch); err != nil && ctx.Err() == nil {
				errs <- fmt.Errorf("containerd: event stream: %w", err)
			}
		}()
		return ch, errs
	})
}

// bridge forwards src to ch until ctx ends or srcErrs speaks, and returns
// the source's error, if any.
func bridge[E EnvelopeFields](ctx context.Context, src <-chan *E, srcErrs <-chan error, ch chan<- *eventmonitor.Envelope) error {
	forward := func(e *E) bool {
		select {
		case ch <- envelope(e):
			return true
		case <-ctx.Done():
			return false
		}
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-src:
			if !ok {
				src = nil // closed: wait for errs to say why
				continue
			}
			if !forward(e) {
				return nil
			}
		case err, ok := <-srcErrs:
			if !ok || err == nil {
				return nil
			}
			// A buffered source may still hold envelopes sent before it
			// failed; they come first, as they would have.
			for src != nil {
				select {
				case e, ok := <-src:
					if !ok {
						src = nil
					} else if !forward(e) {
						return nil
					}
				default:
					src = nil
				}
			}
			return err
		}
	}
}

// envelope converts one of the source's envelopes. A nil one stays nil
// (the monitor drops it as invalid); a nil *anypb.Any payload becomes a nil
// interface, as NewSubscriber delivers it, rather than a typed nil the
// monitor would try to decode.
func envelope[E EnvelopeFields](e *E) *eventmonitor.Envelope {
	if e == nil {
		return nil
	}
	env := eventmonitor.Envelope(*e)
	if a, ok := env.Event.(*anypb.Any); ok && a == nil {
		env.Event = nil
	}
	return &env
}
