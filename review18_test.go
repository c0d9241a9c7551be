package eventmonitor

// Review 18: each test fails on the code it was written against, for the
// reason in its comment.

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// A Stop that begins after Shutdown was called, while Shutdown waits for
// an envelope the reader took, drops what Shutdown was to drain (here b/1,
// queued behind a/1 on the one worker). Shutdown's doc: nil "once its
// drain is done, or if a Stop had already begun", else an error wrapping
// ErrStopped for "a Stop that began before the drain was done". This Stop
// had not begun when Shutdown was called, and the drain never ran; yet
// Shutdown returns nil, because it decides "a Stop had already begun"
// only after its wait for the reader.
func TestReview18ShutdownReportsAStopBegunWhileItWaitedForTheReader(t *testing.T) {
	entered, converting := make(chan struct{}), make(chan struct{})
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) {
		close(entered)
		<-converting
		return "r", ev{"r", 0}, nil
	})
	r := newRecorder()
	h := newHarness(t, r, WithConverter(conv))
	started, release := r.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1}, ev{"b", 1}) // b/1 waits for the one worker
	<-started

	ch := make(chan *Envelope, 1)
	ch <- &Envelope{Topic: "/t", Event: payload(t, wrapperspb.String("r"))}
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil }))
	h.m.Start()
	<-entered // the reader holds an envelope: Shutdown waits for it

	shut := shutdownBegun(t, h, context.Background())
	stopped := make(chan struct{})
	go func() { defer close(stopped); h.m.Stop() }()
	waitFor(t, h.stopping, "Stop began")
	release()         // a/1 returns: Stop's wait for calls ends
	close(converting) // the envelope is refused: Stop and Shutdown go on
	<-stopped
	err := <-shut

	reason, ok := dropReason(h, ev{"b", 1})
	require.True(t, ok, "b/1 was dropped by the Stop: %+v", h.drops.all())
	require.ErrorIs(t, reason, ErrStopped)
	require.ErrorIs(t, err, ErrStopped, "Shutdown's drain never ran and b/1 was dropped, yet it returned %v", err)
}

// Shutdown whose ctx has already ended "stops at once, abandoning every
// call in progress"; an event still waiting at the stop is dropped with
// ErrStopped. Here no call is in progress: the one event waits in backoff,
// not due for a second. Shutdown nevertheless starts its drain (draining
// replays every backoff queue at once), so a worker takes the event and
// Stop abandons that call: Retried counts a replay, the drop says the
// handler was "still running when Shutdown's ctx ended" though it never
// was, and in a few runs in a hundred the handler is then called with the
// event it was told was dropped (the very thing
// TestAbandonedCallNeverInvokesHandler forbids), after Shutdown returned.
func TestReview18ShutdownWithAnEndedCtxStartsNoCall(t *testing.T) {
	var calls atomic.Int32
	block := make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		calls.Add(1)
		<-block
		return nil
	}))
	defer close(block)
	h.m.Backoff("a", ev{"a", 1}) // due at epoch+1s; the clock never moves
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, h.m.Shutdown(ctx), context.Canceled)

	reason, ok := dropReason(h, ev{"a", 1})
	require.True(t, ok, "a/1 dropped")
	require.ErrorIs(t, reason, ErrStopped)
	s := h.m.Stats()
	assert.Zero(t, s.Retried, "a replay started after Shutdown's ctx had ended: %+v", s)
	assert.NotContains(t, reason.Error(), "still running",
		"a/1 was waiting in backoff when Shutdown was called, not in a handler")
	assert.Zero(t, calls.Load(), "handler called for an event dropped by a Shutdown whose ctx had ended")
}

// dropReason returns the reason e was dropped for, and whether it was.
func dropReason(h *harness, e any) (error, bool) {
	for _, d := range h.drops.all() {
		for _, x := range d.Events {
			if x == e {
				return d.Reason, true
			}
		}
	}
	return nil, false
}

// Start's doc (and docs/migrating.md): its channel delivers ErrStopped at
// once for a Start "once Stop or Shutdown was called", and Run and Start
// with a subscription do so while Shutdown waits for the reader (review
// 17). A bare Start (no Subscribe) in that window is not refused: it
// returns the lifetime channel, which delivers nothing and is closed at
// Stop, because Start's bare branch checks the state but not intake.
func TestReview18BareStartIsRefusedWhileShutdownWaitsForTheReader(t *testing.T) {
	entered, converting := make(chan struct{}), make(chan struct{})
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) {
		close(entered)
		<-converting
		return "r", ev{"r", 0}, nil
	})
	h := newHarness(t, newRecorder(), WithConverter(conv))
	ch := make(chan *Envelope, 1)
	ch <- &Envelope{Topic: "/t", Event: payload(t, wrapperspb.String("r"))}
	ran := make(chan error, 1)
	go func() {
		ran <- h.m.Run(context.Background(), SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
			return ch, nil
		}))
	}()
	<-entered
	shut := shutdownBegun(t, h, context.Background())
	require.ErrorIs(t, h.m.Submit("x", ev{"x", 1}), ErrStopped, "intake has ended")

	errCh := h.m.Start()
	var got error
	select {
	case got = <-errCh:
	default:
	}
	close(converting)
	require.NoError(t, <-shut)
	require.ErrorIs(t, <-ran, ErrStopped)
	require.ErrorIs(t, got, ErrStopped, "a bare Start after Shutdown was called is not refused at once")
}

// Drop.Reason "wraps ErrDecode, ErrInvalidEvent, ErrMaxAttempts,
// ErrQueueFull or ErrStopped", and errors.go: "Every error the monitor ...
// puts in a Drop wraps one of these". An error of a Converter other than
// NewConverter's (a ConverterFunc, containerd's own) is put in the Drop as
// it is: it wraps none of them, so errors.Is finds no reason and the
// prometheus collector labels the drop "other".
func TestReview18ConverterErrorDropWrapsASentinel(t *testing.T) {
	boom := errors.New("converter: no such field")
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) { return "", nil, boom })
	h := newHarness(t, newRecorder(), WithConverter(conv))
	ch := make(chan *Envelope, 1)
	ch <- &Envelope{Topic: "/t", Namespace: "ns", Event: payload(t, wrapperspb.String("k"))}
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil }))
	h.m.Start()
	waitFor(t, func() bool { return len(h.drops.all()) == 1 }, "the envelope is dropped")
	reason := h.drops.all()[0].Reason
	require.ErrorIs(t, reason, boom, "the converter's error is kept")
	var wrapsOne bool
	for _, sentinel := range []error{ErrDecode, ErrInvalidEvent, ErrMaxAttempts, ErrQueueFull, ErrStopped} {
		wrapsOne = wrapsOne || errors.Is(reason, sentinel)
	}
	assert.True(t, wrapsOne, "Drop.Reason %q wraps none of the documented sentinels", reason)
}
