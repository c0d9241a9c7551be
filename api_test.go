package eventmonitor_test

// Tests through the public API only: what a user of the package sees. Their
// shared helpers are in apiharness_test.go.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

// subscription is one stream of a fakeSubscriber, which the test feeds and
// breaks.
type subscription struct {
	ch   chan *eventmonitor.Envelope
	errs chan error
}

// fakeSubscriber is a Subscriber: every Subscribe hands out a fresh stream
// the test controls.
type fakeSubscriber struct{ subs chan subscription }

func newFakeSubscriber() *fakeSubscriber { return &fakeSubscriber{subs: make(chan subscription, 16)} }

func (s *fakeSubscriber) Subscribe(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
	st := subscription{ch: make(chan *eventmonitor.Envelope), errs: make(chan error, 1)}
	s.subs <- st
	return st.ch, st.errs
}

func (s *fakeSubscriber) next(t *testing.T) subscription {
	t.Helper()
	select {
	case st := <-s.subs:
		return st
	case <-time.After(10 * time.Second):
		t.Fatal("no subscription")
	}
	return subscription{}
}

func stringEnvelope(t *testing.T, key string) *eventmonitor.Envelope {
	t.Helper()
	a, err := typeurl.MarshalAny(wrapperspb.String(key))
	require.NoError(t, err)
	return &eventmonitor.Envelope{Timestamp: time.Now(), Namespace: "ns", Topic: "/t", Event: a}
}

var stringConverter = eventmonitor.NewConverter(eventmonitor.KeyOf(func(v *wrapperspb.StringValue) string {
	return v.GetValue()
}))

// Shutdown's wait abandons every call once its ctx ends, whoever began the
// stop: with a Stop already waiting on a call that ignores its ctx (Stop is
// safe for concurrent use), Shutdown once skipped its ctx handling and
// called Stop, which waited for ever.
func TestShutdownHonoursCtxWhileStopWaits(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	gate := make(chan struct{})
	started := make(chan struct{})
	var once sync.Once
	var drops dropRecorder
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		once.Do(func() { close(started) })
		<-gate // ignores ctx
		return nil
	}), eventmonitor.WithHandleTimeout(0), eventmonitor.WithLogger(quietLogger()),
		eventmonitor.WithDropHandler(drops.record))
	require.NoError(t, err)
	require.NoError(t, m.Submit("stuck", seqEvent{"stuck", 1}))
	<-started

	stopDone := make(chan struct{})
	go func() { m.Stop(); close(stopDone) }()
	// WatchExit's channel closes once Stop began.
	never := make(chan eventmonitor.ExitStatus)
	<-eventmonitor.WatchExit(context.Background(), m, "w", (<-chan eventmonitor.ExitStatus)(never),
		func(uint32, time.Time) any { return seqEvent{"w", 1} })

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	shutDone := make(chan struct{})
	var shutErr error
	go func() { shutErr = m.Shutdown(ctx); close(shutDone) }()
	returned := closesWithin(shutDone, 3*time.Second)
	close(gate)
	<-shutDone
	<-stopDone
	require.True(t, returned, "Shutdown with a 100ms ctx had not returned 3s later (a concurrent Stop waits for a stuck call)")
	require.ErrorIs(t, shutErr, context.DeadlineExceeded)
}

// A call checks, just before the handler, that it was not abandoned: a call
// Shutdown abandoned (ctx ended) after a worker took it but before the
// handler began (here: logging the replay's start) was once still made
// afterwards, so its event was both dropped and handled.
func TestAbandonedCallNeverInvokesHandler(t *testing.T) {
	before := goleak.IgnoreCurrent()
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	l := logrus.New()
	l.SetOutput(io.Discard)
	hook := &blockingHook{msg: "retrying backed-off events", entered: make(chan struct{}), release: make(chan struct{})}
	l.AddHook(hook)
	var calls atomic.Int32
	var drops dropRecorder
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		calls.Add(1)
		return nil
	}), eventmonitor.WithClock(clk), eventmonitor.WithLogger(logrus.NewEntry(l)),
		eventmonitor.WithDropHandler(drops.record))
	require.NoError(t, err)
	e := seqEvent{"a", 1}
	m.Backoff("a", e)
	clk.Step(time.Second) // the replay starts: a worker takes the call and logs its start
	select {
	case <-hook.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("replay never started")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err = m.Shutdown(ctx)
	require.ErrorIs(t, err, context.Canceled)
	d := drops.all()
	require.Len(t, d, 1)
	require.ErrorIs(t, d[0].Reason, eventmonitor.ErrStopped)
	require.Equal(t, []any{e}, d[0].Events)
	close(hook.release)
	// Wait until the worker goroutine is gone, then look at what it did.
	require.NoError(t, goleak.Find(before))
	require.Zero(t, calls.Load(), "handler called for an event Shutdown already dropped (after Shutdown returned)")
}

type blockingHook struct {
	msg     string
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (h *blockingHook) Levels() []logrus.Level { return logrus.AllLevels }
func (h *blockingHook) Fire(e *logrus.Entry) error {
	if e.Message == h.msg {
		first := false
		h.once.Do(func() { first = true })
		if first {
			close(h.entered)
			<-h.release
		}
	}
	return nil
}

// After an outage, Run stops its resync delay's timer once its first
// envelope establishes the new subscription: it once kept the timer until
// the stream ended, so an idle monitor held a timer on its clock.
func TestResyncTimerStoppedOnceEstablished(t *testing.T) {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	var resyncs atomic.Int32
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error { return nil }),
		eventmonitor.WithClock(clk), eventmonitor.WithConverter(stringConverter), eventmonitor.WithLogger(quietLogger()),
		eventmonitor.WithResync(func(context.Context) error { resyncs.Add(1); return nil }))
	require.NoError(t, err)
	defer m.Stop()
	sub := newFakeSubscriber()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { _ = m.Run(ctx, sub); close(ran) }()
	defer func() { cancel(); <-ran }()

	first := sub.next(t)
	first.errs <- errors.New("daemon gone")
	if !waitUntil(10*time.Second, clk.HasWaiters) {
		t.Fatal("timed out waiting: Run's resubscribe delay")
	}
	clk.Step(eventmonitor.DefaultResubscribeInitial)
	second := sub.next(t)
	second.ch <- stringEnvelope(t, "c1")
	if !waitUntil(10*time.Second, func() bool { return m.Stats().Handled == 1 && resyncs.Load() == 1 }) {
		t.Fatal("timed out waiting: handled and resynced")
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	require.NoError(t, m.WaitIdle(wctx))
	require.False(t, clk.HasWaiters(), "idle monitor, healthy stream: a timer is left on the clock (%+v)", m.Stats())
}

// An abandoned call reports no metrics when it returns: Stop accounted for
// it. A call Stop abandoned had its event dropped, yet once, when it
// returned later, the monitor reported its duration and the event as
// Recovered, after Stop had returned.
func TestAbandonedCallReportsNoMetrics(t *testing.T) {
	before := goleak.IgnoreCurrent()
	gate := make(chan struct{})
	started := make(chan struct{})
	var n atomic.Int32
	var drops dropRecorder
	mt := &countingMetrics{}
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		if n.Add(1) == 1 {
			return errors.New("first call fails")
		}
		close(started)
		<-gate // the replay ignores its ctx
		return nil
	}), eventmonitor.WithHandleTimeout(20*time.Millisecond), eventmonitor.WithBackoff(time.Millisecond, time.Millisecond),
		eventmonitor.WithLogger(quietLogger()), eventmonitor.WithDropHandler(drops.record), eventmonitor.WithMetrics(mt))
	require.NoError(t, err)
	require.NoError(t, m.Submit("a", seqEvent{"a", 1}))
	<-started
	m.Stop() // abandons the replay once it overruns
	s := m.Stats()
	require.Equal(t, uint64(1), s.Dropped)
	require.Zero(t, s.Handled)
	close(gate)
	// goleak waits for the abandoned call's goroutine to leave.
	require.NoError(t, goleak.Find(before))
	require.Equal(t, int32(1), mt.done.Load(), "HandlerDone for the first, failed call only, none for the abandoned one")
	require.Zero(t, mt.recovered.Load(), "an event dropped at Stop reported as Recovered")
	require.Equal(t, int32(1), mt.dropped.Load(), "the abandoned call's drop reported once")
}

type countingMetrics struct {
	done, recovered, dropped atomic.Int32
}

func (b *countingMetrics) HandlerDone(time.Duration, error) { b.done.Add(1) }
func (b *countingMetrics) Recovered(time.Duration)          { b.recovered.Add(1) }
func (b *countingMetrics) Dropped(error, int)               { b.dropped.Add(1) }

// An event given to Backoff while its key replays waits the initial delay
// once the replay is done, as Backoff on a key running any other call does.
// It is not part of the replay, and once left backoff with the key when the
// replay succeeded and was handled at once, with no delay.
func TestBackoffDuringAReplayWaitsTheInitialDelay(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clk := testclock.NewFakeClock(t0)
	gate := make(chan struct{})
	started := make(chan struct{})
	var mu sync.Mutex
	var calls []string
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		ev := e.(seqEvent)
		mu.Lock()
		calls = append(calls, fmt.Sprintf("%v@%v", ev, clk.Now().Sub(t0)))
		n := len(calls)
		mu.Unlock()
		switch {
		case ev.Seq == 1 && n == 1:
			return errors.New("not yet")
		case ev.Seq == 1:
			close(started)
			<-gate
		}
		return nil
	}), eventmonitor.WithClock(clk), eventmonitor.WithLogger(quietLogger()))
	require.NoError(t, err)
	defer m.Stop()
	require.NoError(t, m.Submit("a", seqEvent{"a", 1}))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, m.WaitIdle(ctx))
	clk.Step(time.Second) // the replay: a/1 runs and blocks
	<-started
	m.Backoff("a", seqEvent{"a", 2}) // straight into a's backoff queue
	require.True(t, m.InBackoff("a"))
	close(gate)
	require.NoError(t, m.WaitIdle(ctx))
	mu.Lock()
	got := append([]string(nil), calls...)
	mu.Unlock()
	require.Equal(t, []string{"a/1@0s", "a/1@1s"}, got,
		"an event given to Backoff was handled without any backoff delay (Pending %+v)", m.Pending())
}
