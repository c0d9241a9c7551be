package eventmonitor

// Review 9: a cold review of the core. Each test below failed on the code it
// was written against (commit eeac924) and names the promise it checks.

import (
	"context"
	"io"
	"os"
	"os/exec"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	testclock "k8s.io/utils/clock/testing"
)

// gatedClock is a fake clock whose Now, once armed, holds its next caller
// until released. Armed by a handler just before it returns, it holds the
// worker between the handler's return and the settling of its call, as the
// Go scheduler may (preemption, GC, a CPU-throttled container) for longer
// than a grace of min(1 s, timeout/10), or across the instant Shutdown's
// ctx ends.
type gatedClock struct {
	*testclock.FakeClock
	armed   atomic.Bool
	blocked chan struct{}
	release chan struct{}
}

func newGatedClock() *gatedClock {
	return &gatedClock{FakeClock: testclock.NewFakeClock(epoch), blocked: make(chan struct{}), release: make(chan struct{})}
}

func (c *gatedClock) Now() time.Time {
	if c.armed.CompareAndSwap(true, false) {
		close(c.blocked)
		<-c.release
	}
	return c.FakeClock.Now()
}

// review9Metrics is a Metrics that records nothing: with it, a worker reads
// the clock right after its handler returns.
type review9Metrics struct{}

func (review9Metrics) HandlerDone(time.Duration, error) {}
func (review9Metrics) Recovered(time.Duration)          {}
func (review9Metrics) Dropped(error, int)               {}

// returnedCallMonitor starts a call that has returned nil, its worker held
// before it takes the lock to settle it.
func returnedCallMonitor(t *testing.T) (*Monitor, *gatedClock, *dropLog) {
	t.Helper()
	clk := newGatedClock()
	drops := &dropLog{}
	m, err := New(HandlerFunc(func(ctx context.Context, e any) error {
		clk.armed.Store(true) // the worker's next clock read is after this return
		return nil
	}), WithClock(clk), WithMetrics(review9Metrics{}), WithDropHandler(drops.add), WithLogger(quietLogger()))
	require.NoError(t, err)
	require.NoError(t, m.Submit("a", ev{"a", 1}))
	select {
	case <-clk.blocked:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never returned")
	}
	return m, clk, drops
}

func review9StateIs(m *Monitor, s lifecycle) func() bool {
	return func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.state == s
	}
}

// Promise (Shutdown's doc): "If ctx ends first it stops at once, abandoning
// every call in progress (a returned call's report is still waited for)".
// A call whose handler returned nil before Shutdown began is not in
// progress: its event is handled, not dropped as "handler still running
// when Shutdown's ctx ended". On eeac924 the call is abandoned: its event
// reaches the drop handler with ErrStopped though the handler handled it,
// and Stats counts it Dropped, not Handled. (The kept test
// TestShutdownAccountsForMixedTraffic fails a quarter of its runs on a
// 2-CPU machine with "outcomes [ok dropped:...abandoned]", partly from this.)
func TestReview9ShutdownDoesNotAbandonAReturnedCall(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	m, clk, drops := returnedCallMonitor(t)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan error, 1)
	go func() { done <- m.Shutdown(ctx) }()
	// Stop begun: whatever it abandons, it has abandoned (under the lock, at once).
	waitFor(t, review9StateIs(m, stopped), "Shutdown never stopped")
	close(clk.release)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown did not return once the call settled")
	}
	require.Empty(t, drops.all(), "an event its handler handled was dropped")
	s := m.Stats()
	require.Equal(t, uint64(1), s.Handled, "%+v", s)
}

// Promise (Stop's doc and README "Stopping"): Stop abandons "a call still
// running when it overruns". A call whose handler returned nil well before
// its deadline is not running, and must not be marked overrunning by the
// scheduler nor dropped by Stop. On eeac924 the scheduler marks it overran
// once the clock passes its deadline and grace, and Stop drops its event
// with "handler overran its deadline, abandoned".
func TestReview9StopDoesNotAbandonAReturnedCallAsOverrun(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	m, clk, drops := returnedCallMonitor(t)

	clk.Step(DefaultHandleTimeout + time.Second) // past the deadline and the grace
	waitFor(t, func() bool {                     // the scheduler's pass for that time has run
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.sched.at.IsZero()
	}, "the scheduler never looked at the call")
	done := make(chan struct{})
	go func() { m.Stop(); close(done) }()
	waitFor(t, review9StateIs(m, stopped), "Stop never began")
	close(clk.release)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Stop did not return once the call settled")
	}
	require.Empty(t, drops.all(), "an event its handler handled was dropped")
	s := m.Stats()
	require.Equal(t, uint64(1), s.Handled, "%+v", s)
}

// nilPtrErr is an error type whose Error dereferences its receiver.
type nilPtrErr struct{ msg string }

func (e *nilPtrErr) Error() string { return e.msg }

// Promise (README: a handler panic is "recovered, logged with its stack,
// backed off", not "kills the process" as in containerd): a handler's
// misbehaviour cannot take the process down. Returning a typed nil pointer
// as an error is Go's best-known nil trap; the event fails and backs off.
// On eeac924 the process dies: with logrus's text formatter at the replay,
// whose log line calls the stored error's Error method directly (call.go
// logRetry); with its JSON formatter (containerd's --log-format json) at
// the first failure, whose log line hands the error to logrus, which calls
// Error directly too. Neither is under a recover: the worker goroutine
// panics. The scenario runs in a child process so that the crash fails
// this test rather than the test binary.
func TestReview9RetryOfATypedNilErrorDoesNotCrash(t *testing.T) {
	if format := os.Getenv("EVENTMONITOR_REVIEW9_CHILD"); format != "" {
		review9TypedNilError(t, format)
		return
	}
	for _, format := range []string{"text", "json"} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestReview9RetryOfATypedNilErrorDoesNotCrash$", "-test.count=1")
		cmd.Env = append(os.Environ(), "EVENTMONITOR_REVIEW9_CHILD="+format)
		out, err := cmd.CombinedOutput()
		if len(out) > 3000 {
			out = out[:3000]
		}
		assert.NoError(t, err, "with the %s formatter, the process running the monitor died:\n%s", format, out)
	}
}

func review9TypedNilError(t *testing.T, format string) {
	logger := logrus.New()
	logger.Out = io.Discard
	if format == "json" {
		logger.Formatter = &logrus.JSONFormatter{}
	}
	var calls atomic.Int32
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if calls.Add(1) == 1 {
			var err *nilPtrErr
			return err // a non-nil error holding a nil pointer
		}
		return nil
	}), WithLogger(logrus.NewEntry(logger)))
	h.submit(t, ev{"a", 1})
	h.step(t, DefaultInitialBackoff) // the replay
	require.Equal(t, int32(2), calls.Load())
	require.Equal(t, uint64(1), h.m.Stats().Handled)
}

// review9Ctx is a caller's context whose Err notes whether it was called
// while its caller held the monitor's lock: the lock then stays taken for
// as long as Err waits for it (nothing holds it that long otherwise).
type review9Ctx struct {
	context.Context
	m         *Monitor
	underLock atomic.Bool
}

func (c *review9Ctx) Err() error {
	for deadline := time.Now().Add(200 * time.Millisecond); !c.m.mu.TryLock(); {
		if time.Now().After(deadline) {
			c.underLock.Store(true)
			return c.Context.Err()
		}
		runtime.Gosched()
	}
	c.m.mu.Unlock()
	return c.Context.Err()
}

// Promise (the package's own lock rule, kept for the handler's error, the
// converter's, the payload's type URL, the drop handler, Metrics and log
// hooks): no user code runs under Monitor.mu. A caller's ctx is user code:
// an Err that takes a lock of its own, logs through a hook or reads Stats
// deadlocks or inverts lock order. On eeac924 WaitIdle, Shutdown and Stop's
// wait loop call ctx.Err() with mu held (monitor.go WaitIdle, stop.go
// Shutdown and stop).
func TestReview9CallersContextIsNotReadUnderTheLock(t *testing.T) {
	r := newRecorder()
	started, release := r.gate(ev{"a", 1})
	h := newHarness(t, r)
	h.submit(t, ev{"a", 1})
	<-started // a call runs: WaitIdle and Shutdown wait, looking at ctx

	ended, cancel := context.WithCancel(context.Background())
	cancel()
	ctx := &review9Ctx{Context: ended, m: h.m}
	require.ErrorIs(t, h.m.WaitIdle(ctx), context.Canceled)
	waitIdle := ctx.underLock.Load()

	ctx = &review9Ctx{Context: ended, m: h.m}
	done := make(chan error, 1)
	go func() { done <- h.m.Shutdown(ctx) }()
	require.ErrorIs(t, <-done, context.Canceled)
	release()
	require.False(t, waitIdle, "WaitIdle called its ctx's Err under the monitor's lock")
	require.False(t, ctx.underLock.Load(), "Shutdown called its ctx's Err under the monitor's lock")
}
