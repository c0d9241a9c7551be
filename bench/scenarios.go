package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/containerd/api/events"
	"github.com/containerd/typeurl/v2"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

var errFail = errors.New("failing on purpose")

func keyNames(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("container-%06d", i)
	}
	return keys
}

// fastPath submits n events over keys as fast as the contender takes them
// to a no-op handler: events/s, and heap allocations per event. A non-zero
// callTimeout is every contender's deadline per call (see settings).
func fastPath(newC newContender, workers, n int, keys []string, callTimeout time.Duration) (rate, allocs float64) {
	var handled atomic.Int64
	done := make(chan struct{})
	c := newC(func(context.Context, *event) error {
		if handled.Add(1) == int64(n) {
			close(done)
		}
		return nil
	}, settings{workers: workers, initialBackoff: time.Second, maxBackoff: 5 * time.Minute, tick: time.Second, callTimeout: callTimeout})
	defer c.stop()
	evs := make([]*event, len(keys))
	for i, k := range keys {
		evs[i] = &event{key: k}
	}
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	start := time.Now()
	for i := range n {
		c.submit(evs[i%len(evs)])
	}
	<-done
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	return float64(n) / elapsed.Seconds(), float64(after.Mallocs-before.Mallocs) / float64(n)
}

// latencies collects accept-to-handled times.
type latencies struct {
	mu sync.Mutex
	d  []time.Duration
}

func (l *latencies) add(d time.Duration) {
	l.mu.Lock()
	l.d = append(l.d, d)
	l.mu.Unlock()
}

func (l *latencies) percentile(p float64) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.d) == 0 {
		return 0
	}
	slices.Sort(l.d)
	return l.d[min(len(l.d)-1, int(p*float64(len(l.d))))]
}

// headOfLine paces fast events at rate per second over keys for d, beside
// (if slow) one key that gets an event every 100 ms taking 50 ms to handle.
// An event's accept time is when the runtime emitted it, so time spent
// blocked in submit counts. It returns the fast events' p50 and p99.
func headOfLine(newC newContender, workers, rate int, keys []string, d time.Duration, slow bool) (p50, p99 time.Duration) {
	lat := &latencies{d: make([]time.Duration, 0, rate*int(d/time.Second+1))}
	var outstanding sync.WaitGroup
	c := newC(func(_ context.Context, e *event) error {
		if e.key == "slow" {
			time.Sleep(50 * time.Millisecond) // the slow key's handling takes 50 ms
		} else {
			lat.add(time.Since(e.accepted))
		}
		outstanding.Done()
		return nil
	}, settings{workers: workers, initialBackoff: time.Second, maxBackoff: 5 * time.Minute, tick: time.Second})
	defer c.stop()
	const batch = time.Millisecond
	perBatch := rate / int(time.Second/batch)
	start := time.Now()
	next := 0
	for tick := time.Duration(0); tick < d; tick += batch {
		// An event is emitted when the pacer wakes for it, so that a sleep
		// that overshoots does not count; if the pacer is behind (a submit
		// blocked), it was due at its scheduled time, and the wait counts.
		emitted := start.Add(tick)
		if wait := time.Until(emitted); wait > 0 {
			time.Sleep(wait) // pacing the runtime's emissions
			emitted = time.Now()
		}
		if slow && tick%(100*time.Millisecond) == 0 {
			outstanding.Add(1)
			c.submit(&event{key: "slow", accepted: emitted})
		}
		for range perBatch {
			outstanding.Add(1)
			c.submit(&event{key: keys[next%len(keys)], accepted: emitted})
			next++
		}
	}
	outstanding.Wait()
	return lat.percentile(0.50), lat.percentile(0.99)
}

// backoffAtScale puts one event for each of keys into backoff (due in an
// hour), then measures the process's CPU over idle, the heap per key, and
// the time per key to put it in and take it out.
func backoffAtScale(newC newContender, keys []string, idle time.Duration) (cpu time.Duration, bytesPerKey float64, put, take time.Duration) {
	evs := make([]*event, len(keys))
	for i, k := range keys {
		evs[i] = &event{key: k}
	}
	c := newC(func(context.Context, *event) error { return errFail },
		settings{workers: 4, initialBackoff: time.Hour, maxBackoff: 2 * time.Hour, tick: time.Second})
	defer c.stop()
	before := heapInUse()
	start := time.Now()
	c.backoff(evs)
	put = time.Since(start) / time.Duration(len(keys))
	bytesPerKey = float64(heapInUse()-before) / float64(len(keys))
	cpu = idleCPU(idle)
	start = time.Now()
	c.forget(keys)
	take = time.Since(start) / time.Duration(len(keys))
	return cpu, bytesPerKey, put, take
}

func heapInUse() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// idleCPU returns the CPU time (user and system) the process uses in d.
func idleCPU(d time.Duration) time.Duration {
	before := processCPU()
	time.Sleep(d) // the idle period measured
	return processCPU() - before
}

// processCPU is the user and system time this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// retryPrecision makes each of keys fail once and measures how late its
// retry starts after the initial delay.
func retryPrecision(newC newContender, keys []string, delay time.Duration) (p50, p99, worst time.Duration) {
	var mu sync.Mutex
	failedAt := make(map[string]time.Time, len(keys))
	lat := &latencies{}
	var retried sync.WaitGroup
	retried.Add(len(keys))
	c := newC(func(_ context.Context, e *event) error {
		mu.Lock()
		at, failed := failedAt[e.key]
		if !failed {
			failedAt[e.key] = time.Now()
			mu.Unlock()
			return errFail
		}
		mu.Unlock()
		lat.add(time.Since(at) - delay)
		retried.Done()
		return nil
	}, settings{workers: 4, initialBackoff: delay, maxBackoff: 100 * delay, tick: delay})
	defer c.stop()
	start := time.Now()
	for i, k := range keys {
		if wait := time.Until(start.Add(time.Duration(i) * time.Millisecond)); wait > 0 {
			time.Sleep(wait) // one key a millisecond, so failures spread over the tick
		}
		c.submit(&event{key: k})
	}
	retried.Wait()
	return lat.percentile(0.50), lat.percentile(0.99), lat.percentile(1)
}

// taskExitPayloads are containerd TaskExit events over keys, as they come
// off containerd's events API.
func taskExitPayloads(keys []string) []typeurl.Any {
	out := make([]typeurl.Any, len(keys))
	for i, k := range keys {
		p, err := typeurl.MarshalAnyToProto(&events.TaskExit{ContainerID: k, ID: k, Pid: uint32(1000 + i), ExitStatus: 137})
		if err != nil {
			panic(err)
		}
		out[i] = p
	}
	return out
}

// unmarshal is the envelope path's floor: typeurl decoding a payload.
func unmarshal(p typeurl.Any) error {
	_, err := typeurl.UnmarshalAny(p)
	return err
}

// convert is what the envelope path decodes with: containerd's converter.
func convert(p typeurl.Any) error {
	_, _, err := containerd.Converter().Convert(p)
	return err
}

// decodeLoop decodes n payloads in a loop: events/s.
func decodeLoop(payloads []typeurl.Any, n int, decode func(typeurl.Any) error) float64 {
	start := time.Now()
	for i := range n {
		if err := decode(payloads[i%len(payloads)]); err != nil {
			panic(err)
		}
	}
	return float64(n) / time.Since(start).Seconds()
}

// decodeFromChannel decodes n payloads as a live feed delivers them: one
// goroutine sends them on a channel buffered as the envelope path's stream
// is, another decodes them. events/s.
func decodeFromChannel(payloads []typeurl.Any, n int, decode func(typeurl.Any) error) float64 {
	ch := make(chan typeurl.Any, 128)
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		for p := range ch {
			if err := decode(p); err != nil {
				panic(err)
			}
		}
	}()
	for i := range n {
		ch <- payloads[i%len(payloads)]
	}
	close(ch)
	<-done
	return float64(n) / time.Since(start).Seconds()
}

// envelopePath streams n envelopes through Run, converted by containerd's
// converter, to a no-op handler: events/s. The stream is buffered as
// containerd.NewSubscriber buffers it and fed as fast as the monitor takes
// envelopes or, if waiting, holds every envelope before the clock starts
// (as the decode loop's payloads are ready), leaving out the feeder's cost.
func envelopePath(payloads []typeurl.Any, workers, n int, waiting bool) float64 {
	var handled atomic.Int64
	done := make(chan struct{})
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error {
		if handled.Add(1) == int64(n) {
			close(done)
		}
		return nil
	}), eventmonitor.WithConverter(containerd.Converter()), eventmonitor.WithWorkers(workers))
	if err != nil {
		panic(err)
	}
	defer m.Stop()
	envs := make([]*eventmonitor.Envelope, len(payloads))
	for i, p := range payloads {
		envs[i] = &eventmonitor.Envelope{Namespace: containerd.K8sNamespace, Topic: "/tasks/exit", Event: p}
	}
	ch := make(chan *eventmonitor.Envelope, 128)
	feed := func() {
		for i := range n {
			ch <- envs[i%len(envs)]
		}
	}
	if waiting {
		ch = make(chan *eventmonitor.Envelope, n)
		feed()
		feed = func() {}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now()
	go m.Run(ctx, eventmonitor.SubscriberFunc(func(context.Context, ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		return ch, nil
	}))
	feed()
	<-done
	return float64(n) / time.Since(start).Seconds()
}
