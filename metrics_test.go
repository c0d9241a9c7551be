package eventmonitor

import (
	"errors"
	"sync"
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
