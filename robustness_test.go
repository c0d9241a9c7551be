package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"
)

// A handler that ignores its ctx and never returns must not hang Shutdown:
// once the drain has nothing else to do, the stuck call is abandoned as
// Stop abandons it, at its deadline.
func TestShutdownDoesNotHangBehindAStuckHandler(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Second))
	started, release := r.gate(ev{"stuck", 1}) // ignores its ctx
	defer release()
	h.submit(t, ev{"stuck", 1})
	<-started
	h.submit(t, ev{"stuck", 2}, ev{"other", 1})

	done := make(chan error, 1)
	go func() { done <- h.m.Shutdown(context.Background()) }()
	waitFor(t, h.stopping, "Shutdown begins")
	h.clock.Step(time.Second + grace) // stuck/1 overruns: other/1 gets a worker, then nothing is left to drain
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrStopped)
		assert.ErrorContains(t, err, "abandoned 1 handler call")
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown(context.Background()) hangs behind a stuck handler")
	}

	assert.Equal(t, anys(ev{"other", 1}), r.handledList(), "the drain went on without the stuck key")
	drops := h.drops.all()
	require.Len(t, drops, 2)
	for _, d := range drops {
		assert.ErrorIs(t, d.Reason, ErrStopped)
	}
	assert.ElementsMatch(t, anys(ev{"stuck", 1}, ev{"stuck", 2}), append(drops[0].Events, drops[1].Events...))
	s := h.m.Stats()
	assert.Equal(t, s.Received, s.Handled+s.Dropped)
	release() // the abandoned goroutine returns and exits; goleak checks it
}

// Two Runs at once would both subscribe and handle every event twice: the
// second is refused, as is a Start while a Run reads (its subscription
// waits for the next Start), and Run works again once the reader is done.
func TestOneStreamReaderAtATime(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithConverter(testConverter))
	stream := newFakeStream()
	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() { first <- h.m.Run(ctx, stream) }()
	sub := <-stream.newSub

	require.ErrorIs(t, h.m.Run(context.Background(), stream), ErrAlreadyRunning)
	h.m.Subscribe(stream)
	kept := <-stream.newSub
	require.ErrorIs(t, <-h.m.Start(), ErrAlreadyRunning)
	require.NoError(t, kept.ctx.Err(), "the refused Start's subscription is kept for the next Start")

	sub.send(t, envelope(t, "ns", wrapperspb.String("c1")))
	waitFor(t, func() bool { return len(r.handledList()) == 1 }, "handled")
	cancel()
	require.NoError(t, <-first)

	errCh := h.m.Start() // reads the kept subscription; its reader blocks Run
	kept.send(t, envelope(t, "ns", wrapperspb.String("c2")))
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "handled by Start's reader")
	require.ErrorIs(t, h.m.Run(context.Background(), stream), ErrAlreadyRunning)
	kept.errs <- errors.New("broken")
	require.EqualError(t, <-errCh, "broken")

	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	again := make(chan error, 1)
	go func() { again <- h.m.Run(ctx, stream) }()
	sub = <-stream.newSub
	sub.send(t, envelope(t, "ns", wrapperspb.String("c3")))
	waitFor(t, func() bool { return len(r.handledList()) == 3 }, "handled by the second Run")
	cancel()
	require.NoError(t, <-again)
	assert.Equal(t, uint64(3), h.m.Stats().Handled, "nothing was handled twice")
}

// containerd's podsandbox controller calls Start with no subscription and
// treats its channel as the monitor's lifetime.
func TestBareStartLastsUntilStop(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r) // no converter either
	errCh := h.m.Start()
	r.fail(ev{"a", 1}, 1)
	h.submit(t, ev{"a", 1})
	waitFor(t, func() bool { return h.m.InBackoff("a") }, "a fails")
	h.settled(t)
	h.clock.Step(time.Second + grace)
	waitFor(t, func() bool { return len(r.handledList()) == 1 }, "the backoff replay runs")
	select {
	case err, open := <-errCh:
		t.Fatalf("Start's channel ended before Stop: %v, %v", err, open)
	default:
	}
	h.m.Stop()
	err, open := <-errCh
	assert.False(t, open, "closed at Stop")
	assert.NoError(t, err)
	require.ErrorIs(t, <-h.m.Start(), ErrStopped)
}

// Every drop of an event from the stream says its topic and namespace; at
// Stop, a key whose events came from several topics gives one Drop each.
func TestDropsSayWhereTheyCameFrom(t *testing.T) {
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { return errors.New("no") }),
		WithConverter(testConverter), WithMaxAttempts(1), WithBackoff(time.Hour, time.Hour))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	sub := <-stream.newSub
	sub.send(t, &Envelope{Namespace: "k8s.io", Topic: "/tasks/exit", Event: payload(t, wrapperspb.String("c1"))})
	waitFor(t, func() bool { return len(h.drops.all()) == 1 }, "given up after one attempt")
	d := h.drops.all()[0]
	assert.ErrorIs(t, d.Reason, ErrMaxAttempts)
	assert.Equal(t, "/tasks/exit", d.Topic)
	assert.Equal(t, "k8s.io", d.Namespace)

	h.m.Backoff("c2", ev{"c2", 1}) // waits an hour
	sub.send(t, &Envelope{Namespace: "k8s.io", Topic: "/tasks/start", Event: payload(t, wrapperspb.String("c2"))})
	sub.send(t, &Envelope{Namespace: "k8s.io", Topic: "/tasks/oom", Event: payload(t, wrapperspb.String("c2"))})
	sub.send(t, &Envelope{Namespace: "k8s.io", Topic: "/tasks/oom", Event: payload(t, wrapperspb.String("c2"))})
	waitFor(t, func() bool { return h.m.Stats().EventsInBackoff == 4 }, "queued behind the backoff")
	h.m.Stop()
	drops := h.drops.all()[1:]
	require.Len(t, drops, 3)
	for i, want := range []struct {
		topic  string
		events int
	}{{"", 1}, {"/tasks/start", 1}, {"/tasks/oom", 2}} {
		assert.Equal(t, "c2", drops[i].Key)
		assert.Equal(t, want.topic, drops[i].Topic, "drop %d", i)
		assert.Len(t, drops[i].Events, want.events, "drop %d", i)
		assert.ErrorIs(t, drops[i].Reason, ErrStopped)
	}
	s := h.m.Stats()
	assert.Equal(t, s.Received, s.Dropped)
}

// Programming errors are reported where they are made, not when the first
// event arrives.
func TestProgrammingErrorsPanicAtOnce(t *testing.T) {
	mux := NewMux()
	assert.PanicsWithValue(t, "eventmonitor: On[*wrapperspb.StringValue] with a nil function", func() {
		On[*wrapperspb.StringValue](mux, nil)
	})
	assert.PanicsWithValue(t, "eventmonitor: On with a nil Mux (make it with NewMux)", func() {
		On(nil, func(context.Context, string) error { return nil })
	})
	assert.PanicsWithValue(t, "eventmonitor: KeyOf[*wrapperspb.StringValue] with a nil key function", func() {
		KeyOf[*wrapperspb.StringValue](nil)
	})
	assert.PanicsWithValue(t, "eventmonitor: NewConverter: TypeKey 1 is zero (make it with KeyOf)", func() {
		NewConverter(KeyOf(func(*wrapperspb.StringValue) string { return "" }), TypeKey{})
	})

	h := newHarness(t, newRecorder())
	exitCh := make(chan fakeExit)
	build := exitOf("c1")
	assert.PanicsWithValue(t, "eventmonitor: WatchExit with a nil ctx", func() {
		var nilCtx context.Context
		WatchExit(nilCtx, h.m, "c1", exitCh, build)
	})
	assert.PanicsWithValue(t, "eventmonitor: WatchExit with a nil Monitor", func() {
		WatchExit(context.Background(), nil, "c1", exitCh, build)
	})
	assert.PanicsWithValue(t, "eventmonitor: WatchExit with a nil exit channel", func() {
		WatchExit[fakeExit](context.Background(), h.m, "c1", nil, build)
	})
	assert.PanicsWithValue(t, "eventmonitor: WatchExit with a nil event builder", func() {
		WatchExit(context.Background(), h.m, "c1", exitCh, nil)
	})
	assert.PanicsWithValue(t, "eventmonitor: WatchExitResult with a nil Monitor", func() {
		WatchExitResult(context.Background(), nil, "c1", exitCh, func(uint32, time.Time, error) any { return nil })
	})
	assert.PanicsWithValue(t, "eventmonitor: WatchExitResult with a nil event builder", func() {
		WatchExitResult(context.Background(), h.m, "c1", exitCh, nil)
	})
	assert.PanicsWithValue(t, "eventmonitor: Subscribe with a nil Subscriber", func() {
		h.m.Subscribe(nil)
	})
	assert.PanicsWithValue(t, "eventmonitor: Subscribe with a nil Subscriber", func() {
		h.m.Subscribe((*fakeStream)(nil)) // at once, not in the Subscriber
	})
}

// selfReadingErr is an error whose message reads the monitor, as a lazily
// formatting error type might.
type selfReadingErr struct{ m *Monitor }

func (e selfReadingErr) Error() string {
	return fmt.Sprintf("failed; %d handled so far", e.m.Stats().Handled)
}

// The handler's error is user code: the monitor neither formats it nor
// asks errors.Is of it under its lock. Once, giving up on an event
// (WithMaxAttempts) formatted it under mu, and an Error method reading the
// monitor deadlocked the worker and the monitor with it.
func TestHandlerErrorIsFormattedOutsideTheLock(t *testing.T) {
	var m *Monitor
	var drops dropLog
	m, err := New(HandlerFunc(func(context.Context, any) error { return selfReadingErr{m} }),
		WithMaxAttempts(1), WithClock(testclock.NewFakeClock(epoch)), WithDropHandler(drops.add),
		WithLogger(quietLogger()))
	require.NoError(t, err)
	require.NoError(t, m.Submit("a", ev{"a", 1}))
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done <- m.WaitIdle(ctx)
	}()
	select {
	case err := <-done:
		require.NoError(t, err)
		m.Stop()
	case <-time.After(5 * time.Second):
		t.Fatal("deadlock: the handler error's Error method ran under the monitor's lock")
	}
	d := drops.all()
	require.Len(t, d, 1)
	require.ErrorIs(t, d[0].Reason, ErrMaxAttempts)
	require.ErrorAs(t, d[0].Reason, new(selfReadingErr))
	require.Equal(t, "eventmonitor: gave up after max attempts (1): failed; 0 handled so far", d[0].Reason.Error())
}
