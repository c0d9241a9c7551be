package eventmonitor_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

type noopMetrics struct{}

func (noopMetrics) HandlerDone(time.Duration, error) {}
func (noopMetrics) Recovered(time.Duration)          {}
func (noopMetrics) Dropped(error, int)               {}

// newCountingMonitor returns a monitor with a no-op handler and a channel
// closed once b.N events are handled. Cleanup stops the monitor.
func newCountingMonitor(b *testing.B, opts ...eventmonitor.Option) (*eventmonitor.Monitor, <-chan struct{}) {
	var handled atomic.Int64
	done := make(chan struct{})
	target := int64(b.N)
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error {
		if handled.Add(1) == target {
			close(done)
		}
		return nil
	}), opts...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(m.Stop)
	return m, done
}

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
			opts []eventmonitor.Option
		}{
			{"no-metrics", nil},
			{"noop-metrics", []eventmonitor.Option{eventmonitor.WithMetrics(noopMetrics{})}},
			{"no-deadline", []eventmonitor.Option{eventmonitor.WithHandleTimeout(0)}},
		} {
			b.Run(tc.name+"/workers="+strconv.Itoa(workers), func(b *testing.B) {
				m, done := newCountingMonitor(b, append([]eventmonitor.Option{eventmonitor.WithWorkers(workers)}, tc.opts...)...)
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

// BenchmarkEnvelopePath streams protobuf envelopes through Run and the
// typeurl converter to a no-op handler, beside typeurl's decoding alone and
// the converter's.
func BenchmarkEnvelopePath(b *testing.B) {
	payloads := make([]*eventmonitor.Envelope, 1000)
	for i := range payloads {
		payloads[i] = envelope(b, "k8s.io", "container-"+strconv.Itoa(i))
	}
	b.Run("decode-only", func(b *testing.B) {
		b.ReportAllocs()
		for i := range b.N {
			if _, err := typeurl.UnmarshalAny(payloads[i%len(payloads)].Event); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("convert-only", func(b *testing.B) {
		b.ReportAllocs()
		for i := range b.N {
			if _, _, err := keyConverter.Convert(payloads[i%len(payloads)].Event); err != nil {
				b.Fatal(err)
			}
		}
	})
	// The stream as containerd.NewSubscriber buffers it, fed as fast as the
	// monitor takes envelopes.
	b.Run("monitor", func(b *testing.B) {
		m, done := newCountingMonitor(b, eventmonitor.WithConverter(keyConverter))
		ch := make(chan *eventmonitor.Envelope, 128)
		runStream(b, m, ch)
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			ch <- payloads[i%len(payloads)]
		}
		<-done
	})
	// Every envelope already waiting in the stream, as the payloads are for
	// decode-only: the monitor's own cost, without a feeding goroutine's.
	b.Run("monitor-waiting", func(b *testing.B) {
		m, done := newCountingMonitor(b, eventmonitor.WithConverter(keyConverter))
		ch := make(chan *eventmonitor.Envelope, b.N)
		for i := range b.N {
			ch <- payloads[i%len(payloads)]
		}
		b.ReportAllocs()
		b.ResetTimer()
		runStream(b, m, ch)
		<-done
	})
}

// runStream runs m on ch until the benchmark ends.
func runStream(b *testing.B, m *eventmonitor.Monitor, ch <-chan *eventmonitor.Envelope) {
	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel)
	go m.Run(ctx, eventmonitor.SubscriberFunc(func(context.Context, ...string) (<-chan *eventmonitor.Envelope, <-chan error) { return ch, nil }))
}

// BenchmarkBackoffAtScale holds 1,000 to 100,000 keys in backoff and times
// putting one more key in and taking it out: O(log n) each. It also reports
// the heap each waiting key costs.
func BenchmarkBackoffAtScale(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000} {
		b.Run("keys="+strconv.Itoa(n), func(b *testing.B) {
			m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error { return nil }),
				eventmonitor.WithBackoff(time.Hour, 2*time.Hour), eventmonitor.WithDropHandler(func(eventmonitor.Drop) {}))
			if err != nil {
				b.Fatal(err)
			}
			defer m.Stop()
			keys := make([]string, n)
			for i := range keys {
				keys[i] = "container-" + strconv.Itoa(i)
			}
			event := any(struct{}{})
			before := heapInUse()
			for _, k := range keys {
				m.Backoff(k, event)
			}
			perKey := float64(heapInUse()-before) / float64(n)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				m.Backoff("one-more", event)
				m.Forget("one-more")
			}
			b.ReportMetric(perKey, "bytes/key") // after the loop: ResetTimer clears reported metrics
		})
	}
}

func heapInUse() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// BenchmarkBurstDrain submits a burst over 200 keys to a handler that fails
// 20 % of its calls at random, with a real clock and a backoff of 10 ms
// doubling to 1 s, and times until every event is handled: how fast keys
// with a backlog recover under independent failures.
func BenchmarkBurstDrain(b *testing.B) {
	const keys, perKey, failRate = 200, 20, 0.2
	var replays uint64
	for range b.N {
		var handled atomic.Int64
		done := make(chan struct{})
		m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error {
			if rand.Float64() < failRate {
				return errors.New("flaky")
			}
			if handled.Add(1) == keys*perKey {
				close(done)
			}
			return nil
		}), eventmonitor.WithWorkers(4), eventmonitor.WithBackoff(10*time.Millisecond, time.Second), eventmonitor.WithLogger(quietLogger()))
		if err != nil {
			b.Fatal(err)
		}
		for seq := range perKey {
			for k := range keys {
				if err := m.Submit("container-"+strconv.Itoa(k), seq); err != nil {
					b.Fatal(err)
				}
			}
		}
		<-done
		replays += m.Stats().Retried
		m.Stop()
	}
	b.ReportMetric(float64(replays)/float64(b.N), "replays/op")
	b.ReportMetric(keys*perKey, "events/op")
}

// BenchmarkMemoryPerFailedKey puts 100,000 keys in backoff the way real
// handlers do, each by a failed call returning an error of its own, and
// reports the heap each waiting key costs: heap in use after GC, divided by
// the keys. The key strings and the (shared, zero-size) event are made
// beforehand and not counted; the errors, the key states, queues, map and
// heap entries are.
func BenchmarkMemoryPerFailedKey(b *testing.B) {
	const n = 100_000
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "container-" + strconv.Itoa(i)
	}
	event := any(struct{}{})
	var perKey float64
	for range b.N {
		m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error { return errors.New("shim not answering") }),
			eventmonitor.WithClock(testclock.NewFakeClock(time.Now())), eventmonitor.WithLogger(quietLogger()), eventmonitor.WithWorkers(2))
		if err != nil {
			b.Fatal(err)
		}
		before := heapInUse()
		for _, k := range keys {
			if err := m.Submit(k, event); err != nil {
				b.Fatal(err)
			}
		}
		if err := m.WaitIdle(context.Background()); err != nil {
			b.Fatal(err)
		}
		if s := m.Stats(); s.KeysInBackoff != n {
			b.Fatalf("%d keys in backoff, want %d", s.KeysInBackoff, n)
		}
		perKey = float64(heapInUse()-before) / n
		m.Stop()
	}
	b.ReportMetric(perKey, "bytes/key")
}
