package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Review 6 (fixed): a second Shutdown after one that drained everything
// returned ErrStopped claiming a Stop had cut its drain short. Shutdown
// again returns nil when there is nothing it could report.
func TestReview6ShutdownAfterDrainedShutdown(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	h.submit(t, ev{"a", 1})
	require.NoError(t, h.m.Shutdown(context.Background()))
	require.Equal(t, anys(ev{"a", 1}), r.handledList())
	require.Empty(t, h.drops.all())
	require.NoError(t, h.m.Shutdown(context.Background()),
		"nothing was cut short: the first Shutdown drained everything")
}

// Guarantee (keyq next x drain): an event Backoff gave a key while its
// replay ran, so that the key waits again after the replay, is still
// drained by a Shutdown begun meanwhile: handled, not dropped, nil error.
func TestReview6BackoffDuringReplayIsDrained(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	r.fail(ev{"a", 1}, 1)
	h.submit(t, ev{"a", 1})
	h.settled(t)
	started, release := r.gate(ev{"a", 1})
	h.clock.Step(time.Second) // the replay: a/1 runs and blocks
	<-started
	h.m.Backoff("a", ev{"a", 2}) // recorded as the key's next wait
	done := make(chan error, 1)
	go func() { done <- h.m.Shutdown(context.Background()) }()
	waitFor(t, h.stopping, "Shutdown began")
	release()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown hung on a key waiting again after its replay")
	}
	require.Equal(t, anys(ev{"a", 1}, ev{"a", 2}), r.handledList())
	require.Empty(t, h.drops.all())
}

// Guarantee (keyq next): the wait recorded by Backoff during a replay is
// due the initial delay from the Backoff call, not from the replay's end:
// a replay outlasting it leaves the event due at once, and WaitIdle sees
// it handled with no timer or retry left.
func TestReview6ReplayOutlastingTheWait(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(0))
	r.fail(ev{"a", 1}, 1)
	h.submit(t, ev{"a", 1})
	h.settled(t)
	started, release := r.gate(ev{"a", 1})
	h.clock.Step(time.Second)
	<-started
	h.m.Backoff("a", ev{"a", 2})
	h.clock.Step(5 * time.Second) // the replay outlasts the initial delay
	release()
	h.settled(t)
	require.Equal(t, anys(ev{"a", 1}, ev{"a", 2}), r.handledList())
	_, ok := h.m.NextRetry()
	require.False(t, ok)
	require.False(t, h.clock.HasWaiters())
}

type r6Metrics struct{ done, dropped atomic.Int64 }

func (r *r6Metrics) HandlerDone(time.Duration, error) { r.done.Add(1) }
func (r *r6Metrics) Recovered(time.Duration)          {}
func (r *r6Metrics) Dropped(_ error, n int)           { r.dropped.Add(int64(n)) }

// Guarantee (metrics from report): with failures, Backoff from handlers
// (during replays), Forget, overruns ignoring ctx, and a Shutdown whose ctx
// ends racing a Stop, every Stats snapshot balances, no key runs twice at
// once, and in the end HandlerDone was reported exactly once per settled
// call (Handled + Failed + Ignored: none for abandoned ones) and the
// Dropped metric matches Stats.Dropped and the drop handler.
func TestReview6MetricsMatchStatsUnderAbandonment(t *testing.T) {
	mt := &r6Metrics{}
	var running sync.Map
	var twice atomic.Int32
	var active, n atomic.Int64
	var m *Monitor
	handler := HandlerFunc(func(ctx context.Context, e any) error {
		active.Add(1)
		defer active.Add(-1)
		k := keyOf(e)
		if _, loaded := running.LoadOrStore(k, true); loaded {
			twice.Add(1)
		}
		defer running.Delete(k)
		i := n.Add(1)
		switch i % 7 {
		case 0:
			return errors.New("fail")
		case 1:
			m.Backoff(k, ev{k, int(i)})
		case 2:
			return ErrUnsupportedEvent
		case 3:
			if i%21 == 3 {
				time.Sleep(15 * time.Millisecond) // handler work overrunning, ignoring ctx
			}
		}
		return nil
	})
	var drops atomic.Int64
	var err error
	m, err = New(handler, WithMetrics(mt), WithWorkers(3), WithHandleTimeout(5*time.Millisecond),
		WithBackoff(time.Millisecond, 3*time.Millisecond), WithMaxAttempts(3), WithLogger(quietLogger()),
		WithDropHandler(func(d Drop) { drops.Add(int64(max(1, len(d.Events)))) }))
	require.NoError(t, err)
	quit := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-quit:
				return
			case <-time.After(100 * time.Microsecond):
			}
			s := m.Stats()
			if rhs := s.Filtered + s.Ignored + s.Handled + s.Dropped + s.Forgotten +
				uint64(s.Queued) + uint64(s.EventsInBackoff) + uint64(s.InFlight); rhs != s.Received {
				t.Errorf("Stats identity: %+v", s)
				return
			}
		}
	}()
	for i := 0; i < 400; i++ {
		k := fmt.Sprint("k", i%6)
		if i%3 == 0 {
			m.Backoff(k, ev{k, -i})
		} else {
			_ = m.Submit(k, ev{k, -i})
		}
		if i%50 == 0 {
			m.Forget(k)
		}
	}
	waitFor(t, func() bool { return m.Stats().Handled >= 50 }, "progress")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	go m.Stop()
	_ = m.Shutdown(ctx)
	m.Stop()
	close(quit)
	<-sampled
	waitFor(t, func() bool { return active.Load() == 0 }, "abandoned handlers return")
	s := m.Stats()
	require.Zero(t, s.InFlight)
	require.Zero(t, twice.Load(), "a key ran on two goroutines")
	require.Equal(t, int64(s.Dropped), drops.Load())
	require.Equal(t, int64(s.Dropped), mt.dropped.Load())
	require.Equal(t, int64(s.Handled+s.Failed+s.Ignored), mt.done.Load(), "%+v", s)
}
