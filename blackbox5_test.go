package eventmonitor_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

// ---- helpers ---------------------------------------------------------------

type bb5Ev struct {
	Key string
	Seq int
}

func (e bb5Ev) String() string { return fmt.Sprintf("%s/%d", e.Key, e.Seq) }

// bb5Drops records every Drop.
type bb5Drops struct {
	mu    sync.Mutex
	drops []eventmonitor.Drop
}

func (d *bb5Drops) record(x eventmonitor.Drop) {
	d.mu.Lock()
	d.drops = append(d.drops, x)
	d.mu.Unlock()
}

func (d *bb5Drops) all() []eventmonitor.Drop {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]eventmonitor.Drop(nil), d.drops...)
}

// bb5Wait polls cond until it holds or the deadline passes.
func bb5Wait(t *testing.T, d time.Duration, cond func() bool, what string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: "+what, args...)
		}
		time.Sleep(time.Millisecond) // polling a condition, not letting things happen
	}
}

func bb5Within(ch <-chan struct{}, d time.Duration) bool {
	select {
	case <-ch:
		return true
	case <-time.After(d):
		return false
	}
}

func bb5Quiet() *log.Entry {
	l := logrus.New()
	l.SetOutput(io.Discard)
	return logrus.NewEntry(l)
}

func bb5CheckIdentity(t *testing.T, s eventmonitor.Stats) {
	t.Helper()
	rhs := s.Filtered + s.Ignored + s.Handled + s.Dropped + s.Forgotten +
		uint64(s.Queued) + uint64(s.EventsInBackoff) + uint64(s.InFlight)
	require.Equal(t, s.Received, rhs, "Stats identity broken: %+v", s)
}

// bb5Sub is a fake subscriber: every Subscribe hands out a fresh stream the
// test controls.
type bb5Stream struct {
	ch   chan *eventmonitor.Envelope
	errs chan error
}

type bb5Sub struct{ subs chan bb5Stream }

func newBB5Sub() *bb5Sub { return &bb5Sub{subs: make(chan bb5Stream, 16)} }

func (s *bb5Sub) Subscribe(ctx context.Context, _ ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
	st := bb5Stream{ch: make(chan *eventmonitor.Envelope), errs: make(chan error, 1)}
	s.subs <- st
	return st.ch, st.errs
}

func (s *bb5Sub) next(t *testing.T) bb5Stream {
	t.Helper()
	select {
	case st := <-s.subs:
		return st
	case <-time.After(10 * time.Second):
		t.Fatal("no subscription")
	}
	return bb5Stream{}
}

func bb5Env(t *testing.T, key string) *eventmonitor.Envelope {
	t.Helper()
	a, err := typeurl.MarshalAny(wrapperspb.String(key))
	require.NoError(t, err)
	return &eventmonitor.Envelope{Timestamp: time.Now(), Namespace: "ns", Topic: "/t", Event: a}
}

var bb5Conv = eventmonitor.NewConverter(eventmonitor.KeyOf(func(v *wrapperspb.StringValue) string {
	return v.GetValue()
}))

// ---- review 5: defects found and fixed --------------------------------------

// Review 5 (fixed): with a Stop already waiting on a call that ignores its
// ctx (Stop is safe for concurrent use), Shutdown skipped its ctx handling
// and called Stop, which waited for ever. Shutdown's wait now abandons
// every call once its ctx ends, whoever began the stop.
func TestBlackbox5ShutdownHonoursCtxWhileStopWaits(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	gate := make(chan struct{})
	started := make(chan struct{})
	var once sync.Once
	var drops bb5Drops
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		once.Do(func() { close(started) })
		<-gate // ignores ctx
		return nil
	}), eventmonitor.WithHandleTimeout(0), eventmonitor.WithLogger(bb5Quiet()),
		eventmonitor.WithDropHandler(drops.record))
	require.NoError(t, err)
	require.NoError(t, m.Submit("stuck", bb5Ev{"stuck", 1}))
	<-started

	stopDone := make(chan struct{})
	go func() { m.Stop(); close(stopDone) }()
	// WatchExit's channel closes once Stop began.
	never := make(chan eventmonitor.ExitStatus)
	<-eventmonitor.WatchExit(context.Background(), m, "w", (<-chan eventmonitor.ExitStatus)(never),
		func(uint32, time.Time) any { return bb5Ev{"w", 1} })

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	shutDone := make(chan struct{})
	var shutErr error
	go func() { shutErr = m.Shutdown(ctx); close(shutDone) }()
	returned := bb5Within(shutDone, 3*time.Second)
	close(gate)
	<-shutDone
	<-stopDone
	require.True(t, returned, "Shutdown with a 100ms ctx had not returned 3s later (a concurrent Stop waits for a stuck call)")
	require.ErrorIs(t, shutErr, context.DeadlineExceeded)
}

// Review 5 (fixed): a call Shutdown abandoned (ctx ended) after a worker
// took it but before the handler began (here: logging the replay's start)
// was still made afterwards, so its event was both dropped and handled. A
// call now checks, just before the handler, that it was not abandoned.
func TestBlackbox5AbandonedCallNeverInvokesHandler(t *testing.T) {
	before := goleak.IgnoreCurrent()
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	l := logrus.New()
	l.SetOutput(io.Discard)
	hook := &bb5BlockHook{msg: "retrying backed-off events", entered: make(chan struct{}), release: make(chan struct{})}
	l.AddHook(hook)
	var calls atomic.Int32
	var drops bb5Drops
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		calls.Add(1)
		return nil
	}), eventmonitor.WithClock(clk), eventmonitor.WithLogger(logrus.NewEntry(l)),
		eventmonitor.WithDropHandler(drops.record))
	require.NoError(t, err)
	e := bb5Ev{"a", 1}
	m.Backoff("a", e)
	clk.Step(time.Second) // the replay starts: a worker takes the call and logs its start
	select {
	case <-hook.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("replay never started")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err = m.Shutdown(ctx)
	require.ErrorIs(t, err, context.Canceled)
	d := drops.all()
	require.Len(t, d, 1)
	require.ErrorIs(t, d[0].Reason, eventmonitor.ErrStopped)
	require.Equal(t, []any{e}, d[0].Events)
	close(hook.release)
	// Wait until the worker goroutine is gone, then look at what it did.
	require.NoError(t, goleak.Find(before))
	require.Zero(t, calls.Load(), "handler called for an event Shutdown already dropped (after Shutdown returned)")
}

type bb5BlockHook struct {
	msg     string
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (h *bb5BlockHook) Levels() []logrus.Level { return logrus.AllLevels }
func (h *bb5BlockHook) Fire(e *logrus.Entry) error {
	if e.Message == h.msg {
		first := false
		h.once.Do(func() { first = true })
		if first {
			close(h.entered)
			<-h.release
		}
	}
	return nil
}

// Review 5 (fixed): after an outage, Run's new subscription established by
// its first envelope kept its resync delay's timer until the stream ended,
// so an idle monitor held a timer on its clock.
func TestBlackbox5ResyncTimerStoppedOnceEstablished(t *testing.T) {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	var resyncs atomic.Int32
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error { return nil }),
		eventmonitor.WithClock(clk), eventmonitor.WithConverter(bb5Conv), eventmonitor.WithLogger(bb5Quiet()),
		eventmonitor.WithResync(func(context.Context) error { resyncs.Add(1); return nil }))
	require.NoError(t, err)
	defer m.Stop()
	sub := newBB5Sub()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { _ = m.Run(ctx, sub); close(ran) }()
	defer func() { cancel(); <-ran }()

	first := sub.next(t)
	first.errs <- errors.New("daemon gone")
	bb5Wait(t, 10*time.Second, clk.HasWaiters, "Run's resubscribe delay")
	clk.Step(eventmonitor.DefaultResubscribeInitial)
	second := sub.next(t)
	second.ch <- bb5Env(t, "c1")
	bb5Wait(t, 10*time.Second, func() bool { return m.Stats().Handled == 1 && resyncs.Load() == 1 }, "handled and resynced")
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	require.NoError(t, m.WaitIdle(wctx))
	require.False(t, clk.HasWaiters(), "idle monitor, healthy stream: a timer is left on the clock (%+v)", m.Stats())
}

// Review 5 (fixed): a call Stop abandoned had its event dropped, yet when
// it returned later the monitor reported its duration and the event as
// Recovered, after Stop had returned. An abandoned call now reports
// nothing: Stop accounted for it.
func TestBlackbox5AbandonedCallReportsNoMetrics(t *testing.T) {
	before := goleak.IgnoreCurrent()
	gate := make(chan struct{})
	started := make(chan struct{})
	var n atomic.Int32
	var drops bb5Drops
	mt := &bb5Metrics{}
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		if n.Add(1) == 1 {
			return errors.New("first call fails")
		}
		close(started)
		<-gate // the replay ignores its ctx
		return nil
	}), eventmonitor.WithHandleTimeout(20*time.Millisecond), eventmonitor.WithBackoff(time.Millisecond, time.Millisecond),
		eventmonitor.WithLogger(bb5Quiet()), eventmonitor.WithDropHandler(drops.record), eventmonitor.WithMetrics(mt))
	require.NoError(t, err)
	require.NoError(t, m.Submit("a", bb5Ev{"a", 1}))
	<-started
	m.Stop() // abandons the replay once it overruns
	s := m.Stats()
	require.Equal(t, uint64(1), s.Dropped)
	require.Zero(t, s.Handled)
	close(gate)
	// goleak waits for the abandoned call's goroutine to leave.
	require.NoError(t, goleak.Find(before))
	require.Equal(t, int32(1), mt.done.Load(), "HandlerDone for the abandoned call, after Stop")
	require.Zero(t, mt.recovered.Load(), "an event dropped at Stop reported as Recovered")
}

type bb5Metrics struct {
	done, recovered, dropped atomic.Int32
}

func (b *bb5Metrics) HandlerDone(time.Duration, error) { b.done.Add(1) }
func (b *bb5Metrics) Recovered(time.Duration)          { b.recovered.Add(1) }
func (b *bb5Metrics) Dropped(error, int)               { b.dropped.Add(1) }

// Review 5 (fixed): an event given to Backoff while its key replayed was
// not part of the replay, and once the replay succeeded the key left
// backoff and the event was handled at once, with no delay, where Backoff
// on a key running any other call waits the initial delay. It now waits
// the initial delay too, once the replay is done.
func TestBlackbox5BackoffDuringReplayWaits(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clk := testclock.NewFakeClock(t0)
	gate := make(chan struct{})
	started := make(chan struct{})
	var mu sync.Mutex
	var calls []string
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		ev := e.(bb5Ev)
		mu.Lock()
		calls = append(calls, fmt.Sprintf("%v@%v", ev, clk.Now().Sub(t0)))
		n := len(calls)
		mu.Unlock()
		switch {
		case ev.Seq == 1 && n == 1:
			return errors.New("not yet")
		case ev.Seq == 1:
			close(started)
			<-gate
		}
		return nil
	}), eventmonitor.WithClock(clk), eventmonitor.WithLogger(bb5Quiet()))
	require.NoError(t, err)
	defer m.Stop()
	require.NoError(t, m.Submit("a", bb5Ev{"a", 1}))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, m.WaitIdle(ctx))
	clk.Step(time.Second) // the replay: a/1 runs and blocks
	<-started
	m.Backoff("a", bb5Ev{"a", 2}) // straight into a's backoff queue
	require.True(t, m.InBackoff("a"))
	close(gate)
	require.NoError(t, m.WaitIdle(ctx))
	mu.Lock()
	got := append([]string(nil), calls...)
	mu.Unlock()
	require.Equal(t, []string{"a/1@0s", "a/1@1s"}, got,
		"an event given to Backoff was handled without any backoff delay (Pending %+v)", m.Pending())
}

// bb5Exit is an ExitStatus.
type bb5Exit struct{ code uint32 }

func (e bb5Exit) Result() (uint32, time.Time, error) { return e.code, time.Time{}, nil }

// A mixed run: Submit, Backoff, WatchExit and a breaking stream (Run, with
// WithMaxQueuedPerKey and WithIntakeLimit), Forget at random, handlers that
// fail, panic, ignore the event or overrun ignoring ctx; then Shutdown with a
// short ctx while exits still arrive. Every sampled Stats balances, no key
// runs twice at once, each key's successes follow acceptance order, every
// accepted event ends exactly once (success, ignored, dropped or forgotten),
// Shutdown returns within its ctx plus a handle timeout, and no goroutine is
// left.
func TestBlackbox5MixedShutdownAccounting(t *testing.T) {
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
		eventmonitor.WithResubscribe(time.Millisecond, 2*time.Millisecond), eventmonitor.WithLogger(bb5Quiet()),
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
					ch := make(chan bb5Exit, 1)
					ch <- bb5Exit{code: 1}
					built := false
					<-eventmonitor.WatchExit(context.Background(), m, key, (<-chan bb5Exit)(ch), func(uint32, time.Time) any {
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
	bb5Wait(t, 20*time.Second, func() bool { return streamed.Load() >= 20 && m.Stats().Received > 150 }, "traffic")

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
	bb5CheckIdentity(t, s)
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
func TestBlackbox5StopStormFromDropHandler(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	const timeout = 50 * time.Millisecond
	release := make(chan struct{})
	var stops sync.WaitGroup
	var mu sync.Mutex
	seen := map[bb5Ev]int{}
	var m *eventmonitor.Monitor
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		ev := e.(bb5Ev)
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
		eventmonitor.WithBackoff(time.Millisecond, time.Millisecond), eventmonitor.WithLogger(bb5Quiet()),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) {
			mu.Lock()
			for _, e := range d.Events {
				seen[e.(bb5Ev)]++
			}
			mu.Unlock()
			stops.Add(1)
			go func() { defer stops.Done(); m.Stop() }()
		}))
	require.NoError(t, err)
	var accepted []bb5Ev
	for i := 0; i < 40; i++ {
		e := bb5Ev{fmt.Sprintf("k%d", i%8), i}
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
	ok := bb5Within(all, timeout+2*time.Second)
	took := time.Since(start)
	stopsDone := make(chan struct{})
	go func() { stops.Wait(); close(stopsDone) }()
	okDrop := bb5Within(stopsDone, 5*time.Second)
	close(release)
	require.True(t, ok, "concurrent Stops did not return (%v)", took)
	require.True(t, okDrop, "Stops started by the drop handler did not return")
	s := m.Stats()
	bb5CheckIdentity(t, s)
	mu.Lock()
	defer mu.Unlock()
	for _, e := range accepted {
		require.Equal(t, 1, seen[e], "%v handled or dropped %d times", e, seen[e])
	}
}
