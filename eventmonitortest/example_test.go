package eventmonitortest_test

import (
	"context"
	"errors"
	"testing"
	"time"

	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/eventmonitortest"
)

// A test of a handler's retries, as a user writes it in a Test function of
// their own (t is that function's *testing.T): the first call fails, the
// retry comes after exactly the initial backoff, not a moment before.
// TestRetriedAfterExactlyItsBackoff in this package runs the same steps.
func ExampleStepToNextRetry() {
	var t *testing.T // your test's
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	calls := 0
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if calls++; calls == 1 {
			return errors.New("shim not answering")
		}
		return nil
	}), eventmonitor.WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Stop()

	_ = m.Submit("c1", "exit of c1")
	eventmonitortest.Step(t, m, clk, time.Second-time.Nanosecond)
	if calls != 1 {
		t.Fatalf("retried before the backoff: %d calls", calls)
	}
	if step := eventmonitortest.StepToNextRetry(t, m, clk); step != time.Nanosecond || calls != 2 {
		t.Fatalf("retried %v later, %d calls; want 1ns later, 2 calls", step, calls)
	}
}
