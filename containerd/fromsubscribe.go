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

// FromSubscribe adapts a containerd-shaped Subscribe function, such as
// client.Subscribe, to an eventmonitor.Subscriber; a plugin inside
// containerd uses it with its in-process client, whose events never cross a
// socket. E is inferred, so the call stops compiling, rather than losing a
// field, should containerd's Envelope change. Its channels close when ctx
// ends, though containerd's never do. A nil subscribe panics.
//
//	m.Run(ctx, containerd.FromSubscribe(client.Subscribe), filters...)
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
