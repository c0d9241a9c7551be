package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/utils/clock"
	testclock "k8s.io/utils/clock/testing"
)

// fakeStream is a Subscriber whose subscriptions the test feeds and breaks.
type fakeStream struct {
	mu      sync.Mutex
	subs    []*fakeSub
	filters [][]string
	newSub  chan *fakeSub
}

type fakeSub struct {
	ctx  context.Context
	ch   chan *Envelope
	errs chan error
}

func newFakeStream() *fakeStream { return &fakeStream{newSub: make(chan *fakeSub, 16)} }

func (s *fakeStream) Subscribe(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error) {
	sub := &fakeSub{ctx: ctx, ch: make(chan *Envelope), errs: make(chan error, 1)}
	s.mu.Lock()
	s.subs = append(s.subs, sub)
	s.filters = append(s.filters, filters)
	s.mu.Unlock()
	s.newSub <- sub
	return sub.ch, sub.errs
}

// send delivers env unless the subscription ended.
func (sub *fakeSub) send(t *testing.T, env *Envelope) {
	t.Helper()
	select {
	case sub.ch <- env:
	case <-sub.ctx.Done():
		t.Fatalf("subscription ended before %v was delivered", env)
	}
}

func envelope(t testing.TB, ns string, v any) *Envelope {
	return &Envelope{Timestamp: epoch, Namespace: ns, Topic: "/test", Event: payload(t, v)}
}

// Without a converter Start refuses, and Subscribe opens no stream that
// would stay unread until Stop.
func TestStartNeedsConverter(t *testing.T) {
	h := newHarness(t, newRecorder())
	opened := 0
	h.m.Subscribe(SubscriberFunc(func(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error) {
		opened++
		return newFakeStream().Subscribe(ctx, filters...)
	}))
	require.ErrorIs(t, <-h.m.Start(), ErrNoConverter)
	assert.Zero(t, opened, "streams opened")
}

func TestStreamIntakeFiltersConvertsAndDrops(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithConverter(testConverter), WithNamespace("k8s.io"))
	stream := newFakeStream()
	h.m.Subscribe(stream, `topic~="/tasks/"`)
	errCh := h.m.Start()
	sub := <-stream.newSub
	assert.Equal(t, []string{`topic~="/tasks/"`}, stream.filters[0])

	sub.send(t, envelope(t, "k8s.io", wrapperspb.String("c1")))
	sub.send(t, envelope(t, "default", wrapperspb.String("c2")))                                                                               // filtered
	sub.send(t, envelope(t, "k8s.io", wrapperspb.Int64(3)))                                                                                    // not keyed: ignored
	sub.send(t, &Envelope{Namespace: "k8s.io", Event: &anypb.Any{TypeUrl: "no/such", Value: []byte{1}}})                                       // unknown URL: ignored
	sub.send(t, envelope(t, "k8s.io", wrapperspb.Int64(4)))                                                                                    // ignored again
	sub.send(t, &Envelope{Namespace: "k8s.io", Topic: "/json", Event: &anypb.Any{TypeUrl: "eventmonitor.test/jsonEvent", Value: []byte("{")}}) // garbage
	sub.send(t, &Envelope{Namespace: "k8s.io", Topic: "/none"})                                                                                // nil payload
	sub.send(t, nil)                                                                                                                           // nil envelope
	sub.send(t, envelope(t, "k8s.io", wrapperspb.String("")))                                                                                  // empty key
	sub.send(t, envelope(t, "k8s.io", &jsonEvent{ID: "c1", Code: 2}))

	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "two events handled")
	assert.Equal(t, "c1", r.handledList()[0].(*wrapperspb.StringValue).GetValue())
	assert.Equal(t, &jsonEvent{ID: "c1", Code: 2}, r.handledList()[1])

	drops := h.drops.all()
	want := []Drop{
		{Reason: ErrDecode, Topic: "/json", Namespace: "k8s.io"},
		{Reason: ErrInvalidEvent, Topic: "/none", Namespace: "k8s.io"},
		{Reason: ErrInvalidEvent},
		{Reason: ErrInvalidEvent, Topic: "/test", Namespace: "k8s.io", Events: anys(wrapperspb.String(""))},
	}
	require.Len(t, drops, len(want))
	for i, d := range drops {
		assert.ErrorIs(t, d.Reason, want[i].Reason, "drop %d", i)
		assert.Equal(t, want[i].Topic, d.Topic, "drop %d: where it came from", i)
		assert.Equal(t, want[i].Namespace, d.Namespace, "drop %d: where it came from", i)
		assert.Equal(t, len(want[i].Events), len(d.Events), "drop %d", i)
	}
	assert.Equal(t, `dropped an input that did not become an event (topic "/json", namespace "k8s.io"): `+
		`eventmonitor: cannot decode event: type "eventmonitor.test/jsonEvent": unexpected end of JSON input`, drops[0].String())

	s := h.m.Stats()
	assert.Equal(t, uint64(10), s.Received)
	assert.Equal(t, uint64(1), s.Filtered)
	assert.Equal(t, uint64(3), s.Ignored, "types the converter does not key are ignored, not dropped")
	assert.Equal(t, uint64(4), s.Dropped)
	assert.Equal(t, uint64(2), s.Handled)
	ignoredLines := h.entries("ignoring events of a type the converter has no key for; logged once per type")
	require.Len(t, ignoredLines, 2, "once per type URL")
	for _, line := range ignoredLines {
		assert.Equal(t, logrus.DebugLevel, line.Level)
	}

	sub.errs <- errors.New("stream broke")
	require.EqualError(t, <-errCh, "stream broke")
	_, open := <-errCh
	assert.False(t, open, "the error channel closes after the stream error")
}

// A converter's error makes no event, even with a value beside it: the
// Drop says none was made, also when the error's Is panics in errors.Is.
func TestAConvertersErrorMakesNoEvent(t *testing.T) {
	for _, c := range []struct {
		err  error
		want error
	}{{errors.New("bad bytes"), ErrDecode}, {panicIsErr{}, ErrInvalidEvent}} {
		conv := ConverterFunc(func(typeurl.Any) (string, any, error) { return "k", "half-decoded", c.err })
		stream := newFakeStream()
		h := newHarness(t, newRecorder(), WithConverter(conv))
		h.m.Subscribe(stream)
		h.m.Start()
		(<-stream.newSub).send(t, envelope(t, "ns", wrapperspb.String("x")))
		waitFor(t, func() bool { return len(h.drops.all()) == 1 }, "dropped")
		d := h.drops.all()[0]
		require.ErrorIs(t, d.Reason, c.want)
		require.Nil(t, d.Events, "%v", d)
		require.Equal(t, uint64(1), h.m.Stats().Dropped)
		h.m.Stop()
	}
}

// panicIsErr is an error whose Is panics.
type panicIsErr struct{}

func (panicIsErr) Error() string { return "bad bytes" }
func (panicIsErr) Is(error) bool { panic("Is panicked") }

func TestStopClosesStartsChannel(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	errCh := h.m.Start()
	sub := <-stream.newSub
	h.m.Stop()
	_, open := <-errCh
	assert.False(t, open, "closed without an error on Stop")
	<-sub.ctx.Done()
	require.ErrorIs(t, <-h.m.Start(), ErrStopped)
}

func TestKeyFunctionPanicIsADrop(t *testing.T) {
	conv := NewConverter(KeyOf(func(v *wrapperspb.StringValue) string { panic("bad key") }))
	h := newHarness(t, newRecorder(), WithConverter(conv))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	(<-stream.newSub).send(t, envelope(t, "ns", wrapperspb.String("x")))
	waitFor(t, func() bool { return len(h.drops.all()) == 1 }, "dropped")
	assert.ErrorIs(t, h.drops.all()[0].Reason, ErrInvalidEvent)
	assert.ErrorContains(t, h.drops.all()[0].Reason, "bad key")
}

func TestIntakeBackpressure(t *testing.T) {
	const limit, total = 3, 30
	var m *Monitor
	var mu sync.Mutex
	maxQueued := 0
	release := make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		<-release
		mu.Lock()
		maxQueued = max(maxQueued, m.Stats().Queued)
		mu.Unlock()
		return nil
	}), WithConverter(testConverter), WithIntakeLimit(limit))
	m = h.m
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	sub := <-stream.newSub
	go func() {
		for i := range total {
			sub.ch <- envelope(t, "ns", wrapperspb.String(string(rune('a'+i))))
		}
	}()
	waitFor(t, func() bool { return h.m.Stats().Queued == limit }, "intake fills up to its limit")
	close(release)
	waitFor(t, func() bool { return h.m.Stats().Handled == total }, "everything handled")
	assert.LessOrEqual(t, maxQueued, limit, "intake must not queue beyond its limit")
}

// Events of keys in backoff do not count against WithIntakeLimit: they wait
// for their due time, not for a worker, and counting them would let one
// failing key stop the stream for every other.
// WithMaxQueuedPerKey bounds them instead.
func TestIntakeLimitLeavesKeysInBackoffOut(t *testing.T) {
	handled := make(chan string, 1)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if v := e.(*wrapperspb.StringValue).GetValue(); v != "a" {
			handled <- v
			return nil
		}
		return errors.New("a's shim is not answering")
	}), WithConverter(testConverter), WithIntakeLimit(1), WithMaxQueuedPerKey(5), WithLogger(quietLogger()))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	sub := <-stream.newSub
	for range 20 {
		sub.ch <- envelope(t, "ns", wrapperspb.String("a"))
	}
	sub.ch <- envelope(t, "ns", wrapperspb.String("b"))
	select {
	case v := <-handled:
		require.Equal(t, "b", v)
	case <-time.After(10 * time.Second):
		t.Fatal("b was not handled: the stream stalled behind a's backoff")
	}
	h.settled(t)
	s := h.m.Stats()
	assert.Equal(t, 5, s.EventsInBackoff, "a holds WithMaxQueuedPerKey's 5 events: %+v", s)
	assert.Equal(t, uint64(15), s.Dropped, "the rest dropped with ErrQueueFull: %+v", s)
	for _, d := range h.drops.all() {
		assert.ErrorIs(t, d.Reason, ErrQueueFull)
	}
}

func TestRunResubscribesWithBackoff(t *testing.T) {
	const max = 400*time.Millisecond + time.Nanosecond
	r := newRecorder()
	stream := newFakeStream()
	clk := newSignallingClock()
	h := newHarness(t, r, WithConverter(testConverter), withSignallingClock(clk),
		WithResubscribe(100*time.Millisecond, max))
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error)
	go func() { runErr <- h.m.Run(ctx, stream) }()

	sub := <-stream.newSub
	// Failed subscriptions in a row: 100, 200, 400 ms apart (doubled
	// exactly, though half the odd maximum rounds down to 200 ms), then the
	// maximum.
	for _, wait := range []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, max, max} {
		sub.errs <- errors.New("broken")
		clk.waitTimer(t, wait) // Run's delay before re-subscribing
		h.clock.Step(wait - time.Nanosecond)
		select {
		case <-stream.newSub:
			t.Fatalf("re-subscribed before %v", wait)
		default:
		}
		h.clock.Step(time.Nanosecond)
		sub = <-stream.newSub
	}

	// A subscription that delivers resets the backoff.
	sub.send(t, envelope(t, "ns", wrapperspb.String("c1")))
	sub.errs <- errors.New("broken again")
	clk.waitTimer(t, 100*time.Millisecond) // the delay starts over
	h.clock.Step(100 * time.Millisecond)
	sub = <-stream.newSub
	sub.send(t, envelope(t, "ns", wrapperspb.String("c2")))
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "events from both subscriptions handled")
	assert.Equal(t, uint64(6), h.m.Stats().Resubscribed)

	cancel()
	require.NoError(t, <-runErr)
	<-sub.ctx.Done()
	require.NoError(t, h.m.Submit("still", ev{"still", 1}), "Run returning does not stop the monitor")
}

// A Run called again after one returned (its ctx ended while the stream
// was broken, or not) resyncs once its subscription is established: what
// was published in between went unread. The first Run does not.
func TestARunAfterARunResyncs(t *testing.T) {
	clk := newSignallingClock()
	resyncs := make(chan struct{}, 4)
	h := newHarness(t, newRecorder(), WithConverter(testConverter), withSignallingClock(clk),
		WithResubscribe(100*time.Millisecond, time.Second),
		WithResync(func(context.Context) error { resyncs <- struct{}{}; return nil }))
	stream := newFakeStream()
	ran := make(chan error, 1)
	for i, broken := range []bool{true, false, false} {
		ctx, cancel := context.WithCancel(context.Background())
		go func() { ran <- h.m.Run(ctx, stream) }()
		sub := <-stream.newSub
		sub.send(t, envelope(t, "ns", wrapperspb.String(fmt.Sprint("c", i)))) // established
		want := min(i, 1)
		waitFor(t, func() bool { return h.m.Stats().Received == uint64(i+1) && len(resyncs) == want }, "delivered")
		if broken {
			sub.errs <- errors.New("daemon restarted")
			clk.waitTimer(t, 100*time.Millisecond)
		}
		cancel()
		require.NoError(t, awaitErr(t, ran))
		require.Len(t, resyncs, want, "Run %d: a resync but on the first Run's first subscription", i)
		if want > 0 {
			<-resyncs
		}
	}
}

// The resync hook runs once per outage, once a new subscription is
// established: not after attempts the runtime refused while it was down,
// and beside the reading of the new stream.
func TestRunResyncsOncePerOutage(t *testing.T) {
	r := newRecorder()
	stream := newFakeStream()
	clk := newSignallingClock()
	resyncs := make(chan context.Context, 4)
	releaseResync := make(chan struct{})
	h := newHarness(t, r, WithConverter(testConverter), withSignallingClock(clk),
		WithResubscribe(100*time.Millisecond, time.Second),
		WithResync(func(ctx context.Context) error {
			resyncs <- ctx
			<-releaseResync
			return nil
		}))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- h.m.Run(ctx, stream) }()
	noResync := func(when string) {
		t.Helper()
		select {
		case <-resyncs:
			t.Fatalf("resync %s", when)
		default:
		}
	}

	sub := <-stream.newSub
	noResync("on the first subscription")
	sub.errs <- errors.New("daemon gone")
	for _, wait := range []time.Duration{100, 200, 400} { // refused at once while the daemon is down
		clk.waitTimer(t, wait*time.Millisecond)
		clk.forgetTimers() // the refused subscriptions' timers
		h.clock.Step(wait * time.Millisecond)
		sub = <-stream.newSub
		if wait < 400 {
			sub.errs <- errors.New("connection refused")
		}
	}
	noResync("after refused subscriptions")

	// Not refused within the initial delay: established, so the hook runs,
	// with a context that lives as long as the subscription.
	clk.waitTimer(t, 100*time.Millisecond)
	h.clock.Step(100 * time.Millisecond)
	resyncCtx := <-resyncs
	// The stream is read while the hook runs.
	sub.send(t, envelope(t, "ns", wrapperspb.String("during-resync")))
	waitFor(t, func() bool { return len(r.handledList()) == 1 }, "an event handled while the resync runs")
	releaseResync <- struct{}{}

	// A second outage: a subscription that delivers is established at once.
	sub.errs <- errors.New("daemon gone again")
	clk.waitTimer(t, 100*time.Millisecond) // the subscription delivered: the delay starts over
	<-resyncCtx.Done()
	h.clock.Step(100 * time.Millisecond)
	sub = <-stream.newSub
	sub.send(t, envelope(t, "ns", wrapperspb.String("after")))
	<-resyncs
	releaseResync <- struct{}{}
	noResync("twice for one outage")
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "the event after the outage handled")

	cancel()
	require.NoError(t, <-runErr)
}

func TestRunArguments(t *testing.T) {
	h := newHarness(t, newRecorder())
	require.ErrorIs(t, h.m.Run(context.Background(), nil), ErrInvalidOption)
	require.ErrorIs(t, h.m.Run(context.Background(), SubscriberFunc(nil)), ErrInvalidOption, "a typed nil too")
	require.ErrorIs(t, h.m.Run(context.Background(), newFakeStream()), ErrNoConverter)
}

func TestRunReturnsErrStoppedWhenTheMonitorStops(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter))
	stream := newFakeStream()
	runErr := make(chan error)
	go func() { runErr <- h.m.Run(context.Background(), stream) }()
	<-stream.newSub
	h.m.Stop()
	require.ErrorIs(t, <-runErr, ErrStopped)
}

var _ typeurl.Any = (*anypb.Any)(nil)

// TestStreamErrorWinsOverClosedChannel: a subscriber that sends its error
// and closes both channels at once has its error reported, not just
// ErrStreamClosed.
func TestStreamErrorWinsOverClosedChannel(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter))
	for range 20 { // the select in the reader would pick either at random
		ch, errs := make(chan *Envelope), make(chan error, 1)
		errs <- errors.New("rpc error: code = Unavailable")
		close(errs)
		close(ch)
		h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
			return ch, errs
		}))
		require.EqualError(t, <-h.m.Start(), "rpc error: code = Unavailable")
	}
}

// signallingClock is the harness's FakeClock, reporting every NewTimer call
// once its waiter is registered: a test steps the clock only when Run waits
// on it. (HasWaiters cannot tell: the scheduler's timer is a waiter too.)
type signallingClock struct {
	*testclock.FakeClock
	timers chan time.Duration
}

func newSignallingClock() *signallingClock {
	return &signallingClock{timers: make(chan time.Duration, 64)}
}

func (c *signallingClock) NewTimer(d time.Duration) clock.Timer {
	timer := c.FakeClock.NewTimer(d)
	select {
	case c.timers <- d:
	default: // nobody is watching timers; the scheduler re-arms its own
	}
	return timer
}

// withSignallingClock makes the monitor use clk over the harness's clock;
// newHarness fills in clk.FakeClock.
func withSignallingClock(clk *signallingClock) Option {
	return func(c *config) {
		clk.FakeClock = c.clock.(*testclock.FakeClock)
		c.clock = clk
	}
}

// forgetTimers forgets the NewTimer calls made so far.
func (c *signallingClock) forgetTimers() {
	for {
		select {
		case <-c.timers:
		default:
			return
		}
	}
}

// waitTimer waits for a NewTimer call of duration d.
func (c *signallingClock) waitTimer(t *testing.T, d time.Duration) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case got := <-c.timers:
			if got == d {
				return
			}
		case <-deadline:
			t.Fatalf("no timer of %v was made", d)
		}
	}
}

// lockProbeAny is a payload whose GetTypeUrl notes whether the monitor's
// mutex is held when it is called.
type lockProbeAny struct{ m *Monitor }

var readUnderLock atomic.Int32

func (a lockProbeAny) GetTypeUrl() string {
	if a.m.mu.TryLock() {
		a.m.mu.Unlock()
	} else {
		readUnderLock.Add(1)
	}
	return "eventmonitor.test/unknown"
}
func (a lockProbeAny) GetValue() []byte { return nil }

// No user code under mu. ingest once called env.Event.GetTypeUrl() (the
// payload is the subscriber's typeurl.Any: user code) with mu held, to log
// an ignored type once: a payload that looks at the monitor (or just
// blocks) held every Submit, worker and Stop.
func TestIgnoredPayloadIsNotReadUnderTheLock(t *testing.T) {
	readUnderLock.Store(0)
	m, err := New(HandlerFunc(func(context.Context, any) error { return nil }),
		WithConverter(ConverterFunc(func(typeurl.Any) (string, any, error) {
			return "", nil, ErrUnsupportedEvent
		})))
	require.NoError(t, err)
	ch := make(chan *Envelope)
	m.Subscribe(SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *Envelope, <-chan error) {
		return ch, nil
	}))
	m.Start()
	t.Cleanup(m.Stop)
	ch <- &Envelope{Topic: "/x", Event: lockProbeAny{m: m}}
	require.Eventually(t, func() bool { return m.Stats().Ignored == 1 }, 5*time.Second, time.Millisecond)
	require.Zero(t, readUnderLock.Load(), "payload's GetTypeUrl was called with the monitor's mutex held")
}

// Run waits out a resubscribe delay on clock.After, which holds its waiter
// on a fake clock until the clock reaches it: Run returning because its ctx
// ended first must not leave the waiter behind, or the idle monitor, and
// the stopped one, hold a timer on their clock.
func TestRunLeavesNoResubscribeTimerOnIdleMonitor(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter))
	broken := SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
		ch := make(chan *Envelope)
		close(ch) // the stream breaks at once
		return ch, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- h.m.Run(ctx, broken) }()
	// Nothing else is timed: the one waiter is Run's resubscribe delay.
	waitFor(t, h.clock.HasWaiters, "Run never waited out its resubscribe delay")
	cancel()
	select {
	case err := <-ran:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return once its ctx ended")
	}
	h.settled(t)
	require.False(t, h.clock.HasWaiters(), "idle monitor, Run returned: a timer is left on the clock")
	h.m.Stop()
	require.False(t, h.clock.HasWaiters(), "stopped monitor: a timer is left on the clock")
}

// An envelope Start's reader takes off the stream after Stop began is
// still accounted for: Received, then dropped with ErrStopped, before Stop
// returns (Stop waits for Start's reader). The reader's select picks the
// second envelope or intake's end at random; either way nothing read is
// lost.
func TestStartReaderDropsAnEnvelopeReadAfterStop(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	conv := ConverterFunc(func(p typeurl.Any) (string, any, error) {
		once.Do(func() { close(entered); <-release })
		return "a", ev{"a", 0}, nil
	})
	h := newHarness(t, newRecorder(), WithConverter(conv))
	ch := make(chan *Envelope, 2)
	ch <- &Envelope{Topic: "/t1", Event: payload(t, wrapperspb.String("a"))}
	ch <- &Envelope{Topic: "/t2", Event: payload(t, wrapperspb.String("a"))}
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
		return ch, nil
	}))
	h.m.Start()
	<-entered
	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	waitFor(t, h.stopping, "Stop began")
	close(release)
	<-stopped
	s := h.m.Stats()
	assertBalanced(t, s)
	read := 2 - len(ch)
	require.EqualValues(t, read, s.Received, "envelopes read off the channel: %d; %+v", read, s)
	require.Len(t, h.drops.all(), read, "every envelope read is dropped: the stop came first")
	for _, d := range h.drops.all() {
		require.ErrorIs(t, d.Reason, ErrStopped)
	}
}

// brokenWithBuffered is a subscription shaped as the containerd module's
// NewSubscriber makes one: the reader buffered n envelopes, then the stream
// failed, so its error follows them and both channels close.
func brokenWithBuffered(t *testing.T, n int) SubscriberFunc {
	return SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
		ch := make(chan *Envelope, n)
		errs := make(chan error, 1)
		for i := range n {
			ch <- envelope(t, "ns", wrapperspb.String(fmt.Sprintf("c%d", i)))
		}
		errs <- errors.New("rpc error: Unavailable")
		close(errs)
		close(ch)
		return ch, errs
	})
}

// Envelopes the runtime delivered before the stream broke are read, not
// lost with the subscription, though its error is ready beside them.
func TestStreamErrorTakesTheEnvelopesBufferedBeforeIt(t *testing.T) {
	const n = 8
	r := newRecorder()
	h := newHarness(t, r, WithConverter(testConverter))
	h.m.Subscribe(brokenWithBuffered(t, n))
	require.Error(t, <-h.m.Start(), "the stream's error is reported")
	h.settled(t)
	s := h.m.Stats()
	assertBalanced(t, s)
	assert.EqualValues(t, n, s.Handled, "%+v", s)
}

// panickyAny is a payload whose GetTypeUrl panics, as a typed nil
// pointer's would.
type panickyAny struct{ url *string }

func (a panickyAny) GetTypeUrl() string { return *a.url }
func (a panickyAny) GetValue() []byte   { return nil }

// The stream reader reads an ignored payload's type URL for its log line:
// a panic there is the payload's, recovered, and the envelope counted.
func TestIgnoredPayloadWhoseTypeURLPanicsIsCounted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) {
		cancel() // Run returns once this envelope is taken
		return "", nil, ErrUnsupportedEvent
	})
	h := newHarness(t, newRecorder(), WithConverter(conv))
	ch := make(chan *Envelope, 1)
	ch <- &Envelope{Topic: "/x", Event: panickyAny{}}
	var escaped any
	func() {
		defer func() { escaped = recover() }()
		_ = h.m.Run(ctx, SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
			return ch, nil
		}))
	}()
	require.Nil(t, escaped, "a payload's panic escaped the stream reader")
	s := h.m.Stats()
	assert.EqualValues(t, 1, s.Ignored, "%+v", s)
	assertBalanced(t, s)
}

// A bare Start (no Subscribe) while Shutdown waits for the reader is
// refused with ErrStopped at once, as Run and a Start with a subscription
// are (it once returned the lifetime channel, silent until Stop).
func TestBareStartIsRefusedWhileShutdownWaitsForTheReader(t *testing.T) {
	h, convert := readerInConverter(t) // Start took the subscription: the next Start is bare
	shut := shutdownBegun(t, h, context.Background())
	require.ErrorIs(t, h.m.Submit("x", ev{"x", 1}), ErrStopped, "intake has ended")

	errCh := h.m.Start()
	var got error
	select {
	case got = <-errCh:
	default:
	}
	convert()
	require.NoError(t, <-shut)
	require.ErrorIs(t, got, ErrStopped, "a bare Start after Shutdown was called is not refused at once")
}

// readerIs reports whether m's stream reader is at r.
func readerIs(m *Monitor, r reader) func() bool {
	return func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.stream.reader == r
	}
}

// startResult waits up to 10 s for what errCh delivers: the error, or
// open false if it closed without one.
func startResult(t *testing.T, errCh <-chan error) (err error, open bool) {
	t.Helper()
	select {
	case err, open = <-errCh:
		return err, open
	case <-time.After(10 * time.Second):
		t.Fatal("Start's channel neither delivered nor closed")
		return nil, false
	}
}

// A subscription that ends without an error while the monitor runs (errs
// closes, then the envelope channel: what containerd.FromSubscribe does
// when its source's errs closes or says nil while ctx lasts) ends Start's
// reading, and Start says so with ErrStreamClosed: a channel closed with
// no error is what Stop and Shutdown give. Whichever closed channel the
// reader's select sees first, the result is the same.
func TestStartReportsAStreamEndedWithoutAnError(t *testing.T) {
	const rounds = 20
	silent := 0
	for range rounds {
		h := newHarness(t, newRecorder(), WithConverter(testConverter))
		ch, errs := make(chan *Envelope), make(chan error, 1)
		h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
			return ch, errs
		}))
		errCh := h.m.Start()
		waitFor(t, readerIs(h.m, consuming), "Start's reader reads")
		close(errs) // FromSubscribe: defer close(ch); defer close(errs)
		close(ch)
		err, open := startResult(t, errCh)
		if !open {
			silent++
			continue
		}
		require.ErrorIs(t, err, ErrStreamClosed)
		require.False(t, h.stopping())
	}
	require.Zero(t, silent, "%d of %d streams that ended while the monitor ran closed Start's channel "+
		"with no error, as if the monitor had stopped", silent, rounds)
}

// The same with errs closed and the envelope channel left open.
func TestStartReportsErrsClosedWithoutAnError(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter))
	ch, errs := make(chan *Envelope), make(chan error)
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
		return ch, errs
	}))
	errCh := h.m.Start()
	waitFor(t, readerIs(h.m, consuming), "Start's reader reads")
	close(errs)
	err, open := startResult(t, errCh)
	waitFor(t, readerIs(h.m, noReader), "Start's reader left")
	require.True(t, open, "reading ended while the monitor runs, and Start's channel closed with no error")
	require.ErrorIs(t, err, ErrStreamClosed)
}

// Run treats the same end as a break: it re-subscribes.
func TestRunResubscribesAfterErrsClosedWithoutAnError(t *testing.T) {
	clk := newSignallingClock()
	h := newHarness(t, newRecorder(), WithConverter(testConverter), withSignallingClock(clk))
	stream := newFakeStream()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- h.m.Run(ctx, stream) }()
	sub := <-stream.newSub
	close(sub.errs)
	clk.waitTimer(t, DefaultResubscribeInitial)
	h.clock.Step(DefaultResubscribeInitial)
	select {
	case <-stream.newSub:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not re-subscribe after errs closed")
	}
	cancel()
	require.NoError(t, <-ran)
	require.True(t, readerIs(h.m, noReader)())
}

// The reader's slot goes back to noReader however Run and Start end
// (ctx, stream error, stream closed, a Subscriber that panics on Run's
// goroutine), so the next Run or Start is never refused with
// ErrAlreadyRunning once the previous one reported its end.
func TestReaderPlaceIsFreedHoweverReadingEnds(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter))
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 200 {
		switch rng.IntN(4) {
		case 0: // Run until ctx ends, maybe while an envelope is in hand
			stream := newFakeStream()
			ctx, cancel := context.WithCancel(context.Background())
			ran := make(chan error, 1)
			go func() { ran <- h.m.Run(ctx, stream) }()
			sub := <-stream.newSub
			if rng.IntN(2) == 0 {
				sub.send(t, envelope(t, "ns", wrapperspb.String(fmt.Sprintf("k%d", i%5))))
			}
			cancel()
			require.NoError(t, <-ran, "round %d", i)
		case 1: // Start whose stream breaks
			stream := newFakeStream()
			h.m.Subscribe(stream)
			errCh := h.m.Start()
			sub := <-stream.newSub
			sub.errs <- errors.New("broken")
			err, open := startResult(t, errCh)
			require.True(t, open, "round %d", i)
			require.EqualError(t, err, "broken", "round %d", i)
		case 2: // Start whose envelope channel closes
			ch := make(chan *Envelope)
			h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
				return ch, nil
			}))
			errCh := h.m.Start()
			close(ch)
			err, open := startResult(t, errCh)
			require.True(t, open, "round %d", i)
			require.ErrorIs(t, err, ErrStreamClosed, "round %d", i)
		case 3: // a Subscriber that panics on Run's goroutine
			var escaped any
			func() {
				defer func() { escaped = recover() }()
				_ = h.m.Run(context.Background(), SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
					panic("subscriber")
				}))
			}()
			require.Equal(t, "subscriber", escaped, "round %d", i)
		}
		require.True(t, readerIs(h.m, noReader)(), "round %d: the slot is not free once reading reported its end", i)
	}
	h.settled(t)
	assertBalanced(t, h.m.Stats())
	require.False(t, h.clock.HasWaiters(), "an idle monitor holds a timer")
}

// Every Stats snapshot balances while Start's reader floods a small intake
// limit, handlers fail into backoff, a goroutine steps the fake clock and
// another forgets keys, until Shutdown; afterwards every envelope the
// reader took (an unbuffered channel: a send that returned) is Received,
// no gauge is left, and the drop handler saw exactly Dropped events.
func TestStatsBalanceThroughAStartFloodAndShutdown(t *testing.T) {
	for round := range 5 {
		startFloodRound(t, round)
	}
}

func startFloodRound(t *testing.T, round int) {
	var calls atomic.Int64
	var dropped atomic.Int64
	var x exclusive
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		defer x.enter(keyOf(e))()
		if calls.Add(1)%5 == 0 {
			return errors.New("injected")
		}
		return nil
	}), WithConverter(testConverter), WithIntakeLimit(2), WithWorkers(3), WithMaxAttempts(3),
		WithHandleTimeout(0), // the stepped clock would make quick calls overrun
		WithLogger(quietLogger()), WithDropHandler(func(d Drop) { dropped.Add(int64(len(d.Events))) }))
	ch := make(chan *Envelope)
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil }))
	errCh := h.m.Start()

	var sent, forgotten atomic.Int64
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the runtime
		defer wg.Done()
		for j := 0; ; j++ {
			select {
			case ch <- envelope(t, "ns", wrapperspb.String(fmt.Sprintf("k%d", j%7))):
				sent.Add(1)
			case <-quit:
				return
			}
		}
	}()
	repeat(&wg, quit, func() { h.clock.Step(200 * time.Millisecond) }) // time
	j := 0
	repeat(&wg, quit, func() { // a relister forgetting deleted containers
		forgotten.Add(int64(len(h.m.Forget(fmt.Sprintf("k%d", j%7)))))
		j++
	})
	var bad atomic.Value
	repeat(&wg, quit, func() { // every snapshot balances
		if s := h.m.Stats(); s.Received != accounted(s) {
			bad.CompareAndSwap(nil, s)
		}
	})
	waitFor(t, func() bool { return h.m.Stats().Received >= 200 }, "round %d: intake moves", round)
	shut := make(chan error, 1)
	go func() { shut <- h.m.Shutdown(context.Background()) }()
	err := awaitErr(t, shut)
	close(quit)
	wg.Wait()
	_, open := startResult(t, errCh)
	require.False(t, open, "round %d: Start's channel closes without an error at Shutdown", round)

	require.Nil(t, bad.Load(), "round %d: a Stats snapshot did not balance", round)
	require.NoError(t, err, "round %d: nothing stuck, nothing cut: the drain was done", round)
	s := h.m.Stats()
	assertBalanced(t, s)
	assert.EqualValues(t, sent.Load(), s.Received, "round %d: every envelope read is received: %+v", round, s)
	assert.Zero(t, s.Queued+s.InFlight+s.EventsInBackoff, "round %d: %+v", round, s)
	assert.EqualValues(t, forgotten.Load(), s.Forgotten, "round %d", round)
	assert.EqualValues(t, dropped.Load(), s.Dropped, "round %d: drop handler vs Dropped", round)
	assert.False(t, x.twice.Load(), "round %d: a key on two goroutines", round)
	assert.False(t, h.clock.HasWaiters(), "round %d: a stopped monitor holds a timer", round)
}

// repeat calls fn on a goroutine of wg's, yielding in between, until quit
// closes.
func repeat(wg *sync.WaitGroup, quit <-chan struct{}, fn func()) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-quit:
				return
			default:
				fn()
				runtime.Gosched()
			}
		}
	}()
}

// A subscriber that closes errs as its ctx ends (containerd's does): at
// Stop and at Shutdown Start's channel closes silently, whichever closed
// channel the reader sees first; the reader's place is left free.
func TestStartClosesSilentlyAtStopAndShutdown(t *testing.T) {
	for _, how := range []string{"Stop", "Shutdown"} {
		t.Run(how, func(t *testing.T) {
			for round := range 30 {
				h := newHarness(t, newRecorder(), WithConverter(testConverter))
				h.m.Subscribe(SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *Envelope, <-chan error) {
					ch, errs := make(chan *Envelope), make(chan error)
					go func() {
						<-ctx.Done()
						close(errs)
						close(ch)
					}()
					return ch, errs
				}))
				errCh := h.m.Start()
				waitFor(t, readerIs(h.m, consuming), "Start's reader reads")
				if how == "Stop" {
					h.m.Stop()
				} else {
					require.NoError(t, h.m.Shutdown(context.Background()))
				}
				err, open := startResult(t, errCh)
				require.False(t, open, "round %d: Start's channel said %v at %s", round, err, how)
				require.True(t, readerIs(h.m, noReader)())
			}
		})
	}
}

// A Run after a Start whose stream broke resyncs: what was published
// between the two went unread.
func TestARunAfterAStartResyncs(t *testing.T) {
	resyncs := make(chan struct{}, 2)
	h := newHarness(t, newRecorder(), WithConverter(testConverter),
		WithResync(func(context.Context) error { resyncs <- struct{}{}; return nil }))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	sub := <-stream.newSub
	started := h.m.Start()
	sub.errs <- errors.New("daemon restarted")
	require.Error(t, awaitErr(t, started))

	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- h.m.Run(ctx, stream) }()
	(<-stream.newSub).send(t, envelope(t, "ns", wrapperspb.String("c"))) // established
	waitFor(t, func() bool { return len(resyncs) == 1 }, "a resync")
	cancel()
	require.NoError(t, awaitErr(t, ran))
	require.Len(t, resyncs, 1)
}

// Promise (Subscribe's doc): "Subscribing again before Start ends the
// earlier stream."
func TestSubscribingAgainEndsTheEarlierStream(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(NewConverter()))
	var first context.Context
	h.m.Subscribe(SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *Envelope, <-chan error) {
		first = ctx
		return make(chan *Envelope), make(chan error)
	}))
	h.m.Subscribe(SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *Envelope, <-chan error) {
		return make(chan *Envelope), make(chan error)
	}))
	require.Error(t, first.Err(), "the first stream's ctx is still live")
}

// Bound (maxLoggedOnce): the type URLs the stream reader remembers, to log
// an ignored type once, are bounded; past the bound an ignored type is
// counted, not logged.
func TestIgnoredTypeURLsAreRememberedUpToABound(t *testing.T) {
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) { return "", nil, ErrUnsupportedEvent })
	h := newHarness(t, newRecorder(), WithConverter(conv))
	for i := range maxLoggedOnce + 10 {
		h.m.ingest(context.Background(), &Envelope{Topic: "/t", Event: &anypb.Any{TypeUrl: fmt.Sprint("t/", i)}})
	}
	require.Equal(t, maxLoggedOnce, len(h.entries("ignoring events of a type the converter has no key for; logged once per type")))
	require.Equal(t, uint64(maxLoggedOnce+10), h.m.Stats().Ignored)
}

// Promise (ingest): at WithIntakeLimit the reader waits for room "until ctx
// ends or intake stops": Run's ctx ending frees it while the monitor, still
// running, has no room.
func TestIntakeWaitingForRoomEndsWithItsCtx(t *testing.T) {
	r := newRecorder()
	started, release := r.gate(ev{"a", 1})
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) { return "c", ev{"c", 1}, nil })
	h := newHarness(t, r, WithConverter(conv), WithIntakeLimit(1))
	t.Cleanup(release) // before the harness's Stop, which waits for the handler
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	<-started // a/1 runs on the only worker, b/1 waits: no room
	ctx, cancel := context.WithCancel(context.Background())
	defer context.AfterFunc(ctx, h.m.wakeWaiters)() // as consume does
	done := make(chan struct{})
	go func() { h.m.ingest(ctx, &Envelope{Topic: "/t", Event: &anypb.Any{TypeUrl: "t/c"}}); close(done) }()
	waitFor(t, func() bool { return goroutinesIn("(*Monitor).ingest", "sync.(*Cond).Wait") == 1 }, "ingest waits for room")
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("ingest still waits for room after its ctx ended")
	}
}
