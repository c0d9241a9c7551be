package eventmonitor

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
)

type noopMetrics struct{}

func (noopMetrics) HandlerDone(time.Duration, error) {}
func (noopMetrics) Recovered(time.Duration)          {}
func (noopMetrics) Dropped(error, int)               {}

// BenchmarkFastPath submits events over 1,000 keys to a no-op handler and
// waits until all are handled: the monitor's own cost per event.
func BenchmarkFastPath(b *testing.B) {
	keys := make([]string, 1000)
	for i := range keys {
		keys[i] = "container-" + strconv.Itoa(i)
	}
	for _, workers := range []int{1, 4} {
		for _, tc := range []struct {
			name string
			opts []Option
		}{{"no-metrics", nil}, {"noop-metrics", []Option{WithMetrics(noopMetrics{})}}} {
			b.Run(tc.name+"/workers="+strconv.Itoa(workers), func(b *testing.B) {
				var handled atomic.Int64
				done := make(chan struct{})
				target := int64(b.N)
				m, err := New(HandlerFunc(func(context.Context, any) error {
					if handled.Add(1) == target {
						close(done)
					}
					return nil
				}), append([]Option{WithWorkers(workers)}, tc.opts...)...)
				if err != nil {
					b.Fatal(err)
				}
				defer m.Stop()
				event := any(struct{}{})
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					if err := m.Submit(keys[i%len(keys)], event); err != nil {
						b.Fatal(err)
					}
				}
				<-done
				b.StopTimer()
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
			})
		}
	}
}
