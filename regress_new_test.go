package eventmonitor_test

// Regression tests of behaviour that came with API of its own
// (WithDeferredStart, MaxWorkers).

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

// ---- 13 ------------------------------------------------------------------

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

// ---- 15 ------------------------------------------------------------------

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
