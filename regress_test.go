package eventmonitor_test

// Black-box regression tests of the numbered defects (1–17) of the core
// rebuild's issue (issue 21): TestRegressionN pins defect N, and defects 13
// and 15, which came with API of their own (WithDeferredStart, MaxWorkers),
// have a second test for that API. Each states the defect and the behaviour
// the monitor must have; on the core they were written against, each fails
// (or gives up on its own bounded wait and fails), never hangs. Run them
// with -run Regression. Helpers shared with api_test.go: apiharness_test.go.

import (
	"context"
	"errors"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	"go.uber.org/goleak"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/eventmonitortest"
)

// ---- helpers -------------------------------------------------------------

// rgBound bounds every wait for something that must happen.
const rgBound = 2 * time.Second

// rgAsync runs fn in a goroutine and returns a channel closed when it returned.
func rgAsync(fn func()) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	return done
}

// rgFinish waits (bounded) for something the test released to end, failing
// the test hard if it does not: the test must not leave it running.
func rgFinish(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	if !closesWithin(ch, 5*time.Second) {
		t.Fatalf("%s did not end within 5s even after every handler was released", what)
	}
}

// rgGate blocks handler calls, ignoring their ctx, until it is opened; the
// test learns which event entered.
type rgGate struct {
	entered chan any
	release chan struct{}
	once    sync.Once
}

func newRgGate() *rgGate {
	return &rgGate{entered: make(chan any, 1024), release: make(chan struct{})}
}

func (g *rgGate) block(event any) {
	select {
	case g.entered <- event:
	default:
	}
	<-g.release
}

func (g *rgGate) open() { g.once.Do(func() { close(g.release) }) }

func (g *rgGate) waitEntered(t *testing.T) any {
	t.Helper()
	select {
	case e := <-g.entered:
		return e
	case <-time.After(rgBound):
		t.Fatalf("no handler call entered within %v", rgBound)
		return nil
	}
}

// rgEvent is a test event; pointers compare by identity.
type rgEvent struct {
	Key string
	N   int
}

// rgPayload is a typeurl.Any whose value is "key/n".
type rgPayload string

func (p rgPayload) GetTypeUrl() string { return "eventmonitor.test/regress.Payload" }
func (p rgPayload) GetValue() []byte   { return []byte(p) }

// rgConverter keys a payload "key/n" by key; the event is the payload's string.
var rgConverter = eventmonitor.ConverterFunc(func(p typeurl.Any) (string, any, error) {
	v := string(p.GetValue())
	key, _, _ := strings.Cut(v, "/")
	return key, v, nil
})

func rgNew(t *testing.T, h eventmonitor.Handler, opts ...eventmonitor.Option) *eventmonitor.Monitor {
	t.Helper()
	m, err := eventmonitor.New(h, append([]eventmonitor.Option{eventmonitor.WithLogger(quietLogger())}, opts...)...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return m
}

// ---- 1 -------------------------------------------------------------------

// Defect: an exit delivered through WatchExit is handled inline on the
// watcher's goroutine; when its handler ignores ctx, Stop waits for that
// goroutine for ever. Expected: Stop returns within about the handle timeout
// plus grace (min(1 s, timeout/10)), and the exit's event reaches the drop
// handler with ErrStopped.
func TestRegression1StopBoundedBehindInlineExit(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	gate := newRgGate()
	defer gate.open()
	var drops dropRecorder
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		gate.block(event)
		return nil
	}), eventmonitor.WithHandleTimeout(100*time.Millisecond), eventmonitor.WithDropHandler(drops.record))

	exit := &rgEvent{Key: "c1", N: 137}
	exitCh := make(chan exitStatus, 1)
	exitCh <- exitStatus{code: 137, at: time.Now()}
	watched := eventmonitor.WatchExit(context.Background(), m, "c1", exitCh,
		func(code uint32, _ time.Time) any { return exit })
	if got := gate.waitEntered(t); got != exit {
		t.Fatalf("handler entered with %v, want the exit", got)
	}

	start := time.Now()
	stopped := rgAsync(m.Stop)
	returned := closesWithin(stopped, 2*time.Second)
	elapsed := time.Since(start)
	gate.open()
	if !returned {
		t.Errorf("Stop did not return within 2s behind an inline exit whose handler ignores ctx (handle timeout 100ms)")
	} else {
		t.Logf("Stop returned after %v", elapsed)
	}
	rgFinish(t, stopped, "Stop")
	rgFinish(t, watched, "WatchExit's watcher")
	drops.requireDroppedStopped(t, exit)
}

// ---- 2 -------------------------------------------------------------------

// Defect: once WithMaxOverruns is reached, a stuck call keeps the only
// worker, and Shutdown(context.Background()) waits for ever for a queued
// event of another key that nobody can run. Expected: Shutdown returns
// (about the handle timeout after the drain stalls), and both the queued
// event and the stuck call's event reach the drop handler with ErrStopped.
func TestRegression2ShutdownBoundedAtOverrunLimit(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	gate := newRgGate()
	defer gate.open()
	var drops dropRecorder
	stuck, queued := &rgEvent{Key: "stuck"}, &rgEvent{Key: "other"}
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if event == stuck {
			gate.block(event)
		}
		return nil
	}), eventmonitor.WithWorkers(1), eventmonitor.WithMaxOverruns(0),
		eventmonitor.WithHandleTimeout(100*time.Millisecond), eventmonitor.WithDropHandler(drops.record))

	if err := m.Submit("stuck", stuck); err != nil {
		t.Fatal(err)
	}
	gate.waitEntered(t)
	if err := m.Submit("other", queued); err != nil {
		t.Fatal(err)
	}

	var shutdownErr error
	done := rgAsync(func() { shutdownErr = m.Shutdown(context.Background()) })
	returned := closesWithin(done, 3*time.Second)
	if !returned {
		t.Errorf("Shutdown(context.Background()) did not return within 3s with the overrun bound reached (stats %+v)", m.Stats())
	}
	gate.open()
	rgFinish(t, done, "Shutdown")
	if returned {
		t.Logf("Shutdown: %v", shutdownErr)
		drops.requireDroppedStopped(t, queued)
		drops.requireDroppedStopped(t, stuck)
	}
}

// ---- 3 -------------------------------------------------------------------

// Defect: with WithIntakeLimit reached, the stream reader waits for room;
// Forget of the key holding the queued events frees the room but does not
// wake the reader, which stays stuck until some handler call ends.
// Expected: the waiting envelope is accepted at once after Forget, without
// releasing the busy handler.
func TestRegression3ForgetWakesStreamIntake(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	gate := newRgGate()
	defer gate.open()
	// The converter holds the reader on a "hold/" payload until the test has
	// queued the next envelope behind it, so both are read as one batch.
	converting := make(chan struct{}, 1)
	holdConv := make(chan struct{})
	var holdOnce sync.Once
	openConv := func() { holdOnce.Do(func() { close(holdConv) }) }
	defer openConv()
	conv := eventmonitor.ConverterFunc(func(p typeurl.Any) (string, any, error) {
		if strings.HasPrefix(string(p.GetValue()), "hold/") {
			converting <- struct{}{}
			<-holdConv
			return "", nil, eventmonitor.ErrUnsupportedEvent // ignored: counted, not queued
		}
		return rgConverter(p)
	})
	clk := testclock.NewFakeClock(time.Now())
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if strings.HasPrefix(event.(string), "busy/") {
			gate.block(event)
		}
		return nil
	}), eventmonitor.WithWorkers(1), eventmonitor.WithIntakeLimit(2), eventmonitor.WithClock(clk),
		eventmonitor.WithConverter(conv))
	defer m.Stop()

	envs := make(chan *eventmonitor.Envelope, 16)
	sub := eventmonitor.SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		return envs, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := rgAsync(func() { _ = m.Run(ctx, sub) })
	defer func() {
		gate.open()
		openConv()
		cancel()
		rgFinish(t, ran, "Run")
	}()
	send := func(v string) {
		envs <- &eventmonitor.Envelope{Timestamp: time.Now(), Namespace: "ns", Topic: "/t", Event: rgPayload(v)}
	}

	send("busy/1")
	gate.waitEntered(t)
	send("x/1")
	send("x/2")
	if !waitUntil(rgBound, func() bool { s := m.Stats(); return s.Received == 3 && s.Queued == 2 }) {
		t.Fatalf("x's events not queued: %+v", m.Stats())
	}
	send("hold/1")
	select {
	case <-converting:
	case <-time.After(rgBound):
		t.Fatalf("the reader did not take the next envelope within %v", rgBound)
	}
	send("y/1")
	openConv()
	// The batch [hold/1, y/1] counts hold/1 as ignored, then waits for room
	// for y/1: the count shows once the reader waits (it holds the lock till then).
	if !waitUntil(rgBound, func() bool { s := m.Stats(); return s.Ignored == 1 && s.Received == 4 }) {
		t.Fatalf("the reader is not waiting for room for y: %+v", m.Stats())
	}

	forgotten := m.Forget("x")
	if len(forgotten) != 2 || forgotten[0] != "x/1" || forgotten[1] != "x/2" {
		t.Errorf("Forget(x) = %v, want [x/1 x/2]", forgotten)
	}
	if !waitUntil(rgBound, func() bool { return m.Stats().Received == 5 }) {
		t.Errorf("Forget freed the intake limit, but y was not accepted within %v: stats %+v", rgBound, m.Stats())
	}
}

// ---- 4 -------------------------------------------------------------------

// Defect: a worker starts its next call with the clock reading taken when
// its previous call returned, so anything slow in between (here, a drop
// handler taking 1 s of the monitor's clock) makes the next deadline early.
// Expected: ctx.Deadline() is exactly the monitor clock's time when the call
// started plus the handle timeout, and ctx is Done (DeadlineExceeded) when
// the clock reaches it.
func TestRegression4DeadlineFromCallStart(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	clk := testclock.NewFakeClock(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC))
	first, second := &rgEvent{Key: "a"}, &rgEvent{Key: "b"}
	firstGate := newRgGate()
	defer firstGate.open()
	type entry struct {
		ctx         context.Context
		now         time.Time
		deadline    time.Time
		hasDeadline bool
	}
	entered := make(chan entry, 1)
	release := make(chan struct{})
	defer close(release)
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if event == first {
			firstGate.block(event)
			return errors.New("fails")
		}
		d, ok := ctx.Deadline()
		entered <- entry{ctx: ctx, now: clk.Now(), deadline: d, hasDeadline: ok}
		select {
		case <-ctx.Done():
		case <-release:
		}
		return nil
	}), eventmonitor.WithClock(clk), eventmonitor.WithWorkers(1), eventmonitor.WithHandleTimeout(10*time.Second),
		eventmonitor.WithMaxAttempts(1),
		eventmonitor.WithDropHandler(func(eventmonitor.Drop) { clk.Step(time.Second) })) // a slow drop handler
	defer m.Stop()

	if err := m.Submit("a", first); err != nil {
		t.Fatal(err)
	}
	firstGate.waitEntered(t)
	if err := m.Submit("b", second); err != nil { // ready before the worker is done with a
		t.Fatal(err)
	}
	firstGate.open()

	var e entry
	select {
	case e = <-entered:
	case <-time.After(rgBound):
		t.Fatalf("second event not handled within %v (stats %+v)", rgBound, m.Stats())
	}
	want := e.now.Add(10 * time.Second)
	if !e.hasDeadline || !e.deadline.Equal(want) {
		t.Errorf("ctx.Deadline() = %v (ok %v), want the call's start %v + 10s = %v (early by %v)",
			e.deadline, e.hasDeadline, e.now, want, want.Sub(e.deadline))
	}
	clk.SetTime(want)
	select {
	case <-e.ctx.Done():
		if !errors.Is(e.ctx.Err(), context.DeadlineExceeded) {
			t.Errorf("ctx.Err() = %v at the deadline, want DeadlineExceeded", e.ctx.Err())
		}
	case <-time.After(rgBound):
		t.Errorf("ctx not Done within %v of the clock reaching its deadline %v", rgBound, want)
	}
}

// ---- 5 -------------------------------------------------------------------

// Defect: the handler's ctx is not a standard library context, so every
// context derived from it (context.WithTimeout, WithCancel) costs a
// goroutine to propagate cancellation. Expected: deriving 32 contexts adds
// (next to) no goroutine, from ctx itself or below a context.WithValue
// (namespaces.WithNamespace, log.WithLogger: what a containerd handler
// does first; a call context offering only AfterFunc once cost one there).
func TestRegression5DerivedContextsCostNoGoroutine(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	increase := make(chan int, 1)
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		before := runtime.NumGoroutine()
		var cancels []context.CancelFunc
		for i := range 32 {
			parent := ctx
			if i%2 == 1 {
				parent = context.WithValue(ctx, rgNamespaceKey{}, "k8s.io")
			}
			_, cancel := context.WithTimeout(parent, time.Hour)
			cancels = append(cancels, cancel)
		}
		increase <- runtime.NumGoroutine() - before
		for _, cancel := range cancels {
			cancel()
		}
		return nil
	}))
	defer m.Stop()
	if err := m.Submit("k", &rgEvent{Key: "k"}); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-increase:
		if n >= 4 {
			t.Errorf("32 contexts derived from the handler's ctx added %d goroutines, want < 4 (a standard library context adds 0)", n)
		}
	case <-time.After(rgBound):
		t.Fatalf("handler not called within %v", rgBound)
	}
}

type rgNamespaceKey struct{}

// ---- 6 -------------------------------------------------------------------

// Defect: with WithHandleTimeout(0) a worker takes a key's backlog as a run
// of up to 32 events, and Forget neither returns the events the run holds
// nor stops them being handled. Expected: Forget returns every event that
// has not started, in order, and none of them is ever handled.
func TestRegression6ForgetWithoutTimeoutTakesEverything(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	for i := range 20 {
		// Even rounds hold the worker on another key while k's 20 events are
		// submitted (k then has a backlog when the worker takes it); odd
		// rounds submit them as fast as possible with the worker free.
		gated := i%2 == 0
		if !rgForgetRound(t, i, gated) {
			return
		}
	}
}

func rgForgetRound(t *testing.T, round int, gated bool) bool {
	t.Helper()
	events := make([]*rgEvent, 20)
	for i := range events {
		events[i] = &rgEvent{Key: "k", N: i}
	}
	gate, hold := newRgGate(), newRgGate()
	defer gate.open()
	defer hold.open()
	holder := &rgEvent{Key: "hold"}
	var mu sync.Mutex
	var handled []any
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		switch event {
		case holder:
			hold.block(event)
		case events[0]:
			gate.block(event)
		}
		mu.Lock()
		handled = append(handled, event)
		mu.Unlock()
		return nil
	}), eventmonitor.WithWorkers(1), eventmonitor.WithHandleTimeout(0))
	defer m.Stop()

	if gated {
		if err := m.Submit("hold", holder); err != nil {
			t.Fatal(err)
		}
		hold.waitEntered(t)
	}
	for _, e := range events {
		if err := m.Submit("k", e); err != nil {
			t.Fatal(err)
		}
	}
	hold.open()
	gate.waitEntered(t)

	forgotten := m.Forget("k")
	ok := len(forgotten) == 19
	for i := 0; ok && i < 19; i++ {
		ok = forgotten[i] == events[i+1]
	}
	if !ok {
		ns := make([]int, len(forgotten))
		for i, e := range forgotten {
			ns[i] = e.(*rgEvent).N
		}
		t.Errorf("round %d (gated %v): Forget(k) returned events %v, want 1..19 in order", round, gated, ns)
	}
	gate.open()
	ctx, cancel := context.WithTimeout(context.Background(), rgBound)
	defer cancel()
	if err := m.WaitIdle(ctx); err != nil {
		t.Fatalf("round %d: WaitIdle: %v", round, err)
	}
	mu.Lock()
	defer mu.Unlock()
	var after []int
	for _, e := range handled {
		if e, ok := e.(*rgEvent); ok && e.Key == "k" && e.N > 0 {
			after = append(after, e.N)
		}
	}
	if len(after) > 0 {
		t.Errorf("round %d (gated %v): events %v of k were handled after Forget(k)", round, gated, after)
	}
	return !t.Failed()
}

// ---- 7 -------------------------------------------------------------------

// Defect: exits that arrive on WatchExit's channel while Shutdown drains
// vanish: the watchers give up when intake stops, so an exit is neither
// handled nor dropped. Expected: every exit delivered ends handled or in the
// drop handler.
func TestRegression7ExitsDuringShutdownDrainAccounted(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	const exits = 200
	gate := newRgGate()
	defer gate.open()
	var drops dropRecorder
	var handledExits atomic.Int64
	slow := &rgEvent{Key: "slow"}
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		e := event.(*rgEvent)
		switch {
		case e == slow:
			gate.block(event)
		case strings.HasPrefix(e.Key, "exit-"):
			handledExits.Add(1)
		}
		return nil
	}), eventmonitor.WithWorkers(1), eventmonitor.WithDropHandler(drops.record))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	chans := make([]chan exitStatus, exits)
	for i := range chans {
		chans[i] = make(chan exitStatus, 1) // as containerd's task.Wait
		key := "exit-" + string(rune('a'+i%26)) + "-" + strings.Repeat("x", i/26)
		eventmonitor.WatchExit(ctx, m, key, chans[i], func(code uint32, _ time.Time) any {
			return &rgEvent{Key: key, N: int(code)}
		})
	}
	if err := m.Submit("slow", slow); err != nil {
		t.Fatal(err)
	}
	gate.waitEntered(t)
	for i := range 3 { // queued behind the stuck worker: the drain has work left
		if err := m.Submit("queued", &rgEvent{Key: "queued", N: i}); err != nil {
			t.Fatal(err)
		}
	}

	var shutdownErr error
	done := rgAsync(func() { shutdownErr = m.Shutdown(context.Background()) })
	if !waitUntil(rgBound, func() bool {
		return errors.Is(m.Submit("probe", &rgEvent{Key: "probe"}), eventmonitor.ErrStopped)
	}) {
		t.Fatalf("Shutdown did not begin within %v", rgBound)
	}
	for i, ch := range chans { // the exits arrive while the drain waits for the slow call
		ch <- exitStatus{code: uint32(i % 256), at: time.Now()}
	}
	gate.open()
	rgFinish(t, done, "Shutdown")
	isExit := func(e any) bool { ev, ok := e.(*rgEvent); return ok && strings.HasPrefix(ev.Key, "exit-") }
	handled, dropped := int(handledExits.Load()), drops.count(isExit)
	if handled+dropped != exits {
		t.Errorf("of %d exits delivered during Shutdown's drain, %d were handled and %d dropped: %d vanished (Shutdown: %v)",
			exits, handled, dropped, exits-handled-dropped, shutdownErr)
	}
}

// ---- 8 -------------------------------------------------------------------

// Defect: Shutdown(ctx) does not return when ctx ends: with
// WithHandleTimeout(0) it waits for a stuck call for ever, and with a handle
// timeout it waits until the call's deadline. Expected: Shutdown returns
// soon after ctx ends, with an error wrapping context.DeadlineExceeded, and
// the stuck call's event goes to the drop handler with ErrStopped.
func TestRegression8ShutdownHonoursCtx(t *testing.T) {
	for _, timeout := range []time.Duration{0, 3 * time.Second} {
		t.Run("timeout="+timeout.String(), func(t *testing.T) {
			defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
			gate := newRgGate()
			defer gate.open()
			var drops dropRecorder
			stuck := &rgEvent{Key: "stuck"}
			m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
				gate.block(event)
				return nil
			}), eventmonitor.WithHandleTimeout(timeout), eventmonitor.WithDropHandler(drops.record))
			if err := m.Submit("stuck", stuck); err != nil {
				t.Fatal(err)
			}
			gate.waitEntered(t)

			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			defer cancel()
			start := time.Now()
			var err error
			done := rgAsync(func() { err = m.Shutdown(ctx) })
			returned := closesWithin(done, 1500*time.Millisecond)
			elapsed := time.Since(start)
			gate.open()
			rgFinish(t, done, "Shutdown")
			if !returned {
				t.Errorf("Shutdown with a 500ms ctx had not returned after 1.5s; it returned only once the stuck handler was released")
				return
			}
			t.Logf("Shutdown returned after %v: %v", elapsed, err)
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Shutdown = %v, want an error wrapping context.DeadlineExceeded", err)
			}
			drops.requireDroppedStopped(t, stuck)
		})
	}
}

// ---- 9 -------------------------------------------------------------------

// Defect: an event whose type a Mux has no route for counts as Handled.
// Expected: it counts as Ignored, as an envelope of a type the converter
// does not key does.
func TestRegression9UnroutedCountsIgnored(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *exitStatus) error { return nil })
	m := rgNew(t, mux)
	defer m.Stop()
	if err := m.Submit("k", &rgEvent{Key: "k"}); err != nil { // no route for *rgEvent
		t.Fatal(err)
	}
	if !waitUntil(rgBound, func() bool { s := m.Stats(); return s.Handled+s.Ignored+s.Failed > 0 }) {
		t.Fatalf("event not settled within %v: %+v", rgBound, m.Stats())
	}
	if s := m.Stats(); s.Ignored != 1 || s.Handled != 0 {
		t.Errorf("an event of a type the Mux has no route for: Ignored %d, Handled %d; want Ignored 1, Handled 0", s.Ignored, s.Handled)
	}
}

// ---- 10 ------------------------------------------------------------------

// Defect: New accepts a typed nil handler (a nil HandlerFunc or *Mux in a
// non-nil interface), which panics on the first event. Expected: an error
// wrapping ErrInvalidOption.
func TestRegression10TypedNilHandlersRejected(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	for name, h := range map[string]eventmonitor.Handler{
		"HandlerFunc(nil)": eventmonitor.HandlerFunc(nil),
		"(*Mux)(nil)":      (*eventmonitor.Mux)(nil),
	} {
		m, err := eventmonitor.New(h)
		if m != nil {
			m.Stop()
		}
		if !errors.Is(err, eventmonitor.ErrInvalidOption) {
			t.Errorf("New(%s) = %v, want an error wrapping ErrInvalidOption", name, err)
		}
	}
}

// ---- 11 ------------------------------------------------------------------

// Defect: huge backoff delays overflowed the due time (and WithJitter's
// spread of a delay overflowed to 1 ns), so a failed key was retried
// thousands of times a second. Expected: due times saturate; a failing key
// waits about its delay however large.
func TestRegression11BackoffOverflow(t *testing.T) {
	t.Run("fakeclock/jitter=0", func(t *testing.T) { rgOverflowRound(t, 0) })
	t.Run("fakeclock/jitter=1", func(t *testing.T) {
		// A jittered delay overflows only for some draws: ten rounds.
		for range 10 {
			if !rgOverflowRound(t, 1) {
				return
			}
		}
	})
	for _, tc := range []struct {
		name         string
		initial, max time.Duration
		jitter       float64
	}{
		{"half-max", math.MaxInt64 / 2, math.MaxInt64, 0},
		{"half-max/jitter=1", math.MaxInt64 / 2, math.MaxInt64, 1},
		{"max", math.MaxInt64, math.MaxInt64, 0},
		{"max/jitter=1", math.MaxInt64, math.MaxInt64, 1},
	} {
		t.Run("realclock/"+tc.name, func(t *testing.T) {
			defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
			const keys = 40 // with jitter, one key's draw may miss an overflow; forty will not
			var mu sync.Mutex
			calls := map[string]int{}
			worst := func() (key string, n int) {
				mu.Lock()
				defer mu.Unlock()
				for k, c := range calls {
					if c > n {
						key, n = k, c
					}
				}
				return key, n
			}
			m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
				mu.Lock()
				calls[event.(*rgEvent).Key]++
				mu.Unlock()
				return errors.New("fails")
			}), eventmonitor.WithBackoff(tc.initial, tc.max), eventmonitor.WithJitter(tc.jitter))
			defer m.Stop()
			for i := range keys {
				key := "k" + strings.Repeat("x", i)
				if err := m.Submit(key, &rgEvent{Key: key}); err != nil {
					t.Fatal(err)
				}
			}
			if !waitUntil(rgBound, func() bool { mu.Lock(); defer mu.Unlock(); return len(calls) == keys }) {
				t.Fatalf("not every key was called within %v", rgBound)
			}
			// A bounded window in which no key may make more than 2 calls:
			// the next retry is decades away.
			waitUntil(200*time.Millisecond, func() bool { _, n := worst(); return n > 2 })
			if key, n := worst(); n > 2 {
				t.Errorf("key %q, backing off for decades, was called %d times within about 200ms", key, n)
			}
		})
	}
}

// rgOverflowRound: on a fake clock that has moved since New, a key failing
// with WithBackoff(MaxInt64/2, MaxInt64) is called once, waits, is retried
// when due (its failure doubles the delay to the cap) and waits again. It
// reports whether the round passed.
func rgOverflowRound(t *testing.T, jitter float64) bool {
	t.Helper()
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	clk := testclock.NewFakeClock(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC))
	var calls atomic.Int64
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		calls.Add(1)
		return errors.New("fails")
	}), eventmonitor.WithClock(clk), eventmonitor.WithBackoff(math.MaxInt64/2, math.MaxInt64),
		eventmonitor.WithJitter(jitter))
	defer m.Stop()
	clk.Step(time.Hour) // the monitor's clock has moved since New
	if err := m.Submit("k", &rgEvent{Key: "k"}); err != nil {
		t.Fatal(err)
	}
	// Without jitter the delays are ~146 years, then the cap (~292); with
	// jitter 1 a delay is anything up to twice that, so only ask that the
	// retry is not (next to) now.
	far := func() time.Time { return clk.Now().AddDate(100, 0, 0) }
	if jitter > 0 {
		far = func() time.Time { return clk.Now().Add(time.Hour) }
	}
	for want := int64(1); want <= 2; want++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := m.WaitIdle(ctx)
		cancel()
		if err != nil {
			t.Errorf("after call %d: WaitIdle: %v with the handler called %d times", want, err, calls.Load())
			return false
		}
		if n := calls.Load(); n != want {
			t.Errorf("handler called %d times, want %d: a retry ran at once", n, want)
			return false
		}
		due, ok := m.NextRetry()
		if f := far(); !ok || !due.After(f) {
			t.Errorf("after call %d: NextRetry() = %v, %v; want after %v (now %v)", want, due, ok, f, clk.Now())
			return false
		}
		clk.SetTime(due)
	}
	return true
}

// ---- 12 ------------------------------------------------------------------

// Defect: after a call returns, the scheduler's timer stays armed for that
// call's deadline until someone calls WaitIdle, so an idle monitor holds a
// timer on its fake clock. Expected: once the monitor is idle (without
// WaitIdle) the clock has no waiters.
func TestRegression12IdleMonitorHoldsNoTimer(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	clk := testclock.NewFakeClock(time.Now())
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		// Return only once the call's deadline holds a timer on the clock,
		// so that the test sees that timer outlive the call.
		waitUntil(rgBound, clk.HasWaiters)
		return nil
	}), eventmonitor.WithClock(clk))
	defer m.Stop()
	// Before anything is submitted, WaitIdle is harmless: it lets a monitor
	// that starts its goroutines in New finish setting up its clock.
	eventmonitortest.Settle(t, m)
	if clk.HasWaiters() {
		t.Fatalf("a monitor given nothing holds a timer on its clock")
	}
	if err := m.Submit("k", &rgEvent{Key: "k"}); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(rgBound, func() bool { return m.Stats().Handled == 1 }) {
		t.Fatalf("event not handled: %+v", m.Stats())
	}
	if !waitUntil(rgBound, func() bool { return !clk.HasWaiters() }) {
		t.Errorf("%v after the only call returned, the idle monitor still holds a timer on its clock", rgBound)
	}
}

// ---- 13 ------------------------------------------------------------------

// Defect: New starts its workers and scheduler at once, so an idle monitor
// costs goroutines before anything is submitted. Expected: New with nothing
// submitted starts no goroutine. (WithDeferredStart:
// TestRegression13DeferredStart.)
func TestRegression13IdleNewStartsNoGoroutine(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	before := goleak.IgnoreCurrent()
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error { return nil }),
		eventmonitor.WithWorkers(4))
	defer m.Stop()
	if err := goleak.Find(before); err != nil {
		t.Errorf("an idle monitor, right after New, runs goroutines: %v", err)
	}
}

// New behaviour: with WithDeferredStart, New handles nothing until Start or
// Run: a Submit and a Backoff made before are not handled even when the
// clock passes the backoff's delay; Start (bare, no Subscribe) or Run then
// handles both, the due backoff replaying at once.
func TestRegression13DeferredStart(t *testing.T) {
	for _, via := range []string{"Start", "Run"} {
		t.Run(via, func(t *testing.T) {
			defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
			clk := testclock.NewFakeClock(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC))
			var mu sync.Mutex
			var handled []any
			count := func() int { mu.Lock(); defer mu.Unlock(); return len(handled) }
			m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
				mu.Lock()
				handled = append(handled, event)
				mu.Unlock()
				return nil
			}), eventmonitor.WithClock(clk), eventmonitor.WithDeferredStart(), eventmonitor.WithConverter(rgConverter))
			defer m.Stop()

			submitted, backedOff := &rgEvent{Key: "a"}, &rgEvent{Key: "b"}
			if err := m.Submit("a", submitted); err != nil {
				t.Fatal(err)
			}
			m.Backoff("b", backedOff)
			clk.Step(2 * time.Second) // past the backoff's initial 1 s
			// A bounded window in which nothing may be handled.
			if waitUntil(100*time.Millisecond, func() bool { return count() > 0 }) {
				t.Errorf("a monitor made WithDeferredStart handled %d events before Start or Run", count())
			}

			switch via {
			case "Start":
				m.Start()
			case "Run":
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				sub := eventmonitor.SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
					return make(chan *eventmonitor.Envelope), nil // an open, quiet stream
				})
				ran := rgAsync(func() { _ = m.Run(ctx, sub) })
				defer func() { cancel(); rgFinish(t, ran, "Run") }()
			}
			if !waitUntil(rgBound, func() bool { return count() == 2 }) {
				t.Errorf("after %s, %d of the submitted and the due backed-off event were handled within %v, want 2 (stats %+v)",
					via, count(), rgBound, m.Stats())
			}
		})
	}
}

// ---- 14 ------------------------------------------------------------------

// Defect: a call counts as overrunning (and its worker is replaced, which
// costs a goroutine) the instant its deadline passes, though a handler that
// honours ctx needs a moment to return. Expected: a grace of
// min(1 s, timeout/10) after the deadline (100 ms for 1 s): a call that
// returns by deadline + 50 ms is never counted in Stats().Overrunning nor
// replaced; one still running at deadline + 100 ms is counted.
func TestRegression14OverrunGrace(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	clk := testclock.NewFakeClock(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC))
	gates := map[string]*rgGate{"a": newRgGate(), "b": newRgGate()}
	for _, g := range gates {
		defer g.open()
	}
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if g, ok := gates[event.(*rgEvent).Key]; ok {
			g.block(event)
		}
		return nil
	}), eventmonitor.WithClock(clk), eventmonitor.WithWorkers(1), eventmonitor.WithHandleTimeout(time.Second))
	defer m.Stop()

	if err := m.Submit("a", &rgEvent{Key: "a"}); err != nil {
		t.Fatal(err)
	}
	gates["a"].waitEntered(t)
	if err := m.Submit("c", &rgEvent{Key: "c"}); err != nil { // only a replacement worker could run it now
		t.Fatal(err)
	}
	clk.Step(time.Second + 50*time.Millisecond) // within the grace
	// Bounded window: neither an overrun nor a replacement worker may show.
	if waitUntil(200*time.Millisecond, func() bool { s := m.Stats(); return s.Overrunning > 0 || s.Handled > 0 }) {
		t.Errorf("50ms past its deadline (grace 100ms) the call counts as overrunning or its worker was replaced: %+v", m.Stats())
	}
	gates["a"].open()
	if !waitUntil(rgBound, func() bool { return m.Stats().Handled == 2 }) {
		t.Fatalf("a and c not handled: %+v", m.Stats())
	}

	if err := m.Submit("b", &rgEvent{Key: "b"}); err != nil {
		t.Fatal(err)
	}
	gates["b"].waitEntered(t)
	clk.Step(time.Second + 100*time.Millisecond) // the end of the grace
	if !waitUntil(rgBound, func() bool { return m.Stats().Overrunning == 1 }) {
		t.Errorf("100ms past its deadline the call is not counted as overrunning: %+v", m.Stats())
	}
	gates["b"].open()
}

// ---- 15 ------------------------------------------------------------------

type rgValueEvent struct{ ID string }

// Defect: New accepts a Mux that routes only a value type T while the
// converter keys *T (every event would be silently ignored), and any number
// of workers. Expected: both are an error wrapping ErrInvalidOption, the
// first naming the type. (MaxWorkers itself: TestRegression15MaxWorkers.)
func TestRegression15ConfigMismatchRejected(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e rgValueEvent) error { return nil })
	conv := eventmonitor.NewConverter(eventmonitor.KeyOf(func(e *rgValueEvent) string { return e.ID }))
	m, err := eventmonitor.New(mux, eventmonitor.WithConverter(conv))
	if m != nil {
		m.Stop()
	}
	if !errors.Is(err, eventmonitor.ErrInvalidOption) || !strings.Contains(err.Error(), "rgValueEvent") {
		t.Errorf("New(Mux routing rgValueEvent, converter keying *rgValueEvent) = %v, want an error wrapping ErrInvalidOption naming the type", err)
	}

	// A keyed type with no route at all is not a mistake: a converter that
	// keys every runtime event beside a Mux for a few of them.
	partial := eventmonitor.NewMux()
	eventmonitor.On(partial, func(ctx context.Context, e *rgValueEvent) error { return nil })
	wide := eventmonitor.NewConverter(
		eventmonitor.KeyOf(func(e *rgValueEvent) string { return e.ID }),
		eventmonitor.KeyOf(func(e *strings.Builder) string { return "" }))
	m, err = eventmonitor.New(partial, eventmonitor.WithConverter(wide))
	if err != nil {
		t.Errorf("New(Mux routing *rgValueEvent, converter keying it and another type) = %v, want no error", err)
	} else {
		m.Stop()
	}

	m, err = eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error { return nil }),
		eventmonitor.WithWorkers(4097)) // MaxWorkers (4096) + 1; 1_000_000 in TestRegression15MaxWorkers
	if m != nil {
		m.Stop()
	}
	if !errors.Is(err, eventmonitor.ErrInvalidOption) {
		t.Errorf("New(WithWorkers(4097)) = %v, want an error wrapping ErrInvalidOption (MaxWorkers is 4096)", err)
	}
}

// New behaviour: WithWorkers is bounded by MaxWorkers (4096).
func TestRegression15MaxWorkers(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	if eventmonitor.MaxWorkers != 4096 {
		t.Errorf("MaxWorkers = %d, want 4096", eventmonitor.MaxWorkers)
	}
	h := eventmonitor.HandlerFunc(func(ctx context.Context, event any) error { return nil })
	m, err := eventmonitor.New(h, eventmonitor.WithWorkers(eventmonitor.MaxWorkers))
	if err != nil {
		t.Errorf("New(WithWorkers(MaxWorkers)) = %v, want it accepted", err)
	} else {
		m.Stop()
	}
	for _, n := range []int{eventmonitor.MaxWorkers + 1, 1_000_000} {
		m, err := eventmonitor.New(h, eventmonitor.WithWorkers(n))
		if m != nil {
			m.Stop()
		}
		if !errors.Is(err, eventmonitor.ErrInvalidOption) {
			t.Errorf("New(WithWorkers(%d)) = %v, want an error wrapping ErrInvalidOption", n, err)
		}
	}
}

// ---- 16 ------------------------------------------------------------------

// Defect: every bare Start() (no Subscribe) keeps its channel until Stop, so
// a caller that starts repeatedly grows memory without bound. Expected: the
// channels still all close on Stop, and 100 000 bare Starts whose channels
// the caller dropped retain (next to) no memory.
func TestRegression16BareStartsDoNotAccumulate(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error { return nil }))
	defer m.Stop()
	kept := make([]<-chan error, 1000)
	for i := range kept {
		kept[i] = m.Start()
	}

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range 100_000 {
		_ = m.Start()
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grown := int64(after.HeapAlloc) - int64(before.HeapAlloc); grown > 1<<20 {
		t.Errorf("100000 bare Starts whose channels nobody holds retain %d bytes until Stop", grown)
	}

	m.Stop()
	deadline := time.After(rgBound)
	for i, ch := range kept {
		select {
		case _, open := <-ch:
			if open {
				t.Fatalf("bare Start channel %d delivered a value; want it closed", i)
			}
		case <-deadline:
			t.Fatalf("bare Start channel %d (of %d) not closed within %v of Stop", i, len(kept), rgBound)
		}
	}
}

// ---- 17 ------------------------------------------------------------------

// Defect: "event handling failed; backing off" is logged at warn level, and
// the retry line "retrying backed-off events" carries the previous failure
// in field "error", as if the retry itself had failed. Expected: the
// failure at error level; the retry line's previous failure in field
// "previous_error", no "error".
func TestRegression17LogLevelsAndFields(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	logger, hook := logtest.NewNullLogger()
	logger.SetLevel(logrus.DebugLevel)
	clk := testclock.NewFakeClock(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC))
	var calls atomic.Int64
	m := rgNew(t, eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if calls.Add(1) == 1 {
			return errors.New("first call fails")
		}
		return nil
	}), eventmonitor.WithClock(clk), eventmonitor.WithLogger(logrus.NewEntry(logger)))
	defer m.Stop()
	if err := m.Submit("k", &rgEvent{Key: "k"}); err != nil {
		t.Fatal(err)
	}
	eventmonitortest.Settle(t, m)
	eventmonitortest.StepToNextRetry(t, m, clk)
	if calls.Load() != 2 {
		t.Fatalf("handler called %d times, want 2", calls.Load())
	}
	find := func(msg string) *logrus.Entry {
		for _, e := range hook.AllEntries() {
			if e.Message == msg {
				return e
			}
		}
		t.Errorf("no log line %q", msg)
		return nil
	}
	if e := find("event handling failed; backing off"); e != nil && e.Level != logrus.ErrorLevel {
		t.Errorf("%q logged at %v, want error", e.Message, e.Level)
	}
	if e := find("retrying backed-off events"); e != nil {
		if _, ok := e.Data["previous_error"]; !ok {
			t.Errorf("%q has no field previous_error: %v", e.Message, e.Data)
		}
		if v, ok := e.Data[logrus.ErrorKey]; ok {
			t.Errorf("%q has field error = %v; the previous failure belongs in previous_error", e.Message, v)
		}
	}
}
