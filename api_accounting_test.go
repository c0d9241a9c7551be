package eventmonitor_test

// Accounting through the public API only: mixed traffic, failures and
// overruns while Stop or Shutdown races it, and every accepted event ends
// exactly once.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/eventmonitor/eventmonitor"
)

// requireBalanced checks the Stats identity: every event received is
// filtered, ignored, handled, dropped, forgotten, queued, in backoff or in
// flight.
func requireBalanced(t *testing.T, s eventmonitor.Stats) {
	t.Helper()
	rhs := s.Filtered + s.Ignored + s.Handled + s.Dropped + s.Forgotten +
		uint64(s.Queued) + uint64(s.EventsInBackoff) + uint64(s.InFlight)
	require.Equal(t, s.Received, rhs, "Stats identity broken: %+v", s)
}

// A mixed run: Submit, Backoff, WatchExit and a breaking stream (Run, with
// WithMaxQueuedPerKey and WithIntakeLimit), Forget at random, handlers that
// fail, panic, ignore the event or overrun ignoring ctx; then Shutdown with a
// short ctx while exits still arrive. Every sampled Stats balances, no key
// runs twice at once, each key's successes follow acceptance order, every
// accepted event ends exactly once (success, ignored, dropped or forgotten),
// Shutdown returns within its ctx plus a handle timeout, and no goroutine is
// left.
func TestShutdownAccountsForMixedTraffic(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	const timeout = 20 * time.Millisecond
	var (
		mu       sync.Mutex
		running  = map[string]int{}
		attempts = map[string]int{}
		outcome  = map[string][]string{} // id -> what happened to it
		lastOK   = map[string]int{}
		problems []string
		accepted = map[string]bool{}
	)
	note := func(id, what string) { mu.Lock(); outcome[id] = append(outcome[id], what); mu.Unlock() }
	parse := func(id string) (key string, seq int) {
		_, err := fmt.Sscanf(id, "%s %d", &key, &seq)
		if err != nil {
			panic(err)
		}
		return key, seq
	}
	handler := eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		id := e.(*wrapperspb.StringValue).GetValue()
		key, seq := parse(id)
		mu.Lock()
		running[key]++
		if running[key] > 1 {
			problems = append(problems, "two calls at once for "+key)
		}
		attempts[id]++
		a := attempts[id]
		mu.Unlock()
		defer func() { mu.Lock(); running[key]--; mu.Unlock() }()
		switch (seq*7 + a*3) % 11 {
		case 0:
			return errors.New("fail")
		case 1:
			panic("boom")
		case 2:
			note(id, "ignored")
			return fmt.Errorf("%w: not mine", eventmonitor.ErrUnsupportedEvent)
		case 3:
			if a == 1 {
				time.Sleep(3 * timeout) // overruns, ignoring ctx
				return errors.New("overran")
			}
		}
		mu.Lock()
		if seq <= lastOK[key] {
			problems = append(problems, fmt.Sprintf("%s handled after seq %d", id, lastOK[key]))
		}
		lastOK[key] = seq
		mu.Unlock()
		note(id, "ok")
		return nil
	})
	conv := eventmonitor.NewConverter(eventmonitor.KeyOf(func(v *wrapperspb.StringValue) string {
		k, _ := parse(v.GetValue())
		return k
	}))
	m, err := eventmonitor.New(handler, eventmonitor.WithConverter(conv), eventmonitor.WithWorkers(3),
		eventmonitor.WithHandleTimeout(timeout), eventmonitor.WithBackoff(time.Millisecond, 4*time.Millisecond),
		eventmonitor.WithMaxAttempts(4), eventmonitor.WithMaxQueuedPerKey(6), eventmonitor.WithIntakeLimit(3),
		eventmonitor.WithResubscribe(time.Millisecond, 2*time.Millisecond), eventmonitor.WithLogger(quietLogger()),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) {
			for _, e := range d.Events {
				note(e.(*wrapperspb.StringValue).GetValue(), "dropped:"+d.Reason.Error())
			}
		}))
	require.NoError(t, err)

	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-stopSampling:
				return
			default:
			}
			s := m.Stats()
			rhs := s.Filtered + s.Ignored + s.Handled + s.Dropped + s.Forgotten +
				uint64(s.Queued) + uint64(s.EventsInBackoff) + uint64(s.InFlight)
			if s.Received != rhs {
				mu.Lock()
				problems = append(problems, fmt.Sprintf("identity: %+v", s))
				mu.Unlock()
			}
		}
	}()

	// The stream: breaks every few envelopes.
	subs := make(chan chan *eventmonitor.Envelope, 1)
	sub := eventmonitor.SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		ch := make(chan *eventmonitor.Envelope)
		select {
		case subs <- ch:
		case <-ctx.Done():
			close(ch)
		}
		return ch, nil
	})
	runCtx, cancelRun := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() { _ = m.Run(runCtx, sub); close(runDone) }()
	streamDone := make(chan struct{})
	var streamed atomic.Int32
	go func() {
		defer close(streamDone)
		seq := 0
		for round := 0; round < 15; round++ {
			var ch chan *eventmonitor.Envelope
			select {
			case ch = <-subs:
			case <-runDone:
				return
			}
			for i := 0; i < 4; i++ {
				seq++
				id := fmt.Sprintf("s%d %d", seq%2, seq)
				a, _ := typeurl.MarshalAny(wrapperspb.String(id))
				select {
				case ch <- &eventmonitor.Envelope{Namespace: "ns", Topic: "/t", Event: a}:
					mu.Lock()
					accepted[id] = true // received: accepted or dropped
					mu.Unlock()
					streamed.Add(1)
				case <-runDone:
					return
				}
			}
			close(ch)
		}
	}()

	var wg sync.WaitGroup
	stopOps := make(chan struct{})
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprintf("k%d", g)
			for seq := 1; ; seq++ {
				select {
				case <-stopOps:
					return
				default:
				}
				id := fmt.Sprintf("%s %d", key, seq)
				ev := wrapperspb.String(id)
				switch seq % 5 {
				case 0:
					mu.Lock()
					accepted[id] = true // Backoff: accepted or dropped
					mu.Unlock()
					m.Backoff(key, ev)
				case 1:
					ch := make(chan exitStatus, 1)
					ch <- exitStatus{code: 1}
					built := false
					<-eventmonitor.WatchExit(context.Background(), m, key, (<-chan exitStatus)(ch), func(uint32, time.Time) any {
						built = true
						return ev
					})
					if built {
						mu.Lock()
						accepted[id] = true
						mu.Unlock()
					}
				case 2:
					if seq%15 != 2 {
						if m.Submit(key, ev) == nil {
							mu.Lock()
							accepted[id] = true
							mu.Unlock()
						}
						break
					}
					for _, e := range m.Forget(key) {
						note(e.(*wrapperspb.StringValue).GetValue(), "forgotten")
					}
					fallthrough
				default:
					if m.Submit(key, ev) == nil {
						mu.Lock()
						accepted[id] = true
						mu.Unlock()
					}
				}
				if seq%3 == 0 {
					time.Sleep(time.Millisecond) // pacing the producer
				}
			}
		}()
	}
	if !waitUntil(20*time.Second, func() bool { return streamed.Load() >= 20 && m.Stats().Received > 150 }) {
		t.Fatal("timed out waiting: traffic")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	_ = m.Shutdown(ctx)
	took := time.Since(start)
	close(stopOps)
	wg.Wait()
	cancelRun()
	<-runDone
	<-streamDone
	close(stopSampling)
	<-sampled
	require.Less(t, took, 30*time.Millisecond+timeout+time.Second, "Shutdown took %v", took)

	s := m.Stats()
	t.Logf("Shutdown took %v; %+v", took, s)
	requireBalanced(t, s)
	require.Zero(t, s.Queued+s.EventsInBackoff+s.InFlight)
	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, problems)
	for id := range accepted {
		if n := len(outcome[id]); n != 1 {
			t.Errorf("%s: outcomes %v", id, outcome[id])
		}
	}
	for id, o := range outcome {
		if !accepted[id] {
			t.Errorf("%s: not accepted, yet %v", id, o)
		}
	}
}

// Stop from several goroutines at once and, as documented, `go m.Stop()`
// from the drop handler (on every drop, including the ones Stop itself hands
// over), while calls overrun ignoring ctx and others fail into MaxAttempts:
// every Stop returns within about one handle timeout, every accepted event is
// handled or dropped exactly once, and no goroutine is left once the stuck
// handlers return.
func TestStopStormFromDropHandler(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	const timeout = 50 * time.Millisecond
	release := make(chan struct{})
	var stops sync.WaitGroup
	var mu sync.Mutex
	seen := map[seqEvent]int{}
	var m *eventmonitor.Monitor
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		ev := e.(seqEvent)
		switch ev.Seq % 3 {
		case 0:
			<-release // stuck, ignoring ctx
			return nil
		case 1:
			return errors.New("fails")
		}
		mu.Lock()
		seen[ev]++
		mu.Unlock()
		return nil
	}), eventmonitor.WithWorkers(4), eventmonitor.WithHandleTimeout(timeout), eventmonitor.WithMaxAttempts(2),
		eventmonitor.WithBackoff(time.Millisecond, time.Millisecond), eventmonitor.WithLogger(quietLogger()),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) {
			mu.Lock()
			for _, e := range d.Events {
				seen[e.(seqEvent)]++
			}
			mu.Unlock()
			stops.Add(1)
			go func() { defer stops.Done(); m.Stop() }()
		}))
	require.NoError(t, err)
	var accepted []seqEvent
	for i := 0; i < 40; i++ {
		e := seqEvent{fmt.Sprintf("k%d", i%8), i}
		if m.Submit(e.Key, e) == nil {
			accepted = append(accepted, e)
		}
	}
	start := time.Now()
	all := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < 5; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); m.Stop() }()
	}
	go func() { wg.Wait(); close(all) }()
	ok := closesWithin(all, timeout+2*time.Second)
	took := time.Since(start)
	stopsDone := make(chan struct{})
	go func() { stops.Wait(); close(stopsDone) }()
	okDrop := closesWithin(stopsDone, 5*time.Second)
	close(release)
	require.True(t, ok, "concurrent Stops did not return (%v)", took)
	require.True(t, okDrop, "Stops started by the drop handler did not return")
	s := m.Stats()
	requireBalanced(t, s)
	mu.Lock()
	defer mu.Unlock()
	for _, e := range accepted {
		require.Equal(t, 1, seen[e], "%v handled or dropped %d times", e, seen[e])
	}
}
