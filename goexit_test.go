package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"
)

// runtime.Goexit (what t.FailNow and require do in a test's callback) in
// user code: no recover stops it, yet every call settles once, no slot is
// lost or doubled, and WaitIdle and Stop return.

// A handler that ends its goroutine (runtime.Goexit: t.FailNow or
// require in a test's handler) fails as a panic does, and its worker's
// slot goes on to the next key.
func TestHandlerGoexitIsAFailure(t *testing.T) {
	calls := 0
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		calls++
		if calls == 1 {
			runtime.Goexit()
		}
		return nil
	}))
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	h.settled(t) // the call ends: nothing is left running
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Failed)
	assert.Equal(t, uint64(1), s.Handled, "b/1 is handled: the slot went on")
	assert.True(t, h.m.InBackoff("a"), "the event backs off")
	assert.True(t, h.logged("event handler panicked", "a"))
	h.step(t, time.Second)
	assert.Equal(t, uint64(2), h.m.Stats().Handled, "the retry succeeds")
	assertBalanced(t, h.m.Stats())
}

// slotCheck notes, under mu, whether the calls ever held more slots than
// WithWorkers allows, or two calls ran for one key.
func slotCheck(m *Monitor) (bad func() string) {
	var mu sync.Mutex
	var seen string
	check := func() {
		m.mu.Lock()
		held, keys := m.slotsHeld(), map[string]int{}
		for _, c := range m.calls {
			if c.stage != settling { // settled: its key may have gone on while it reports
				keys[c.key.Name()]++
			}
		}
		m.mu.Unlock()
		mu.Lock()
		defer mu.Unlock()
		if held > m.cfg.workers && seen == "" {
			seen = fmt.Sprintf("slotsHeld %d > workers %d", held, m.cfg.workers)
		}
		for k, n := range keys {
			if n > 1 && seen == "" {
				seen = fmt.Sprintf("%d calls for key %q", n, k)
			}
		}
	}
	return func() string {
		check()
		mu.Lock()
		defer mu.Unlock()
		return seen
	}
}

// checkWhileRunning checks every Stats snapshot's identity, and bad, until
// the returned func is called.
func checkWhileRunning(t *testing.T, m *Monitor, bad func() string) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			if s := m.Stats(); s.Received != accounted(s) {
				t.Errorf("identity broken: %+v", s)
				return
			}
			if b := bad(); b != "" {
				t.Errorf("%s", b)
				return
			}
			runtime.Gosched()
		}
	}()
	return func() { close(done); wg.Wait() }
}

// A handler that calls runtime.Goexit while one of its own deferred
// functions panics: a recover does not stop a pending Goexit, so invoke
// never returns, and handle's guard, not invoke's, settles the call.
func TestGoexitWithAPanickingDeferIsSettled(t *testing.T) {
	calls := atomic.Int32{}
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if calls.Add(1) == 1 {
			defer func() { panic("a deferred cleanup panics as the test's handler fails") }()
			runtime.Goexit() // require.NoError(t, err) in a test's handler
		}
		return nil
	}), WithLogger(quietLogger()))
	t.Cleanup(func() { h.clock.Step(time.Minute) }) // rescue: Stop abandons the call left running
	h.submit(t, ev{"a", 1})
	waitFor(t, func() bool { return calls.Load() == 1 }, "the handler was never called")
	h.settled(t) // the call settles
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Failed)
	assert.Zero(t, s.InFlight)
	assertBalanced(t, s)
}

// With GODEBUG=panicnil=1 (the default for a main module whose go line is
// before 1.21) panic(nil) is recovered as nil, like a Goexit, but invoke
// returns: the call settles once, as a failure, and its slot takes on one
// next call.
func TestPanicNilIsSettledOnce(t *testing.T) {
	t.Setenv("GODEBUG", "panicnil=1")
	var x exclusive
	conc, maxConc := atomic.Int32{}, atomic.Int32{}
	first := atomic.Bool{}
	var mon atomic.Pointer[Monitor]
	maxHeld := atomic.Int32{}
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		defer x.enter(keyOf(e))()
		n := conc.Add(1)
		defer conc.Add(-1)
		for {
			m := maxConc.Load()
			if n <= m || maxConc.CompareAndSwap(m, n) {
				break
			}
		}
		if m := mon.Load(); m != nil {
			m.mu.Lock()
			if held := m.slotsHeld(); held > int(maxHeld.Load()) {
				maxHeld.Store(int32(held))
			}
			m.mu.Unlock()
		}
		if e == (ev{"a", 1}) && first.CompareAndSwap(false, true) {
			panic(nil)
		}
		runtime.Gosched()
		return nil
	}), WithLogger(quietLogger()), WithWorkers(1))
	mon.Store(h.m)
	bad := slotCheck(h.m)
	h.submit(t, ev{"a", 1})
	for i := range 20 {
		h.submit(t, ev{fmt.Sprintf("k%d", i), 1})
	}
	h.settled(t)
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Failed, "one call failed once")
	assert.Equal(t, 1, s.EventsInBackoff, "a/1 is in backoff once")
	assertBalanced(t, s)
	assert.Empty(t, bad())
	assert.LessOrEqual(t, maxConc.Load(), int32(1), "WithWorkers(1): one call at a time")
	assert.LessOrEqual(t, maxHeld.Load(), int32(1), "slotsHeld never above WithWorkers(1)")
	assert.False(t, x.twice.Load())
}

// a Goexit in the exit watcher's inline call fails
// the exit (backoff), closes the watcher's channel, and leaves no call;
// its retry is handled by a worker.
func TestGoexitInTheWatchersInlineCall(t *testing.T) {
	calls := atomic.Int32{}
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if calls.Add(1) == 1 {
			runtime.Goexit()
		}
		return nil
	}), WithLogger(quietLogger()))
	exitCh := make(chan fakeExit, 1)
	exitCh <- fakeExit{code: 1, at: epoch}
	awaitClosed(t, WatchExit(context.Background(), h.m, "c1", exitCh, exitOf("c1")), "the watcher")
	h.settled(t)
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Failed)
	assert.True(t, h.m.InBackoff("c1"))
	assertBalanced(t, s)
	h.step(t, time.Second)
	assert.Equal(t, uint64(1), h.m.Stats().Handled)
	assertBalanced(t, h.m.Stats())
}

type goexitStatus struct{}

func (goexitStatus) Result() (uint32, time.Time, error) { runtime.Goexit(); return 0, time.Time{}, nil }

// a Goexit in a replay's first call (logged as a
// retry, before the CAS), with WithHandleTimeout(0), settles once and the
// replay backs off again; no slot is lost.
func TestGoexitInAReplaysFirstCallWithoutTimeout(t *testing.T) {
	calls := atomic.Int32{}
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if e == (ev{"a", 1}) && calls.Add(1) <= 2 {
			runtime.Goexit()
		}
		return nil
	}), WithLogger(quietLogger()), WithHandleTimeout(0), WithWorkers(1))
	bad := slotCheck(h.m)
	h.submit(t, ev{"a", 1}, ev{"a", 2})
	h.settled(t)
	assert.Equal(t, uint64(1), h.m.Stats().Failed)
	h.step(t, time.Second) // the replay's first call Goexits too
	s := h.m.Stats()
	assert.Equal(t, uint64(2), s.Failed)
	assert.Equal(t, 2, s.EventsInBackoff, "the replay backed off again, both events")
	assertBalanced(t, s)
	h.step(t, 2*time.Second)
	s = h.m.Stats()
	assert.Equal(t, uint64(2), s.Handled)
	assert.Zero(t, s.EventsInBackoff+s.InFlight+s.Queued)
	assertNoSlotLeft(t, h.m, bad, s)
}

// a handler that Goexits past its deadline (late),
// and one past the grace (overran, its slot given to a new worker),
// settles once; the overran one's slot is not taken twice.
func TestGoexitAfterTheDeadline(t *testing.T) {
	for _, overran := range []bool{false, true} {
		t.Run(fmt.Sprintf("overran=%v", overran), func(t *testing.T) {
			release := make(chan struct{})
			started := make(chan struct{}, 4)
			h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
				if e == (ev{"a", 1}) {
					started <- struct{}{}
					<-ctx.Done()
					<-release
					runtime.Goexit()
				}
				return nil
			}), WithLogger(quietLogger()), WithWorkers(1), WithHandleTimeout(10*time.Second))
			bad := slotCheck(h.m)
			h.submit(t, ev{"a", 1}, ev{"b", 1}, ev{"c", 1})
			<-started
			if overran {
				h.clock.Step(11 * time.Second)
				waitFor(t, func() bool { return h.m.Stats().Handled == 2 }, "b and c never got the slot")
			} else {
				h.clock.Step(10 * time.Second)
				waitFor(t, func() bool {
					h.m.mu.Lock()
					defer h.m.mu.Unlock()
					return len(h.m.calls) == 1 && h.m.calls[0].stage == late
				}, "the call never went late")
			}
			assert.Empty(t, bad())
			close(release)
			h.settled(t)
			s := h.m.Stats()
			assert.Equal(t, uint64(1), s.Failed)
			assert.Equal(t, uint64(2), s.Handled)
			assert.Equal(t, 1, s.EventsInBackoff)
			assertNoSlotLeft(t, h.m, bad, s)
		})
	}
}

// a call that Stop abandoned (overran) and whose
// handler then Goexits is not settled again: its event is dropped once,
// nothing counts as Failed, and Stop returns.
func TestGoexitAfterStopAbandonedTheCall(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	gone := make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		defer close(gone)
		started <- struct{}{}
		<-release
		runtime.Goexit()
		return nil
	}), WithLogger(quietLogger()), WithWorkers(1))
	h.submit(t, ev{"a", 1}, ev{"a", 2})
	<-started
	h.clock.Step(DefaultHandleTimeout + time.Second)
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "the call never overran")
	h.m.Stop()
	close(release)
	<-gone
	waitFor(t, func() bool { return goroutinesIn("eventmonitor.(*Monitor).invoke") == 0 }, "the handler's goroutine never left")
	s := h.m.Stats()
	assert.Zero(t, s.Failed)
	assert.Equal(t, uint64(2), s.Dropped)
	assert.Len(t, h.drops.all(), 2, "the abandoned call's drop and a/2's")
	assertBalanced(t, s)
}

// many keys on two slots, handlers that Goexit at
// random, Submits and Stats snapshots concurrent: no slot is lost or
// doubled, a key never runs twice at once, the identity holds in every
// snapshot, and every event is eventually handled.
func TestGoexitStormKeepsSlotsAndIdentity(t *testing.T) {
	var x exclusive
	h := newHarness(t, goexitThenFail(&x), WithLogger(quietLogger()), WithWorkers(2))
	bad := slotCheck(h.m)
	checked := checkWhileRunning(t, h.m, bad)
	const keys, per = 8, 5
	for i := range per {
		for k := range keys {
			h.submit(t, ev{fmt.Sprintf("k%d", k), i})
		}
	}
	for range 100 {
		if h.m.Stats().Handled == keys*per {
			break
		}
		h.step(t, DefaultMaxBackoff)
	}
	checked()
	s := h.m.Stats()
	assert.Equal(t, uint64(keys*per), s.Handled, "%+v", s)
	assert.False(t, x.twice.Load(), "a key ran on two goroutines")
	assert.Empty(t, bad())
	assertBalanced(t, s)
}

// a handler that Goexits while Shutdown drains fails
// its event, which goes to the drop handler with ErrStopped (not in
// Shutdown's error); the slot goes on to the queued key; Shutdown returns
// nil and the identity holds.
func TestGoexitDuringShutdownsDrain(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if e == (ev{"a", 1}) {
			started <- struct{}{}
			<-release
			runtime.Goexit()
		}
		return nil
	}), WithLogger(quietLogger()), WithWorkers(1))
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	<-started
	shut := make(chan error, 1)
	go func() { shut <- h.m.Shutdown(context.Background()) }()
	waitFor(t, h.stopping, "Shutdown never began")
	close(release)
	require.NoError(t, awaitErr(t, shut))
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Failed)
	assert.Equal(t, uint64(1), s.Handled, "b/1 got the slot")
	reason, ok := dropReason(h, ev{"a", 1})
	require.True(t, ok, "a/1 was not dropped")
	assert.ErrorIs(t, reason, ErrStopped)
	assert.ErrorIs(t, reason, ErrHandlerPanic)
	assertBalanced(t, s)
}

// endHook calls end (runtime.Goexit, as t.FailNow in a test's log hook
// does, or a panic) on the first log line whose message contains match.
type endHook struct {
	match string
	end   func()
	once  sync.Once
	fired atomic.Bool
}

func (h *endHook) Levels() []logrus.Level { return logrus.AllLevels }

func (h *endHook) Fire(e *logrus.Entry) error {
	if !strings.Contains(e.Message, h.match) {
		return nil
	}
	first := false
	h.once.Do(func() { first = true })
	if first {
		h.fired.Store(true)
		h.end()
	}
	return nil
}

func endingLogger(match string, end func()) (*log.Entry, *endHook) {
	logger := logrus.New()
	logger.Out = io.Discard
	logger.SetLevel(logrus.DebugLevel)
	hook := &endHook{match: match, end: end}
	logger.AddHook(hook)
	return logrus.NewEntry(logger), hook
}

// goexitMetrics ends the goroutine in HandlerDone of a failed call.
type goexitMetrics struct{}

func (goexitMetrics) Recovered(time.Duration) {}
func (goexitMetrics) Dropped(error, int)      {}

func (goexitMetrics) HandlerDone(_ time.Duration, err error) {
	if err != nil {
		runtime.Goexit()
	}
}

// goexitEveryOtherSuccess Goexits in HandlerDone of every other successful
// call.
type goexitEveryOtherSuccess struct{ successes atomic.Int32 }

func (g *goexitEveryOtherSuccess) HandlerDone(_ time.Duration, err error) {
	if err == nil && g.successes.Add(1)%2 == 0 {
		runtime.Goexit()
	}
}
func (*goexitEveryOtherSuccess) Recovered(time.Duration) {}
func (*goexitEveryOtherSuccess) Dropped(error, int)      {}

// inPanicNilChild runs the test named name in a child process with
// GODEBUG=panicnil=1, or, in that child, scenario, whose result it prints
// on a STATE line, which must say ok. If mayCrash, the child may instead
// crash with "panic: nil": a nil panic in the log's user code goes on as
// any panic through the guard does
// (TestARetryLinePanicIsNotSettledAsAGoexit).
func inPanicNilChild(t *testing.T, name string, mayCrash bool, scenario func(t *testing.T) (state string, ok bool)) {
	const env = "EVENTMONITOR_PANIC_NIL_CHILD"
	if os.Getenv(env) == name {
		state, ok := scenario(t)
		fmt.Printf("STATE ok=%v %s\n", ok, state)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+name+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), env+"="+name, "GODEBUG=panicnil=1")
	out, err := cmd.CombinedOutput()
	if i := strings.Index(string(out), "STATE ok="); i >= 0 {
		line, _, _ := strings.Cut(string(out[i:]), "\n")
		assert.True(t, strings.HasPrefix(line, "STATE ok=true"), "under GODEBUG=panicnil=1: %s", line)
		return
	}
	require.True(t, mayCrash, "the child printed no STATE line: %v\n%s", err, out)
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "%v\n%s", err, out)
	assert.Contains(t, string(out), "panic: nil", "%s", out)
}

// goexitConverter ends its goroutine on the StringValue "exit", and keys
// the others as testConverter does.
var goexitConverter = ConverterFunc(func(p typeurl.Any) (string, any, error) {
	key, event, err := testConverter.Convert(p)
	if v, ok := event.(*wrapperspb.StringValue); ok && v.GetValue() == "exit" {
		runtime.Goexit()
	}
	return key, event, err
})

// dropCountingMetrics counts drops, and ends the goroutine in Dropped
// when exitOnDrop is set.
type dropCountingMetrics struct {
	exitOnDrop bool
	dropped    atomic.Int32
}

func (*dropCountingMetrics) HandlerDone(time.Duration, error) {}
func (*dropCountingMetrics) Recovered(time.Duration)          {}
func (m *dropCountingMetrics) Dropped(error, int) {
	m.dropped.Add(1)
	if m.exitOnDrop {
		runtime.Goexit()
	}
}

type panicNilStatus struct{}

func (panicNilStatus) Result() (uint32, time.Time, error) { panic(nil) }

// assertNoSlotLeft checks, once all settled, that no call or slot is
// held, that slotCheck's bad saw nothing wrong, and that s balances.
func assertNoSlotLeft(t *testing.T, m *Monitor, bad func() string, s Stats) {
	t.Helper()
	m.mu.Lock()
	held, calls := m.slotsHeld(), len(m.calls)
	m.mu.Unlock()
	assert.Zero(t, held, "slots held")
	assert.Zero(t, calls, "calls left")
	assert.Empty(t, bad())
	assertBalanced(t, s)
}

// goexitThenFail is a storm's handler: each event's first call ends its
// goroutine, its second fails, its third succeeds; x sees a key on two
// goroutines.
func goexitThenFail(x *exclusive) Handler {
	var tries sync.Map
	return HandlerFunc(func(ctx context.Context, e any) error {
		defer x.enter(keyOf(e))()
		n, _ := tries.LoadOrStore(e, new(atomic.Int32))
		switch n.(*atomic.Int32).Add(1) {
		case 1:
			runtime.Goexit()
		case 2:
			return errors.New("fails once more")
		}
		return nil
	})
}

// countingGoexitHook counts the log lines whose message is match, and ends
// the goroutine (runtime.Goexit) on the first.
type countingGoexitHook struct {
	match string
	n     atomic.Int32
}

func (h *countingGoexitHook) Levels() []logrus.Level { return logrus.AllLevels }

func (h *countingGoexitHook) Fire(e *logrus.Entry) error {
	if e.Message == h.match && h.n.Add(1) == 1 {
		runtime.Goexit()
	}
	return nil
}

// A drop handler that ends its goroutine ends the worker while the call is
// reported: the call is still released, its slot goes on, and WaitIdle and
// Stop return.
func TestGoexitInTheDropHandlerDoesNotHangStop(t *testing.T) {
	r := newRecorder()
	r.fail(ev{"a", 1}, 1)
	h := newHarness(t, r, WithLogger(quietLogger()), WithMaxAttempts(1),
		WithDropHandler(func(Drop) { runtime.Goexit() }))
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	h.settled(t)
	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	waitFor(t, h.stopping, "Stop never began")
	h.clock.Step(time.Minute) // past any handle timeout and grace: no help
	select {
	case <-stopped:
	case <-time.After(3 * time.Second):
		t.Fatalf("Stop hung past the handle timeout: %+v", h.m.Stats())
	}
}

// Goexit in the report phase of every call (the drop handler of each
// given-up event) on two slots, with Submits and Stats concurrent: the
// identity holds in every snapshot, no slot is lost or doubled, and every
// event settles.
func TestReportGoexitStormKeepsIdentity(t *testing.T) {
	var x exclusive
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		defer x.enter(keyOf(e))()
		if asEv(e).Seq%2 == 0 {
			return errors.New("fails")
		}
		return nil
	}), WithLogger(quietLogger()), WithWorkers(2), WithMaxAttempts(1), WithMetrics(&goexitEveryOtherSuccess{}),
		WithDropHandler(func(Drop) { runtime.Goexit() }))
	bad := slotCheck(h.m)
	checked := checkWhileRunning(t, h.m, bad)
	const keys, per = 8, 6
	for i := range per {
		for k := range keys {
			h.submit(t, ev{fmt.Sprintf("k%d", k), i})
		}
	}
	h.settled(t)
	checked()
	s := h.m.Stats()
	assert.Equal(t, uint64(keys*per/2), s.Handled)
	assert.Equal(t, uint64(keys*per/2), s.Dropped)
	assert.False(t, x.twice.Load())
	assertNoSlotLeft(t, h.m, bad, s)
}

// Nested exits: the handler Goexits, and during handle's rest (finish's
// report) the drop handler Goexits too. The call settles once, is released
// once, its slot goes on, and WaitIdle and Stop return.
func TestNestedGoexitHandlerThenItsReport(t *testing.T) {
	for _, where := range []string{"drop handler", "Metrics", "log line"} {
		t.Run(where, func(t *testing.T) {
			var x exclusive
			handler := HandlerFunc(func(ctx context.Context, e any) error {
				defer x.enter(keyOf(e))()
				if e == (ev{"a", 1}) {
					runtime.Goexit()
				}
				return nil
			})
			lg := quietLogger()
			var hook *endHook
			opts := []Option{WithWorkers(1), WithMaxAttempts(1)}
			switch where {
			case "drop handler":
				opts = append(opts, WithDropHandler(func(d Drop) {
					if d.Key == "a" {
						runtime.Goexit()
					}
				}))
			case "Metrics":
				opts = append(opts, WithMetrics(goexitMetrics{}))
			case "log line":
				lg, hook = endingLogger("giving up on event", runtime.Goexit)
			}
			h := newHarness(t, handler, append(opts, WithLogger(lg))...)
			bad := slotCheck(h.m)
			h.submit(t, ev{"a", 1}, ev{"b", 1}, ev{"c", 1})
			h.settled(t)
			if hook != nil {
				assert.True(t, hook.fired.Load())
			}
			s := h.m.Stats()
			assert.Equal(t, uint64(1), s.Failed)
			assert.Equal(t, uint64(1), s.Dropped)
			assert.Equal(t, uint64(2), s.Handled, "b and c got the slot")
			assert.False(t, x.twice.Load())
			assertNoSlotLeft(t, h.m, bad, s)
			require.NoError(t, h.m.Submit("a", ev{"a", 2}), "the key was not released")
			h.settled(t)
			assert.Equal(t, uint64(3), h.m.Stats().Handled)
			stopped := make(chan struct{})
			go func() { h.m.Stop(); close(stopped) }()
			awaitClosed(t, stopped, "Stop")
		})
	}
}

// A log hook that Goexits (t.FailNow on an error line) on the handler's
// panic line, inside invoke's recover: the call settles once.
func TestGoexitInThePanicLogLine(t *testing.T) {
	lg, hook := endingLogger("event handler panicked", runtime.Goexit)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if e == (ev{"a", 1}) {
			panic("boom")
		}
		return nil
	}), WithLogger(lg), WithWorkers(1))
	bad := slotCheck(h.m)
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	h.settled(t)
	assert.True(t, hook.fired.Load())
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Failed)
	assert.Equal(t, uint64(1), s.Handled)
	assert.Equal(t, 1, s.EventsInBackoff)
	assert.Empty(t, bad())
	assertBalanced(t, s)
}

// A nil panic (GODEBUG=panicnil=1) in the report phase's log line, which
// recover returns as nil as it does in a Goexit, is not taken for one: the
// call is not released twice (two slots held with WithWorkers(1)).
func TestPanicNilInAReportIsNotTakenForAGoexit(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilInAReportIsNotTakenForAGoexit", true, func(t *testing.T) (string, bool) {
		lg, hook := endingLogger("event handling failed; backing off", func() { panic(nil) })
		block, aGo := make(chan struct{}), make(chan struct{})
		started := atomic.Int32{}
		h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
			if e == (ev{"a", 1}) {
				<-aGo // b/1 and c/1 are queued
				return errors.New("fails")
			}
			started.Add(1)
			<-block
			return nil
		}), WithLogger(lg), WithWorkers(1))
		t.Cleanup(func() { close(block) })
		h.submit(t, ev{"a", 1}, ev{"b", 1}, ev{"c", 1})
		close(aGo)
		waitFor(t, hook.fired.Load, "the report's log line was never logged")
		waitFor(t, func() bool { return started.Load() >= 1 }, "no next call started")
		// a/1's worker is done once nothing runs finish or release.
		waitFor(t, func() bool {
			return goroutinesIn("eventmonitor.(*Monitor).finish") == 0 && goroutinesIn("eventmonitor.(*Monitor).release") == 0
		}, "a/1's worker never left")
		h.m.mu.Lock()
		held := h.m.slotsHeld()
		h.m.mu.Unlock()
		return fmt.Sprintf("slotsHeld=%d with WithWorkers(1)", held), held <= 1
	})
}

// A nil panic (GODEBUG=panicnil=1) in invoke's "event handler panicked"
// line escapes invoke and is not taken for a Goexit: the call is not
// settled twice (failed, then handled, the Stats identity broken).
func TestPanicNilInThePanicLogLineIsNotTakenForAGoexit(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilInThePanicLogLineIsNotTakenForAGoexit", true, func(t *testing.T) (string, bool) {
		lg, hook := endingLogger("event handler panicked", func() { panic(nil) })
		h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
			if e == (ev{"a", 1}) {
				panic("boom")
			}
			return nil
		}), WithLogger(lg), WithWorkers(1))
		h.submit(t, ev{"a", 1})
		waitFor(t, hook.fired.Load, "the panic line was never logged")
		h.settled(t)
		s := h.m.Stats()
		return fmt.Sprintf("%+v", s), s.Handled == 0 && s.Failed == 1 && accounted(s) == s.Received
	})
}

// A converter Goexit on Run's second subscription, while the resync hook
// it started still runs: Run's place is free only once its hook returned,
// so the next Run's hook never runs beside it.
func TestGoexitInRunWaitsForItsResyncHook(t *testing.T) {
	hookRelease, exiting := make(chan struct{}), make(chan struct{})
	var running, most atomic.Int32
	hooked := make(chan struct{}, 4)
	hook := func(ctx context.Context) error {
		n := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		hooked <- struct{}{}
		<-hookRelease // a relist that does not watch ctx
		return nil
	}
	conv := ConverterFunc(func(p typeurl.Any) (string, any, error) {
		key, event, err := testConverter.Convert(p)
		if v, ok := event.(*wrapperspb.StringValue); ok && v.GetValue() == "exit" {
			<-hooked // the hook this subscription started runs
			close(exiting)
			runtime.Goexit()
		}
		return key, event, err
	})
	clk := testclock.NewFakeClock(epoch)
	m, err := New(newRecorder(), WithClock(clk), WithConverter(conv), WithResync(hook), WithLogger(quietLogger()))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ran1 := make(chan struct{})
	var ran2 chan struct{}
	t.Cleanup(func() {
		cancel()
		close(hookRelease)
		awaitClosed(t, ran1, "the first Run")
		if ran2 != nil {
			awaitClosed(t, ran2, "the second Run")
		}
		m.Stop()
	})
	reconnect := func(stream *fakeStream) *fakeSub {
		(<-stream.newSub).errs <- errors.New("broken")
		waitFor(t, clk.HasWaiters, "Run never waited to re-subscribe")
		clk.Step(time.Minute)
		return <-stream.newSub
	}
	s1 := newFakeStream()
	go func() { defer close(ran1); _ = m.Run(ctx, s1) }()
	reconnect(s1).send(t, envelope(t, "ns", wrapperspb.String("exit")))
	<-exiting
	waitFor(t, func() bool {
		return readerIs(m, noReader)() || goroutinesIn("(*Monitor).runOnce", "(*WaitGroup).Wait") > 0
	}, "the ended Run neither freed its place nor waited for its hook")
	if !readerIs(m, noReader)() {
		return // the ended Run waits for its hook, holding its place
	}
	assert.Zero(t, running.Load(), "Run's place is free with its resync hook still running")
	// What that allows: the next Run's hook runs beside the old one.
	s2 := newFakeStream()
	ran2 = make(chan struct{})
	go func() { defer close(ran2); _ = m.Run(ctx, s2) }()
	reconnect(s2).send(t, envelope(t, "ns", wrapperspb.String("c1"))) // established: its hook starts
	select {
	case <-hooked:
	case <-time.After(10 * time.Second):
		t.Fatal("the second Run's hook never ran")
	}
	assert.LessOrEqual(t, most.Load(), int32(1), "two resync hooks ran at once")
}

// A log hook that ends the worker's goroutine on a replay's retry line,
// before the call begins: the call fails as a Goexit in the handler does,
// nothing hangs, and the slot goes on.
func TestGoexitInTheRetryLineFailsTheCall(t *testing.T) {
	r := newRecorder()
	r.fail(ev{"a", 1}, 1)
	lg, hook := endingLogger("retrying backed-off events", runtime.Goexit)
	h := newHarness(t, r, WithLogger(lg), WithWorkers(1))
	h.submit(t, ev{"a", 1})
	h.settled(t)
	require.True(t, h.m.InBackoff("a"))
	h.clock.Step(DefaultInitialBackoff)
	waitFor(t, hook.fired.Load, "the retry line was never logged")
	h.submit(t, ev{"b", 1})
	h.settled(t)
	s := h.m.Stats()
	assert.Empty(t, r.handledOf("a"), "the replay's call was not made")
	assert.Equal(t, uint64(2), s.Failed, "the first call, and the replay's")
	assert.True(t, h.m.InBackoff("a"), "a/1 backs off again")
	assert.Len(t, r.handledOf("b"), 1, "b/1 gets the only worker slot")
	assertBalanced(t, s)
}

// A log hook that ends the scheduler's goroutine on the overrun warning: a
// new scheduler takes over, so later deadlines still expire and Stop still
// returns within about the handle timeout of a handler ignoring its ctx.
func TestGoexitInTheOverrunLineHandsTheSchedulerOn(t *testing.T) {
	lg, hook := endingLogger("event handler overran its timeout", runtime.Goexit)
	releaseA, releaseB := make(chan struct{}), make(chan struct{})
	startedA, startedB := make(chan struct{}), make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		switch e {
		case ev{"a", 1}:
			close(startedA)
			<-releaseA
		case ev{"b", 1}:
			close(startedB)
			<-releaseB // ignores ctx
		}
		return nil
	}), WithLogger(lg), WithWorkers(2), WithHandleTimeout(time.Second))
	t.Cleanup(func() { close(releaseB) }) // runs before the harness's Stop
	h.submit(t, ev{"a", 1})
	<-startedA
	waitArmed(t, h.m, func(at time.Time) bool { return at.Equal(epoch.Add(time.Second)) })
	h.clock.Step(time.Second + 100*time.Millisecond) // past deadline and grace
	waitFor(t, hook.fired.Load, "the overrun line was never logged")
	close(releaseA)
	waitFor(t, func() bool { return h.m.Stats().InFlight == 0 }, "a/1 never settled")

	h.submit(t, ev{"b", 1})
	<-startedB
	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	waitFor(t, h.stopping, "Stop never began")
	h.clock.Step(time.Minute) // far past b's deadline and grace
	awaitClosed(t, stopped, "Stop, past b's handle timeout and grace")
	assertBalanced(t, h.m.Stats())
}

// A drop handler that ends Start's stream reader (its goroutine) on the
// first drop: reading ends, and Start's channel says so rather than
// closing as if the monitor had stopped.
func TestGoexitInTheDropHandlerOnStartsReaderIsReported(t *testing.T) {
	first := true
	h := newHarness(t, newRecorder(), WithConverter(testConverter), WithDropHandler(func(Drop) {
		if first { // the reader's goroutine only: no race
			first = false
			runtime.Goexit()
		}
	}))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	errCh := h.m.Start()
	sub := <-stream.newSub
	sub.send(t, &Envelope{Topic: "/bad"}) // nil payload: dropped, ErrInvalidEvent
	err, open := startResult(t, errCh)
	require.True(t, open, "Start's channel closed with no error")
	assert.ErrorIs(t, err, ErrStreamClosed)
	assert.ErrorIs(t, err, errReaderExited)
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Dropped)
	assertBalanced(t, s)
	waitFor(t, func() bool {
		h.m.mu.Lock()
		defer h.m.mu.Unlock()
		return h.m.stream.reader == noReader
	}, "the reader's place was never freed")
}

// The same through an exit's reading: a log hook panicking on the "cannot
// read exit status" line crashes the watcher's goroutine, as any unguarded
// panic does, without the drop handler first being told of a Goexit.
func TestAPanicThroughAnExitsReadingIsNotTakenForAGoexit(t *testing.T) {
	if inCrashChild(t) {
		lg, _ := endingLogger("cannot read exit status", func() { panic("log hook panics") })
		m, err := New(newRecorder(), WithLogger(lg),
			WithDropHandler(func(d Drop) { fmt.Printf("DROP-HANDLER-CALLED: %v\n", d.Reason) }))
		if err != nil {
			panic(err)
		}
		exitCh := make(chan fakeExit, 1)
		exitCh <- fakeExit{err: errors.New("no status")}
		WatchExit(context.Background(), m, "c1", exitCh, exitOf("c1"))
		waitFor(t, func() bool { // once in hand, the exit stays so until the child crashes
			m.mu.Lock()
			defer m.mu.Unlock()
			return m.accepting > 0 || m.stats.Received > 0
		}, "the exit was never taken")
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = m.WaitIdle(ctx)
		return
	}
	out := runCrashChild(t)
	assert.Contains(t, out, "panic: log hook panics", "the child should crash on the hook's panic:\n%s", out)
	assert.NotContains(t, out, "DROP-HANDLER-CALLED",
		"user code ran mid-panic, told of a Goexit for a panic:\n%s", out)
}

// A Goexit on Start's reader outside ingest's guard but inside consume (the
// debug line for a first ignored type): the envelope was counted as
// ignored, is not dropped as well, and Start reports errReaderExited.
func TestGoexitAfterTheEnvelopeWasCountedDropsNothing(t *testing.T) {
	lg, hook := endingLogger("ignoring events of a type", runtime.Goexit)
	h := newHarness(t, newRecorder(), WithConverter(testConverter), WithLogger(lg))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	errCh := h.m.Start()
	(<-stream.newSub).send(t, envelope(t, "ns", wrapperspb.Int64(7))) // registered, no key: ignored
	err, open := startResult(t, errCh)
	require.True(t, open)
	require.ErrorIs(t, err, errReaderExited)
	require.True(t, hook.fired.Load())
	h.settled(t)
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Ignored)
	assert.Zero(t, s.Dropped)
	assert.Empty(t, h.drops.all())
	assertBalanced(t, s)
}

// A drop handler that Goexits on Stop's first drop ends Stop's goroutine
// in its emit loop: the lifetime channel (a bare Start's) still closes.
// The drops after it are counted but not handed over (documented).
func TestGoexitInStopsDropHandlerStillEndsTheLifetime(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	h := newHarness(t, newRecorder(), WithDeferredStart(), WithLogger(quietLogger()),
		WithDropHandler(func(d Drop) {
			mu.Lock()
			seen = append(seen, d.Key)
			mu.Unlock()
			runtime.Goexit()
		}))
	h.submit(t, ev{"a", 1}, ev{"b", 1}, ev{"c", 1})
	stopped := make(chan struct{})
	go func() { defer close(stopped); h.m.Stop() }()
	awaitClosed(t, stopped, "Stop's goroutine")
	select {
	case <-h.m.lifetime:
	case <-time.After(10 * time.Second):
		t.Fatal("lifetime never closed")
	}
	s := h.m.Stats()
	assertBalanced(t, s)
	assert.Equal(t, uint64(3), s.Dropped)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, []string{"a"}, seen)
}

// A drop handler that ends Start's reader, as it reports a nil envelope,
// leaves the reader's place free too.
func TestGoexitInTheDropHandlerEndsStartsReaderCleanly(t *testing.T) {
	h := newHarness(t, newRecorder(), WithConverter(testConverter), WithDropHandler(func(Drop) { runtime.Goexit() }))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	errCh := h.m.Start()
	(<-stream.newSub).send(t, nil)
	require.ErrorIs(t, <-errCh, ErrStreamClosed)
	assert.Equal(t, uint64(1), h.m.Stats().Dropped)
	h.m.Subscribe(stream)
	errCh = h.m.Start()
	<-stream.newSub
	h.m.Stop()
	_, open := <-errCh
	assert.False(t, open, "the next Start read until Stop")
}

// A log hook that ends Start's reader (runtime.Goexit: t.FailNow in a
// test's hook on error lines) on its "event stream failed" line: the
// error was sent already, Start's channel still closes, and Stop returns.
func TestGoexitInTheStreamFailedLineStillEndsStart(t *testing.T) {
	lg, hook := endingLogger("event stream failed", runtime.Goexit)
	drops := &dropLog{}
	m, err := New(newRecorder(), WithClock(testclock.NewFakeClock(epoch)), WithConverter(testConverter),
		WithLogger(lg), WithDropHandler(drops.add))
	require.NoError(t, err)
	stream := newFakeStream()
	m.Subscribe(stream)
	errCh := m.Start()
	sub := <-stream.newSub
	sub.errs <- errors.New("broken")
	waitFor(t, hook.fired.Load, "the stream failure was never logged")
	waitFor(t, readerIs(m, noReader), "the reader's place was not freed")

	err, open := startResult(t, errCh)
	require.True(t, open)
	require.EqualError(t, err, "broken", "sent before the log line")
	_, open = startResult(t, errCh)
	assert.False(t, open, "Start's channel closes after a log hook ended its reader")
	stopped := make(chan struct{})
	go func() { m.Stop(); close(stopped) }()
	awaitClosed(t, stopped, "Stop")
}

// Under GODEBUG=panicnil=1, panic(nil) in the converter and in the exit
// builder is a panic: each is dropped once, saying so, not also dropped as
// a Goexit, and the reader goes on reading.
func TestPanicNilInTheConverterAndBuilderIsCountedOnce(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilInTheConverterAndBuilderIsCountedOnce", false, func(t *testing.T) (string, bool) {
		conv := ConverterFunc(func(p typeurl.Any) (string, any, error) {
			key, event, err := testConverter.Convert(p)
			if v, ok := event.(*wrapperspb.StringValue); ok && v.GetValue() == "nil" {
				panic(nil)
			}
			return key, event, err
		})
		r := newRecorder()
		h := newHarness(t, r, WithConverter(conv), WithLogger(quietLogger()))
		stream := newFakeStream()
		h.m.Subscribe(stream)
		errCh := h.m.Start()
		sub := <-stream.newSub
		sub.send(t, envelope(t, "ns", wrapperspb.String("nil")))
		sub.send(t, envelope(t, "ns", wrapperspb.String("c1")))
		waitFor(t, func() bool { return len(r.handledList()) == 1 }, "the reader went on")
		exitCh := make(chan fakeExit, 1)
		exitCh <- fakeExit{code: 1, at: epoch}
		awaitClosed(t, WatchExit(context.Background(), h.m, "c2", exitCh, func(uint32, time.Time) any { panic(nil) }), "the watcher")
		h.settled(t)
		s := h.m.Stats()
		select {
		case err := <-errCh:
			return fmt.Sprintf("Start's channel said %v", err), false
		default:
		}
		drops := h.drops.all()
		if len(drops) != 2 {
			return fmt.Sprintf("%+v drops=%d", s, len(drops)), false
		}
		return fmt.Sprintf("%+v reasons %q, %q", s, drops[0].Reason, drops[1].Reason),
			s.Received == 3 && s.Dropped == 2 && s.Handled == 1 && accounted(s) == s.Received &&
				errors.Is(drops[0].Reason, errConverterPanic) && errors.Is(drops[1].Reason, errExitBuilderPanic)
	})
}

// Under GODEBUG=panicnil=1, an exit builder that panics with nil, on an
// exit whose status could not be read, is a panicking builder: its exit
// is dropped with a reason that wraps a sentinel, not with the status
// error (which recover's nil once left as the reason).
func TestPanicNilInTheExitBuilderIsADrop(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilInTheExitBuilderIsADrop", false, func(t *testing.T) (string, bool) {
		h := newHarness(t, newRecorder(), WithLogger(quietLogger()))
		exitCh := make(chan fakeExit)
		close(exitCh)
		awaitClosed(t, WatchExitResult(context.Background(), h.m, "c1", exitCh,
			func(uint32, time.Time, error) any { panic(nil) }), "the watcher")
		h.settled(t)
		drops := h.drops.all()
		if len(drops) != 1 {
			return fmt.Sprintf("%d drops", len(drops)), false
		}
		r := drops[0].Reason
		return fmt.Sprintf("drop reason %q", r), wrapsADropSentinel(r)
	})
}

// A replay's retry line whose log hook blocks past the call's deadline and
// grace (its slot goes to a new worker), then Stop withdraws the call, then
// the hook ends the goroutine: settleExited finds the call withdrawn and
// settles nothing; the event is dropped once, Stop returns, no slot is held
// twice.
func TestRetryLineGoexitAfterStopWithdrewTheCall(t *testing.T) {
	blocked, release := make(chan struct{}), make(chan struct{})
	lg, _ := endingLogger("retrying backed-off events", func() {
		close(blocked)
		<-release
		runtime.Goexit()
	})
	r := newRecorder()
	r.fail(ev{"a", 1}, 1)
	h := newHarness(t, r, WithLogger(lg), WithWorkers(1))
	bad := slotCheck(h.m)
	checked := checkWhileRunning(t, h.m, bad)
	h.submit(t, ev{"a", 1})
	h.settled(t)
	h.clock.Step(DefaultInitialBackoff)
	<-blocked
	h.submit(t, ev{"b", 1})
	h.clock.Step(DefaultHandleTimeout + 2*time.Second) // overran: the slot goes to b/1
	waitFor(t, func() bool { return len(r.handledOf("b")) == 1 }, "b/1 never got the slot")
	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	awaitClosed(t, stopped, "Stop")
	close(release)
	waitFor(t, func() bool { return goroutinesIn("eventmonitor.(*Monitor).work") == 0 }, "a worker was left")
	checked()
	s := h.m.Stats()
	assert.Equal(t, 2, r.callCount(), "a/1's first call and b/1: the withdrawn retry is not made")
	assert.Equal(t, uint64(1), s.Dropped)
	reason, ok := dropReason(h, ev{"a", 1})
	require.True(t, ok)
	assert.ErrorIs(t, reason, ErrStopped)
	assertBalanced(t, s)
}
