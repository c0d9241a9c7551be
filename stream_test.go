package eventmonitor

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
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

func TestStartNeedsSubscribe(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter))
	err, ok := <-h.m.Start()
	require.True(t, ok)
	require.ErrorIs(t, err, ErrNotSubscribed)
}

func TestStartNeedsConverter(t *testing.T) {
	h := newHarness(t, newRecorder())
	h.m.Subscribe(newFakeStream())
	require.ErrorIs(t, <-h.m.Start(), ErrNoConverter)
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
	sub.send(t, envelope(t, "default", wrapperspb.String("c2")))                                                               // filtered
	sub.send(t, envelope(t, "k8s.io", wrapperspb.Int64(3)))                                                                    // unsupported
	sub.send(t, &Envelope{Namespace: "k8s.io", Event: &anypb.Any{TypeUrl: "no/such", Value: []byte{1}}})                       // unknown URL
	sub.send(t, &Envelope{Namespace: "k8s.io", Event: &anypb.Any{TypeUrl: "eventmonitor.test/jsonEvent", Value: []byte("{")}}) // garbage
	sub.send(t, &Envelope{Namespace: "k8s.io"})                                                                                // nil payload
	sub.send(t, nil)                                                                                                           // nil envelope
	sub.send(t, envelope(t, "k8s.io", wrapperspb.String("")))                                                                  // empty key
	sub.send(t, envelope(t, "k8s.io", &jsonEvent{ID: "c1", Code: 2}))

	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "two events handled")
	assert.Equal(t, "c1", r.handledList()[0].(*wrapperspb.StringValue).GetValue())
	assert.Equal(t, &jsonEvent{ID: "c1", Code: 2}, r.handledList()[1])

	reasons := []error{ErrUnsupportedEvent, ErrUnsupportedEvent, ErrDecode, ErrInvalidEvent, ErrInvalidEvent, ErrInvalidEvent}
	drops := h.drops.all()
	require.Len(t, drops, len(reasons))
	for i, d := range drops {
		assert.ErrorIs(t, d.Reason, reasons[i], "drop %d", i)
	}
	assert.Nil(t, drops[0].Events, "an undecodable envelope has no events")
	require.Len(t, drops[5].Events, 1, "an event with an empty key is handed over")

	s := h.m.Stats()
	assert.Equal(t, uint64(9), s.Received)
	assert.Equal(t, uint64(1), s.Filtered)
	assert.Equal(t, uint64(6), s.Dropped)
	assert.Equal(t, uint64(2), s.Handled)

	sub.errs <- errors.New("stream broke")
	require.EqualError(t, <-errCh, "stream broke")
	_, open := <-errCh
	assert.False(t, open, "the error channel closes after the stream error")
}

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

func TestRunResubscribesWithBackoffAndResyncs(t *testing.T) {
	r := newRecorder()
	var resyncs int
	var resyncMu sync.Mutex
	stream := newFakeStream()
	clk := &signallingClock{afters: make(chan time.Duration, 1)}
	h := newHarness(t, r, WithConverter(testConverter), withSignallingClock(clk),
		WithResubscribe(100*time.Millisecond, 400*time.Millisecond),
		WithResync(func(ctx context.Context) error {
			resyncMu.Lock()
			defer resyncMu.Unlock()
			resyncs++
			return nil
		}))
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error)
	go func() { runErr <- h.m.Run(ctx, stream) }()

	resyncCount := func() int { resyncMu.Lock(); defer resyncMu.Unlock(); return resyncs }
	sub := <-stream.newSub
	assert.Zero(t, resyncCount(), "no resync on the first subscription")

	// Three failed subscriptions in a row: 100, 200, 400 ms apart.
	for i, wait := range []time.Duration{100, 200, 400, 400} {
		sub.errs <- errors.New("broken")
		require.Equal(t, wait*time.Millisecond, clk.waitAfter(t), "Run's delay before re-subscribing")
		h.clock.Step(wait*time.Millisecond - time.Nanosecond)
		select {
		case <-stream.newSub:
			t.Fatalf("re-subscribed before %v", wait)
		default:
		}
		h.clock.Step(time.Nanosecond)
		sub = <-stream.newSub
		waitFor(t, func() bool { return resyncCount() == i+1 }, "resync after re-subscription %d", i+1)
	}

	// A subscription that delivers resets the backoff.
	sub.send(t, envelope(t, "ns", wrapperspb.String("c1")))
	sub.errs <- errors.New("broken again")
	require.Equal(t, 100*time.Millisecond, clk.waitAfter(t), "the delay starts over")
	h.clock.Step(100 * time.Millisecond)
	sub = <-stream.newSub
	sub.send(t, envelope(t, "ns", wrapperspb.String("c2")))
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "events from both subscriptions handled")
	assert.Equal(t, uint64(5), h.m.Stats().Resubscribed)

	cancel()
	require.NoError(t, <-runErr)
	<-sub.ctx.Done()
	require.NoError(t, h.m.Submit("still", ev{"still", 1}), "Run returning does not stop the monitor")
}

func TestRunArguments(t *testing.T) {
	h := newHarness(t, newRecorder())
	require.ErrorIs(t, h.m.Run(context.Background(), nil), ErrInvalidOption)
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

// signallingClock is the harness's FakeClock, reporting every After call
// once its waiter is registered: a test steps the clock only when Run waits
// on it. (HasWaiters cannot tell: the scheduler's timer is a waiter too.)
type signallingClock struct {
	*testclock.FakeClock
	afters chan time.Duration
}

func (c *signallingClock) After(d time.Duration) <-chan time.Time {
	ch := c.FakeClock.After(d)
	c.afters <- d
	return ch
}

// withSignallingClock makes the monitor use clk over the harness's clock;
// newHarness fills in clk.FakeClock.
func withSignallingClock(clk *signallingClock) Option {
	return func(c *config) {
		clk.FakeClock = c.clock.(*testclock.FakeClock)
		c.clock = clk
	}
}

// waitAfter returns the delay of the next After call.
func (c *signallingClock) waitAfter(t *testing.T) time.Duration {
	t.Helper()
	select {
	case d := <-c.afters:
		return d
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not wait on the clock")
		return 0
	}
}
