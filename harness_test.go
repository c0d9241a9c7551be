package eventmonitor_test

// The shared helpers of the package's tests, which go through the public
// API only (backoff_test.go, inside the package, tests the backoff queue).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// ev is the typed event of most tests: a key and its sequence number.
type ev struct {
	Key string
	Seq int
}

func (e ev) String() string { return fmt.Sprintf("%s/%d", e.Key, e.Seq) }

func evs(key string, seqs ...int) []any {
	out := make([]any, len(seqs))
	for i, s := range seqs {
		out[i] = ev{key, s}
	}
	return out
}

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// recorder is a Handler that records every call with the fake clock's time,
// notes a key handled on two goroutines at once, and fails or blocks the
// events a test names.
type recorder struct {
	clk      *testclock.FakeClock
	mu       sync.Mutex
	calls    []call
	running  map[string]int
	overlap  []string         // keys seen running twice at once
	failures map[any]int      // fail this event this many more times
	gates    map[any]chan any // block this event until closed
	started  map[any]chan struct{}
}

// call is one handler call as the recorder saw it.
type call struct {
	Event any
	At    time.Duration // since epoch, on the fake clock
	Err   error
}

func newRecorder(clk *testclock.FakeClock) *recorder {
	return &recorder{clk: clk, running: map[string]int{}, failures: map[any]int{},
		gates: map[any]chan any{}, started: map[any]chan struct{}{}}
}

func keyOf(e any) string {
	if e, ok := e.(ev); ok {
		return e.Key
	}
	return fmt.Sprint(e)
}

func (r *recorder) HandleEvent(ctx context.Context, e any) error {
	key := keyOf(e)
	r.mu.Lock()
	if r.running[key]++; r.running[key] > 1 {
		r.overlap = append(r.overlap, key)
	}
	at := time.Duration(0)
	if r.clk != nil {
		at = r.clk.Now().Sub(epoch)
	}
	gate := r.gates[e]
	if s, ok := r.started[e]; ok {
		close(s)
		delete(r.started, e)
	}
	var err error
	if r.failures[e] > 0 {
		r.failures[e]--
		err = fmt.Errorf("injected failure of %v", e)
	}
	r.mu.Unlock()
	if gate != nil {
		<-gate
	}
	r.mu.Lock()
	r.running[key]--
	r.calls = append(r.calls, call{Event: e, At: at, Err: err})
	r.mu.Unlock()
	return err
}

// fail makes e's next n calls fail.
func (r *recorder) fail(e any, n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures[e] = n
}

// gate makes e's calls block until release is called; started closes when
// the first begins.
func (r *recorder) gate(e any) (started <-chan struct{}, release func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	g, s := make(chan any), make(chan struct{})
	r.gates[e], r.started[e] = g, s
	var once sync.Once
	return s, func() { once.Do(func() { close(g) }) }
}

// log returns every call so far, in the order they returned.
func (r *recorder) log() []call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]call(nil), r.calls...)
}

// handled is the events whose calls succeeded, in order; of key only if
// key is given.
func (r *recorder) handled(key ...string) []any {
	var out []any
	for _, c := range r.log() {
		if c.Err == nil && (len(key) == 0 || keyOf(c.Event) == key[0]) {
			out = append(out, c.Event)
		}
	}
	return out
}

// overlapped is the keys ever handled on two goroutines at once.
func (r *recorder) overlapped() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.overlap...)
}

// drops collects what reaches the drop handler.
type drops struct {
	mu  sync.Mutex
	all []eventmonitor.Drop
}

func (d *drops) add(x eventmonitor.Drop) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.all = append(d.all, x)
}

func (d *drops) list() []eventmonitor.Drop {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]eventmonitor.Drop(nil), d.all...)
}

// reason is why event was dropped; nil if it was not.
func (d *drops) reason(event any) error {
	for _, x := range d.list() {
		for _, e := range x.Events {
			if e == event {
				return x.Reason
			}
		}
	}
	return nil
}

// events is every dropped event, in order.
func (d *drops) events() []any {
	var out []any
	for _, x := range d.list() {
		out = append(out, x.Events...)
	}
	return out
}

// harness is a monitor on a fake clock with a recorder, its drops and its
// log; cleanup stops it and checks that no goroutine outlived Stop.
type harness struct {
	m     *eventmonitor.Monitor
	clk   *testclock.FakeClock
	rec   *recorder
	drops *drops
	logs  *logtest.Hook
}

// newHarness builds a monitor on a fake clock; h nil means the harness's
// recorder handles.
func newHarness(t *testing.T, h eventmonitor.Handler, opts ...eventmonitor.Option) *harness {
	t.Helper()
	logger, hook := logtest.NewNullLogger()
	logger.SetLevel(logrus.DebugLevel)
	hs := &harness{clk: testclock.NewFakeClock(epoch), drops: &drops{}, logs: hook}
	hs.rec = newRecorder(hs.clk)
	if h == nil {
		h = hs.rec
	}
	opts = append([]eventmonitor.Option{eventmonitor.WithClock(hs.clk),
		eventmonitor.WithDropHandler(hs.drops.add), eventmonitor.WithLogger(logrus.NewEntry(logger))}, opts...)
	m, err := eventmonitor.New(h, opts...)
	require.NoError(t, err)
	hs.m = m
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		m.Stop()
		require.NoError(t, goleak.Find(before), "a goroutine outlived Stop")
	})
	return hs
}

func (h *harness) submit(t *testing.T, events ...any) {
	t.Helper()
	for _, e := range events {
		require.NoError(t, h.m.Submit(keyOf(e), e))
	}
}

// settle waits until the monitor has done all it can (WaitIdle).
func (h *harness) settle(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, h.m.WaitIdle(ctx), "monitor did not settle: %+v", h.m.Stats())
}

// step settles, moves the clock by d, and settles again.
func (h *harness) step(t *testing.T, d time.Duration) {
	t.Helper()
	h.settle(t)
	h.clk.Step(d)
	h.settle(t)
}

// pending is key's backoff queue; a zero Pending if key is not waiting.
func (h *harness) pending(key string) eventmonitor.Pending {
	for _, p := range h.m.Pending() {
		if p.Key == key {
			return p
		}
	}
	return eventmonitor.Pending{}
}

// logged reports whether a line with msg was logged, of key if key is not "".
func (h *harness) logged(msg, key string) bool {
	for _, e := range h.logs.AllEntries() {
		if e.Message == msg && (key == "" || e.Data["key"] == key) {
			return true
		}
	}
	return false
}

// requireBalanced checks the Stats identity: every event received is
// filtered, ignored, handled, dropped, forgotten, queued, in backoff or in
// flight.
func requireBalanced(t *testing.T, s eventmonitor.Stats) {
	t.Helper()
	require.Equal(t, s.Received, s.Filtered+s.Ignored+s.Handled+s.Dropped+s.Forgotten+
		uint64(s.Queued+s.EventsInBackoff+s.InFlight), "Stats identity: %+v", s)
}

// quietLogger writes nowhere, for tests whose failures are on purpose.
func quietLogger() *logrus.Entry {
	l := logrus.New()
	l.Out = io.Discard
	return logrus.NewEntry(l)
}

// waitFor polls cond until it holds, failing t after 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	require.Eventually(t, cond, 10*time.Second, time.Millisecond, "timed out waiting for %s", what)
}

// awaitClosed waits for ch to close, failing t after 10 s.
func awaitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// stream is one subscription of a fakeSubscriber, which the test feeds and
// breaks.
type stream struct {
	ctx  context.Context
	ch   chan *eventmonitor.Envelope
	errs chan error
}

// fakeSubscriber is a Subscriber whose every Subscribe hands the test a
// fresh stream with room for buffer envelopes.
type fakeSubscriber struct {
	buffer  int
	streams chan stream
}

func newFakeSubscriber(buffer int) *fakeSubscriber {
	return &fakeSubscriber{buffer: buffer, streams: make(chan stream, 64)}
}

func (s *fakeSubscriber) Subscribe(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
	st := stream{ctx: ctx, ch: make(chan *eventmonitor.Envelope, s.buffer), errs: make(chan error, 1)}
	s.streams <- st
	return st.ch, st.errs
}

// next waits for the next Subscribe.
func (s *fakeSubscriber) next(t *testing.T) stream {
	t.Helper()
	select {
	case st := <-s.streams:
		return st
	case <-time.After(10 * time.Second):
		t.Fatal("timed out waiting for a subscription")
		return stream{}
	}
}

// envelope carries key as a wrapped string, keyed by keyConverter.
func envelope(t testing.TB, ns, key string) *eventmonitor.Envelope {
	t.Helper()
	a, err := typeurl.MarshalAny(wrapperspb.String(key))
	require.NoError(t, err)
	return &eventmonitor.Envelope{Timestamp: epoch, Namespace: ns, Topic: "/test", Event: a}
}

var keyConverter = eventmonitor.NewConverter(eventmonitor.KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }))

// runMonitor runs m.Run on sub until the test ends.
func runMonitor(t *testing.T, m *eventmonitor.Monitor, sub eventmonitor.Subscriber) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx, sub) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, eventmonitor.ErrStopped) {
			t.Errorf("Run: %v", err)
		}
	})
}
