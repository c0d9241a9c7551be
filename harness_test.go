package eventmonitor

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	testclock "k8s.io/utils/clock/testing"
)

// ev is the typed event of most tests: a key and its sequence number.
type ev struct {
	Key string
	Seq int
}

func (e ev) String() string { return fmt.Sprintf("%s/%d", e.Key, e.Seq) }

// recorder is a Handler that records every call, counts how many calls per
// key run at once, and fails or blocks as a test tells it.
type recorder struct {
	mu       sync.Mutex
	calls    []any
	handled  []any
	running  map[string]int
	maxConc  map[string]int
	failures map[ev]int                             // fail this event this many more times
	gates    map[ev]chan struct{}                   // block this event until closed
	started  map[ev]chan struct{}                   // closed when this event's call starts
	onCall   func(ctx context.Context, e any) error // overrides failures when set
}

func newRecorder() *recorder {
	return &recorder{
		running:  map[string]int{},
		maxConc:  map[string]int{},
		failures: map[ev]int{},
		gates:    map[ev]chan struct{}{},
		started:  map[ev]chan struct{}{},
	}
}

func keyOf(e any) string {
	switch e := e.(type) {
	case ev:
		return e.Key
	case exitEvent:
		return e.Key
	}
	return fmt.Sprint(e)
}

func (r *recorder) HandleEvent(ctx context.Context, e any) error {
	key := keyOf(e)
	r.mu.Lock()
	r.calls = append(r.calls, e)
	r.running[key]++
	r.maxConc[key] = max(r.maxConc[key], r.running[key])
	gate := r.gates[asEv(e)]
	if c, ok := r.started[asEv(e)]; ok {
		close(c)
		delete(r.started, asEv(e))
	}
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.running[key]--
		r.mu.Unlock()
	}()
	if gate != nil {
		<-gate
	}
	var err error
	if r.onCall != nil {
		err = r.onCall(ctx, e)
	} else {
		r.mu.Lock()
		if r.failures[asEv(e)] > 0 {
			r.failures[asEv(e)]--
			err = fmt.Errorf("injected failure of %v", e)
		}
		r.mu.Unlock()
	}
	if err == nil {
		r.mu.Lock()
		r.handled = append(r.handled, e)
		r.mu.Unlock()
	}
	return err
}

func asEv(e any) ev {
	v, _ := e.(ev)
	return v
}

// gate makes e's call block until the returned func is called; started is
// closed when the call begins.
func (r *recorder) gate(e ev) (started <-chan struct{}, release func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	g, s := make(chan struct{}), make(chan struct{})
	r.gates[e], r.started[e] = g, s
	var once sync.Once
	return s, func() { once.Do(func() { close(g) }) }
}

func (r *recorder) fail(e ev, times int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures[e] = times
}

func (r *recorder) handledList() []any {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]any(nil), r.handled...)
}

// handledOf is what was handled of key, in order.
func (r *recorder) handledOf(key string) []any {
	var of []any
	for _, e := range r.handledList() {
		if keyOf(e) == key {
			of = append(of, e)
		}
	}
	return of
}

func (r *recorder) callCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

// dropLog collects what the drop handler receives.
type dropLog struct {
	mu    sync.Mutex
	drops []Drop
}

func (d *dropLog) add(x Drop) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.drops = append(d.drops, x)
}

func (d *dropLog) all() []Drop {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]Drop(nil), d.drops...)
}

type harness struct {
	m     *Monitor
	clock *testclock.FakeClock
	drops *dropLog
	logs  *logtest.Hook
}

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// newHarness starts a monitor on a fake clock. Cleanup stops it and checks
// that no goroutine outlived Stop.
func newHarness(t *testing.T, h Handler, opts ...Option) *harness {
	t.Helper()
	logger, hook := logtest.NewNullLogger()
	logger.SetLevel(logrus.DebugLevel)
	hs := &harness{clock: testclock.NewFakeClock(epoch), drops: &dropLog{}, logs: hook}
	opts = append([]Option{
		WithClock(hs.clock),
		WithDropHandler(hs.drops.add),
		WithLogger(logrus.NewEntry(logger)),
	}, opts...)
	m, err := New(h, opts...)
	require.NoError(t, err)
	hs.m = m
	t.Cleanup(func() {
		m.Stop()
		goleak.VerifyNone(t)
	})
	return hs
}

// waitFor polls cond until it holds or 10 s pass.
func waitFor(t *testing.T, cond func() bool, format string, args ...any) {
	t.Helper()
	require.Eventuallyf(t, cond, 10*time.Second, time.Millisecond, format, args...)
}

func (h *harness) submit(t *testing.T, events ...ev) {
	t.Helper()
	for _, e := range events {
		require.NoError(t, h.m.Submit(e.Key, e))
	}
}

// settled waits until the monitor is idle (WaitIdle): everything given to
// it handled or waiting in backoff for a time still to come.
func (h *harness) settled(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, h.m.WaitIdle(ctx), "monitor did not settle: %+v", h.m.Stats())
}

// step settles the monitor, moves the clock by d and settles it again.
func (h *harness) step(t *testing.T, d time.Duration) {
	t.Helper()
	h.settled(t)
	h.clock.Step(d)
	h.settled(t)
}

// pending returns key's backoff queue, or a zero Pending.
func (h *harness) pending(key string) Pending {
	for _, p := range h.m.Pending() {
		if p.Key == key {
			return p
		}
	}
	return Pending{}
}

// logged reports whether a log line with msg and key field was written.
func (h *harness) logged(msg, key string) bool {
	for _, e := range h.logs.AllEntries() {
		if e.Message == msg && e.Data["key"] == key {
			return true
		}
	}
	return false
}

func evs(key string, seqs ...int) []ev {
	out := make([]ev, len(seqs))
	for i, s := range seqs {
		out[i] = ev{key, s}
	}
	return out
}

func anys[T any](xs ...T) []any {
	out := make([]any, len(xs))
	for i, x := range xs {
		out[i] = x
	}
	return out
}

// stopping reports whether Stop or Shutdown has begun.
func (h *harness) stopping() bool {
	h.m.mu.Lock()
	defer h.m.mu.Unlock()
	return h.m.state != running && h.m.state != held
}

// quietLogger discards every line, keeping none: for tests and benchmarks
// whose failures are on purpose and whose log nobody reads.
func quietLogger() *log.Entry {
	logger := logrus.New()
	logger.Out = io.Discard
	return logrus.NewEntry(logger)
}

// assertBalanced checks the Stats identity: every event received is
// filtered, ignored, handled, dropped, forgotten, queued, in backoff or in
// flight.
func assertBalanced(t *testing.T, s Stats) {
	t.Helper()
	assert.Equal(t, s.Received, accounted(s), "Stats identity: %+v", s)
}

// accounted is the identity's right-hand side: what Received should be.
func accounted(s Stats) uint64 {
	return s.Filtered + s.Ignored + s.Handled + s.Dropped + s.Forgotten +
		uint64(s.Queued+s.EventsInBackoff+s.InFlight)
}

// exclusive notes whether a key was ever handled on two goroutines at once.
type exclusive struct {
	running sync.Map
	twice   atomic.Bool
}

// enter notes that k's handling began, and returns what notes its end.
func (x *exclusive) enter(k string) (leave func()) {
	if _, loaded := x.running.LoadOrStore(k, true); loaded {
		x.twice.Store(true)
	}
	return func() { x.running.Delete(k) }
}

// waitArmed waits until the scheduler has armed its timer for a time for
// which ok returns true, and returns it.
func waitArmed(t *testing.T, m *Monitor, ok func(time.Time) bool) time.Time {
	t.Helper()
	var at time.Time
	require.Eventually(t, func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		at = m.sched.at
		return !at.IsZero() && ok(at)
	}, 5*time.Second, time.Millisecond, "scheduler never armed as wanted (last %v)", at)
	return at
}

// blockHook blocks the first log call whose message contains match until
// release is closed; blocked is closed when that call blocks.
type blockHook struct {
	level   logrus.Level
	match   string
	once    sync.Once
	blocked chan struct{}
	release chan struct{}
}

func newBlockHook(level logrus.Level, match string) *blockHook {
	return &blockHook{level: level, match: match, blocked: make(chan struct{}), release: make(chan struct{})}
}

func (h *blockHook) Levels() []logrus.Level { return []logrus.Level{h.level} }

func (h *blockHook) Fire(e *logrus.Entry) error {
	if !strings.Contains(e.Message, h.match) {
		return nil
	}
	first := false
	h.once.Do(func() { first = true })
	if first {
		close(h.blocked)
		<-h.release
	}
	return nil
}

// awaitClosed waits for ch to close, failing the test if it takes 10 s.
func awaitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s never closed", what)
	}
}
