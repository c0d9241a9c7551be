package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type recordedMetrics struct {
	mu        sync.Mutex
	durations []time.Duration
	failures  int
	recovered []time.Duration
	drops     map[error]int
}

func (r *recordedMetrics) HandlerDone(d time.Duration, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.durations = append(r.durations, d)
	if err != nil {
		r.failures++
	}
}

func (r *recordedMetrics) Recovered(d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recovered = append(r.recovered, d)
}

func (r *recordedMetrics) Dropped(reason error, n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, sentinel := range []error{ErrStopped, ErrMaxAttempts} {
		if errors.Is(reason, sentinel) {
			r.drops[sentinel] += n
		}
	}
}

func TestMetricsSeeDurationsRecoveriesAndDrops(t *testing.T) {
	r := newRecorder()
	mt := &recordedMetrics{drops: map[error]int{}}
	h := newHarness(t, r, WithMetrics(mt), WithMaxAttempts(1))
	started, release := r.gate(ev{"a", 1})
	h.submit(t, ev{"a", 1})
	<-started
	h.clock.Step(300 * time.Millisecond) // a/1 takes 300 ms of the monitor's clock
	release()
	r.fail(ev{"b", 1}, 1)
	h.submit(t, ev{"b", 1}) // given up at once: max attempts 1
	waitFor(t, func() bool { mt.mu.Lock(); defer mt.mu.Unlock(); return len(mt.durations) == 2 }, "two calls observed")
	h.m.Stop()

	mt.mu.Lock()
	defer mt.mu.Unlock()
	assert.Equal(t, []time.Duration{300 * time.Millisecond, 0}, mt.durations)
	assert.Equal(t, 1, mt.failures)
	assert.Equal(t, map[error]int{ErrMaxAttempts: 1}, mt.drops)
}

func TestMetricsRecoveryTime(t *testing.T) {
	r := newRecorder()
	mt := &recordedMetrics{drops: map[error]int{}}
	h := newHarness(t, r, WithMetrics(mt))
	r.fail(ev{"a", 1}, 2)
	h.submit(t, ev{"a", 1})
	h.step(t, time.Second)
	h.step(t, 2*time.Second)
	require.Equal(t, uint64(1), h.m.Stats().Handled, "recovers after two failures")
	h.m.Stop()
	mt.mu.Lock()
	defer mt.mu.Unlock()
	require.Equal(t, []time.Duration{3 * time.Second}, mt.recovered, "measured from the first failure")
}

type countingMetrics struct{ done, dropped atomic.Int64 }

func (r *countingMetrics) HandlerDone(time.Duration, error) { r.done.Add(1) }
func (r *countingMetrics) Recovered(time.Duration)          {}
func (r *countingMetrics) Dropped(_ error, n int)           { r.dropped.Add(int64(n)) }

// Guarantee (metrics from report): with failures, Backoff from handlers
// (during replays), Forget, overruns ignoring ctx, and a Shutdown whose ctx
// ends racing a Stop, every Stats snapshot balances, no key runs twice at
// once, and in the end HandlerDone was reported exactly once per settled
// call (Handled + Failed + Ignored: none for abandoned ones) and the
// Dropped metric matches Stats.Dropped and the drop handler.
func TestMetricsMatchStatsUnderAbandonment(t *testing.T) {
	mt := &countingMetrics{}
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

// panickyDropMetrics is Metrics whose Dropped panics.
type panickyDropMetrics struct{}

func (panickyDropMetrics) HandlerDone(time.Duration, error) {}
func (panickyDropMetrics) Recovered(time.Duration)          {}
func (panickyDropMetrics) Dropped(error, int)               { panic("metrics broke") }

// Promise (emit's doc, WithDropHandler): every drop reaches the drop
// handler; emit recovers a panic "so that it cannot take a worker or the
// stream down". When Metrics.Dropped shared the drop handler's recover,
// its panic skipped the drop handler: the event was lost without it ever
// hearing of it (only a log line said Metrics panicked).
func TestPanickingMetricsStillLetsTheDropHandlerHear(t *testing.T) {
	r := newRecorder()
	r.fail(ev{"a", 1}, 100)
	h := newHarness(t, r, WithMaxAttempts(1), WithMetrics(panickyDropMetrics{}), WithLogger(quietLogger()))
	h.submit(t, ev{"a", 1})
	h.settled(t)
	require.Len(t, h.drops.all(), 1, "a/1 was dropped (max attempts); the drop handler must hear of it")
}
