package eventmonitortest_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/eventmonitortest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// flakyHandler fails its first calls, as a handler whose shim is not
// answering yet does, and counts its calls.
type flakyHandler struct {
	mu       sync.Mutex
	failures int
	calls    int
}

func (h *flakyHandler) HandleEvent(ctx context.Context, event any) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls++
	if h.calls <= h.failures {
		return errors.New("shim not answering")
	}
	return nil
}

func (h *flakyHandler) callCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls
}

// The test a user writes for a handler's retries: retried after exactly
// 1 s, then 2 s, and not a moment before.
func TestRetriedAfterExactlyItsBackoff(t *testing.T) {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	h := &flakyHandler{failures: 2}
	m, err := eventmonitor.New(h, eventmonitor.WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Stop()

	if err := m.Submit("c1", "exit of c1"); err != nil {
		t.Fatal(err)
	}
	eventmonitortest.Settle(t, m)
	if got := h.callCount(); got != 1 {
		t.Fatalf("calls after Submit: %d, want 1", got)
	}
	eventmonitortest.Step(t, m, clk, time.Second-time.Nanosecond)
	if got := h.callCount(); got != 1 {
		t.Fatalf("retried before its 1 s backoff: %d calls", got)
	}
	eventmonitortest.Step(t, m, clk, time.Nanosecond)
	if got := h.callCount(); got != 2 {
		t.Fatalf("not retried at 1 s: %d calls", got)
	}
	if step := eventmonitortest.StepToNextRetry(t, m, clk); step != 2*time.Second {
		t.Fatalf("second retry after %v, want 2s", step)
	}
	if got := h.callCount(); got != 3 || m.InBackoff("c1") {
		t.Fatalf("after the second retry: %d calls, in backoff %v; want 3 calls, handled", got, m.InBackoff("c1"))
	}
}

// StepToNextRetry reaches a retry however far back the clock was set: a
// Duration spans only about 292 years.
func TestStepToNextRetryAfterTheClockWentFarBack(t *testing.T) {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	h := &flakyHandler{failures: 1}
	m, err := eventmonitor.New(h, eventmonitor.WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Stop()
	if err := m.Submit("c1", "exit of c1"); err != nil {
		t.Fatal(err)
	}
	eventmonitortest.Settle(t, m)
	due := m.Pending()[0].Due
	clk.SetTime(time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC))
	eventmonitortest.StepToNextRetry(t, m, clk)
	if got := h.callCount(); got != 2 || !clk.Now().Equal(due) {
		t.Fatalf("clock at %v, %d calls; want it at the retry's due time %v, and the retry made", clk.Now(), got, due)
	}
}

// An idle monitor holds no timer on the fake clock; a key in backoff holds
// one (the retry), and so does a call in progress (its deadline).
func TestFakeClockWaitersTellTheTruth(t *testing.T) {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	started, release := make(chan struct{}), make(chan struct{})
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if event == "slow" {
			close(started)
			<-release
			return nil
		}
		return errors.New("fails")
	}), eventmonitor.WithClock(clk), eventmonitor.WithBackoff(time.Hour, time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Stop()
	var releaseOnce sync.Once
	defer releaseOnce.Do(func() { close(release) }) // before Stop, should the test fail

	eventmonitortest.Settle(t, m)
	if clk.HasWaiters() {
		t.Fatal("an idle monitor holds a timer")
	}
	if err := m.Submit("c1", "fails"); err != nil {
		t.Fatal(err)
	}
	eventmonitortest.Settle(t, m)
	if !clk.HasWaiters() {
		t.Fatal("a key in backoff holds no timer")
	}
	m.Forget("c1")
	eventmonitortest.Settle(t, m)
	if clk.HasWaiters() {
		t.Fatal("a forgotten key's timer is still set")
	}

	if err := m.Submit("c2", "slow"); err != nil {
		t.Fatal(err)
	}
	<-started
	waitForWaiters(t, clk, true, "a call in progress holds a timer for its deadline")
	releaseOnce.Do(func() { close(release) })
	eventmonitortest.Settle(t, m)
	if clk.HasWaiters() {
		t.Fatal("the deadline's timer is still set after the call returned and the monitor settled")
	}
}

// waitForWaiters waits until the clock has waiters, or none, as wanted.
func waitForWaiters(t *testing.T, clk *testclock.FakeClock, want bool, what string) {
	t.Helper()
	deadline := time.Now().Add(eventmonitortest.Timeout)
	for clk.HasWaiters() != want {
		if time.Now().After(deadline) {
			t.Fatal(what)
		}
		time.Sleep(time.Millisecond) // polling the clock with a deadline
	}
}

func TestStepToNextRetryFailsWithNothingWaiting(t *testing.T) {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error { return nil }),
		eventmonitor.WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Stop()
	fake := &recordingTB{TB: t}
	func() {
		defer func() { recover() }() // Fatalf ends the helper, as FailNow ends a test
		eventmonitortest.StepToNextRetry(fake, m, clk)
	}()
	if fake.failure == "" {
		t.Fatal("StepToNextRetry did not fail with no key in backoff")
	}
}

// recordingTB records a helper's failure instead of failing the test.
type recordingTB struct {
	testing.TB
	failure string
}

func (r *recordingTB) Helper() {}
func (r *recordingTB) Fatalf(format string, args ...any) {
	r.failure = format
	panic("Fatalf")
}
