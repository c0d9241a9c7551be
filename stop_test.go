package eventmonitor

// Stop: what it hands over, what it abandons, and Stop racing everything else.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/anypb"
	testclock "k8s.io/utils/clock/testing"
)

func TestStopHandsOverWhatIsLeft(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	started, release := r.gate(ev{"a", 1})
	h.submit(t, ev{"a", 1})
	<-started
	h.submit(t, ev{"a", 2}, ev{"b", 1})
	h.m.Backoff("c", ev{"c", 1})

	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	waitFor(t, h.stopping, "Stop begins")
	require.ErrorIs(t, h.m.Submit("z", ev{"z", 1}), ErrStopped)
	select {
	case <-stopped:
		t.Fatal("Stop returned while a call was in flight")
	default:
	}
	release()
	<-stopped
	h.m.Stop() // idempotent

	assert.Equal(t, anys(ev{"a", 1}), r.handledList(), "the in-flight call completes")
	drops := h.drops.all()
	require.Len(t, drops, 3)
	for _, d := range drops {
		assert.ErrorIs(t, d.Reason, ErrStopped)
	}
	assert.Equal(t, Drop{Key: "a", Events: anys(ev{"a", 2}), Reason: ErrStopped}, drops[0])
	assert.Equal(t, Drop{Key: "b", Events: anys(ev{"b", 1}), Reason: ErrStopped}, drops[1])
	assert.Equal(t, Drop{Key: "c", Events: anys(ev{"c", 1}), Reason: ErrStopped}, drops[2])
	s := h.m.Stats()
	assert.Equal(t, s.Received, s.Handled+s.Dropped)
	assert.Zero(t, s.KeysInBackoff)
}

func TestStopCancelsCallsInFlight(t *testing.T) {
	got := make(chan error, 1)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		<-ctx.Done()
		got <- ctx.Err()
		return nil
	}))
	require.NoError(t, h.m.Submit("a", ev{"a", 1}))
	waitFor(t, func() bool { return h.m.Stats().InFlight == 1 }, "call starts")
	h.m.Stop()
	require.ErrorIs(t, <-got, context.Canceled)
}

func TestStopAbandonsACallThatIgnoresItsContext(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(10*time.Second))
	started, release := r.gate(ev{"a", 1})
	h.submit(t, ev{"a", 1})
	<-started

	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	waitFor(t, h.stopping, "Stop begins")
	h.clock.Step(10*time.Second + time.Second) // the deadline, then the grace of min(1 s, timeout/10)
	<-stopped

	drops := h.drops.all()
	require.Len(t, drops, 1)
	assert.Equal(t, "a", drops[0].Key)
	assert.Equal(t, anys(ev{"a", 1}), drops[0].Events)
	assert.ErrorIs(t, drops[0].Reason, ErrStopped)
	release() // the abandoned goroutine returns and exits; goleak checks it
	waitFor(t, func() bool { return len(r.handledList()) == 1 }, "handler returns")
	s := h.m.Stats()
	assert.Equal(t, uint64(0), s.Handled, "an abandoned call is not counted as handled")
	assert.Equal(t, Stats{Received: 1, Dropped: 1}, s)
}

// At Stop a key's queue goes out as one Drop per run of the same topic and
// namespace, in order.
func TestStopDropsRunsByOrigin(t *testing.T) {
	first := make(chan struct{})
	var once sync.Once
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		once.Do(func() { close(first) })
		<-ctx.Done() // the first call holds the key until Stop
		return ctx.Err()
	}), WithConverter(testConverter))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	sub := <-stream.newSub
	n := 0
	send := func(topic, ns string) {
		n++
		sub.send(t, &Envelope{Topic: topic, Namespace: ns, Event: payload(t, &jsonEvent{ID: "k", Code: n})})
		want := uint64(n)
		waitFor(t, func() bool { return h.m.Stats().Received == want }, "envelope %d accepted", n)
	}
	submit := func() {
		n++
		require.NoError(t, h.m.Submit("k", &jsonEvent{ID: "k", Code: n}))
	}
	send("/a", "ns") // 1: in flight
	<-first
	send("/a", "ns") // 2
	send("/a", "ns") // 3
	submit()         // 4
	send("/b", "ns") // 5
	send("/a", "ns") // 6
	send("", "")     // 7: an envelope with no topic or namespace
	submit()         // 8
	send("/a", "ns") // 9
	h.m.Stop()

	drops := h.drops.all()
	type group struct {
		topic, ns string
		codes     []int
	}
	var got []group
	for _, d := range drops {
		var codes []int
		for _, e := range d.Events {
			codes = append(codes, e.(*jsonEvent).Code)
		}
		assert.Equal(t, "k", d.Key)
		assert.ErrorIs(t, d.Reason, ErrStopped)
		got = append(got, group{d.Topic, d.Namespace, codes})
	}
	assert.Equal(t, []group{
		{"/a", "ns", []int{1}}, // failed while shutting down
		{"/a", "ns", []int{2, 3}},
		{"", "", []int{4}},
		{"/b", "ns", []int{5}},
		{"/a", "ns", []int{6}},
		{"", "", []int{7, 8}},
		{"/a", "ns", []int{9}},
	}, got)
	assertBalanced(t, h.m.Stats())
}

// Real clock, tiny timeouts: calls go late, overrun, are replaced and
// abandoned while events, backoffs and exits keep coming and Stop or
// Shutdown races them. Stop returns, everything is accounted for, no key
// runs twice, no goroutine of the monitor outlives Stop, no timer is set.
func TestStopRacesOverrunsAndRetriesOnTheRealClock(t *testing.T) {
	for i := 0; i < 40; i++ {
		stopRaceRun(t, uint64(i))
	}
	goleak.VerifyNone(t)
}

func stopRaceRun(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 11))
	var rmu sync.Mutex
	rnd := func(n int) int { rmu.Lock(); defer rmu.Unlock(); return rng.IntN(n) }
	stuck := make(chan struct{})
	var keys exclusive
	var emitted atomic.Int64
	m, err := New(HandlerFunc(func(ctx context.Context, e any) error {
		defer keys.enter(keyOf(e))()
		switch rnd(6) {
		case 0:
			return errors.New("fail")
		case 1:
			<-ctx.Done()
			return ctx.Err()
		case 2:
			<-stuck // ignores its ctx: overruns, is replaced, abandoned at Stop
		}
		return nil
	}), WithWorkers(1+int(seed%3)), WithHandleTimeout(time.Duration(1+seed%3)*time.Millisecond),
		WithMaxOverruns(int(seed%2)), WithBackoff(time.Millisecond, 4*time.Millisecond),
		WithDropHandler(func(d Drop) { emitted.Add(int64(max(1, len(d.Events)))) }), WithLogger(quietLogger()))
	require.NoError(t, err)
	var feeders sync.WaitGroup
	for f := 0; f < 3; f++ {
		feeders.Add(1)
		go func() {
			defer feeders.Done()
			for j := 0; j < 60; j++ {
				k := fmt.Sprintf("k%d", rnd(6))
				switch rnd(4) {
				case 0:
					m.Backoff(k, ev{k, j})
				case 1:
					ch := make(chan fakeExit, 1)
					ch <- fakeExit{}
					WatchExit(context.Background(), m, k, ch, func(uint32, time.Time) any { return ev{k, j} })
				default:
					_ = m.Submit(k, ev{k, j})
				}
			}
		}()
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		if seed%2 == 0 {
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rnd(5))*time.Millisecond)
			defer cancel()
			_ = m.Shutdown(ctx)
		} else {
			m.Stop()
		}
	}()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		close(stuck)
		t.Fatalf("seed %d: Stop/Shutdown hangs: %+v", seed, m.Stats())
	}
	feeders.Wait()
	close(stuck)
	require.False(t, keys.twice.Load(), "seed %d: a key on two goroutines", seed)
	s := m.Stats()
	assertBalanced(t, s)
	require.Zero(t, s.Queued+s.EventsInBackoff+s.InFlight, "seed %d: %+v", seed, s)
	require.Equal(t, s.Dropped, uint64(emitted.Load()), "seed %d: drops counted vs handed over", seed)
	m.mu.Lock()
	require.True(t, m.sched.at.IsZero(), "seed %d: timer set after Stop", seed)
	require.Empty(t, m.calls)
	m.mu.Unlock()
}

// countingLocker counts the times mu is taken through it: with cond.L set
// to it, one per wake-up of a waiter.
type countingLocker struct {
	sync.Locker
	n atomic.Int64
}

func (l *countingLocker) Lock() { l.n.Add(1); l.Locker.Lock() }

// Two Stops waiting for one running call sleep on cond: once, every pass of
// stop's loop signalled a change, waking the other Stop to do the same, and
// the two burned a CPU each until the call returned (for ever with no
// timeout and a stuck handler).
func TestConcurrentStopsDoNotSpin(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(0))
	counter := &countingLocker{Locker: &h.m.mu}
	h.m.cond.L = counter // before any goroutine waits on cond
	started, release := r.gate(ev{"a", 1})
	h.submit(t, ev{"a", 1})
	<-started
	var stops sync.WaitGroup
	for range 2 {
		stops.Add(1)
		go func() { defer stops.Done(); h.m.Stop() }()
	}
	waitFor(t, h.stopping, "Stop began")
	// Nothing changes while a/1 runs: a runaway shows within 300 ms.
	assert.Never(t, func() bool { return counter.n.Load() > 100 }, 300*time.Millisecond, 10*time.Millisecond,
		"two Stops waiting on one running call woke each other in a loop")
	release()
	stops.Wait()
}

// Stop waits for an envelope Run is converting when Stop begins: its drop
// reaches the drop handler before Stop returns, and Stats do not change
// after it.
func TestNoDropAfterStopReturns(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) {
		close(entered)
		<-release // a slow converter
		return "a", ev{"a", 1}, nil
	})
	var stopReturned atomic.Bool
	dropAfterStop := make(chan bool, 1)
	m, err := New(newRecorder(), WithConverter(conv), WithClock(testclock.NewFakeClock(epoch)),
		WithLogger(quietLogger()), WithDropHandler(func(Drop) { dropAfterStop <- stopReturned.Load() }))
	require.NoError(t, err)
	ch := make(chan *Envelope, 1)
	ch <- &Envelope{Topic: "/t", Event: &anypb.Any{TypeUrl: "x"}}
	runDone := make(chan error, 1)
	go func() {
		runDone <- m.Run(context.Background(), SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
			return ch, nil
		}))
	}()
	<-entered
	stopDone := make(chan struct{})
	go func() { m.Stop(); stopReturned.Store(true); close(stopDone) }()
	waitFor(t, stateIs(m, stopped), "Stop began")
	close(release)
	<-stopDone
	require.ErrorIs(t, <-runDone, ErrStopped)
	require.False(t, <-dropAfterStop, "the drop handler was called after Stop returned")
	s := m.Stats()
	require.Equal(t, [2]uint64{1, 1}, [2]uint64{s.Received, s.Dropped}, "the envelope in hand: received, then dropped")
}

// gatedClock is a fake clock whose Now, once armed, holds its next caller
// until released. Armed by a handler just before it returns, it holds the
// worker between the handler's return and the settling of its call, as the
// Go scheduler may (preemption, GC, a CPU-throttled container) for longer
// than a grace of min(1 s, timeout/10), or across the instant Shutdown's
// ctx ends.
type gatedClock struct {
	*testclock.FakeClock
	armed   atomic.Bool
	blocked chan struct{}
	release chan struct{}
}

func newGatedClock() *gatedClock {
	return &gatedClock{FakeClock: testclock.NewFakeClock(epoch), blocked: make(chan struct{}), release: make(chan struct{})}
}

func (c *gatedClock) Now() time.Time {
	if c.armed.CompareAndSwap(true, false) {
		close(c.blocked)
		<-c.release
	}
	return c.FakeClock.Now()
}

// returnedCallMonitor starts a call that has returned nil, its worker held
// before it takes the lock to settle it.
func returnedCallMonitor(t *testing.T) (*Monitor, *gatedClock, *dropLog) {
	t.Helper()
	clk := newGatedClock()
	drops := &dropLog{}
	m, err := New(HandlerFunc(func(ctx context.Context, e any) error {
		clk.armed.Store(true) // the worker's next clock read is after this return
		return nil
	}), WithClock(clk), WithMetrics(noopMetrics{}), WithDropHandler(drops.add), WithLogger(quietLogger()))
	require.NoError(t, err)
	require.NoError(t, m.Submit("a", ev{"a", 1}))
	select {
	case <-clk.blocked:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never returned")
	}
	return m, clk, drops
}

func stateIs(m *Monitor, s lifecycle) func() bool {
	return func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.state == s
	}
}

// Promise (Shutdown's doc): "If ctx ends first it stops at once, abandoning
// every call in progress (a returned call's report is still waited for)".
// A call whose handler returned nil before Shutdown began is not in
// progress: its event is handled, not dropped as "handler still running
// when Shutdown's ctx ended". Before the fix the call was abandoned: its
// event reached the drop handler with ErrStopped though the handler had
// handled it, and Stats counted it Dropped, not Handled (which also failed
// TestShutdownAccountsForMixedTraffic now and then).
func TestShutdownDoesNotAbandonAReturnedCall(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	m, clk, drops := returnedCallMonitor(t)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	stopSettlesTheReturnedCall(t, m, clk, drops, func() { _ = m.Shutdown(ctx) })
}

// Promise (Stop's doc and README "Stopping"): Stop abandons "a call still
// running when it overruns". A call whose handler returned nil well before
// its deadline is not running, and must not be marked overrunning by the
// scheduler nor dropped by Stop. Before the fix the scheduler marked it
// overran once the clock passed its deadline and grace, and Stop dropped
// its event with "handler overran its deadline, abandoned".
func TestStopDoesNotAbandonAReturnedCallAsOverrun(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	m, clk, drops := returnedCallMonitor(t)

	clk.Step(DefaultHandleTimeout + time.Second) // past the deadline and the grace
	waitFor(t, func() bool {                     // the scheduler's pass for that time has run
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.sched.at.IsZero()
	}, "the scheduler never looked at the call")
	stopSettlesTheReturnedCall(t, m, clk, drops, m.Stop)
}

// stopSettlesTheReturnedCall runs stop (Stop or Shutdown) on the monitor
// of returnedCallMonitor and, once it began (whatever it abandons, it
// abandons at once, under the lock), lets the worker settle: stop must
// then return with the event handled, not dropped.
func stopSettlesTheReturnedCall(t *testing.T, m *Monitor, clk *gatedClock, drops *dropLog, stop func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { stop(); close(done) }()
	waitFor(t, stateIs(m, stopped), "the stop never began")
	close(clk.release)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the stop did not return once the call settled")
	}
	require.Empty(t, drops.all(), "an event its handler handled was dropped")
	s := m.Stats()
	require.Equal(t, uint64(1), s.Handled, "%+v", s)
}

// lockProbeCtx is a caller's context whose Err notes whether it was called
// while its caller held the monitor's lock: the lock then stays taken for
// as long as Err waits for it (nothing holds it that long otherwise).
type lockProbeCtx struct {
	context.Context
	m         *Monitor
	underLock atomic.Bool
}

func (c *lockProbeCtx) Err() error {
	for deadline := time.Now().Add(200 * time.Millisecond); !c.m.mu.TryLock(); {
		if time.Now().After(deadline) {
			c.underLock.Store(true)
			return c.Context.Err()
		}
		runtime.Gosched()
	}
	c.m.mu.Unlock()
	return c.Context.Err()
}

// Promise (the package's own lock rule, kept for the handler's error, the
// converter's, the payload's type URL, the drop handler, Metrics and log
// hooks): no user code runs under Monitor.mu. A caller's ctx is user code:
// an Err that takes a lock of its own, logs through a hook or reads Stats
// deadlocks or inverts lock order. Before the fix WaitIdle, Shutdown and
// Stop's wait loop called ctx.Err() with mu held.
func TestCallersContextIsNotReadUnderTheLock(t *testing.T) {
	r := newRecorder()
	started, release := r.gate(ev{"a", 1})
	h := newHarness(t, r)
	h.submit(t, ev{"a", 1})
	<-started // a call runs: WaitIdle and Shutdown wait, looking at ctx

	ended, cancel := context.WithCancel(context.Background())
	cancel()
	ctx := &lockProbeCtx{Context: ended, m: h.m}
	require.ErrorIs(t, h.m.WaitIdle(ctx), context.Canceled)
	waitIdle := ctx.underLock.Load()

	ctx = &lockProbeCtx{Context: ended, m: h.m}
	done := make(chan error, 1)
	go func() { done <- h.m.Shutdown(ctx) }()
	require.ErrorIs(t, <-done, context.Canceled)
	release()
	require.False(t, waitIdle, "WaitIdle called its ctx's Err under the monitor's lock")
	require.False(t, ctx.underLock.Load(), "Shutdown called its ctx's Err under the monitor's lock")
}

// A WaitIdle waiting on an overrunning call returns ErrStopped when Stop
// abandons it with an event queued behind it, though by the time it wakes
// the stop may have emptied the monitor; a WaitIdle called
// after the stop finds it idle.
func TestWaitIdleAcrossAStopThatAbandonsWork(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Second))
	started, release := r.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1}, ev{"a", 2})
	<-started
	h.clock.Step(2 * time.Second)
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "the call overruns")
	idle := sleepingWaitIdle(t, h)
	h.m.Stop()
	require.ErrorIs(t, <-idle, ErrStopped)
	require.NoError(t, h.m.WaitIdle(context.Background()))
	require.Equal(t, uint64(2), h.m.Stats().Dropped)
}

// A replay due at the clock's now is work WaitIdle waits for: one asleep on
// it returns ErrStopped when a stop drops it before the scheduler's pass.
// A hook holds the scheduler in its overrun line meanwhile.
func TestWaitIdleAcrossAStopThatDropsADueReplay(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Second), WithBackoff(10*time.Second, time.Minute), WithWorkers(2))
	hook := newBlockHook(logrus.WarnLevel, "overran its timeout")
	h.m.cfg.logger.Logger.AddHook(hook)
	r.fail(ev{"b", 1}, 1)
	h.submit(t, ev{"b", 1})
	h.settled(t)
	due, _ := h.m.NextRetry()
	started, release := r.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1})
	<-started
	h.clock.Step(1100 * time.Millisecond) // a/1 overruns: the scheduler logs it
	awaitClosed(t, hook.blocked, "the scheduler's overrun line")
	unhook := sync.OnceFunc(func() { close(hook.release) })
	defer unhook()
	release()
	waitFor(t, func() bool { // a/1 is released (white-box: Stats counts a settling call out)
		h.m.mu.Lock()
		defer h.m.mu.Unlock()
		return len(h.m.calls) == 0
	}, "a/1 is released")
	h.clock.SetTime(due) // b's replay is due; the scheduler cannot look

	idle := sleepingWaitIdle(t, h)
	stopped := make(chan struct{})
	go func() { h.m.Stop(); close(stopped) }()
	require.ErrorIs(t, <-idle, ErrStopped)
	unhook()
	<-stopped
	reason, found := dropReason(h, ev{"b", 1})
	require.True(t, found)
	require.ErrorIs(t, reason, ErrStopped)
}

// sleepingWaitIdle calls WaitIdle in a goroutine, returning once it waits
// on cond.
func sleepingWaitIdle(t *testing.T, h *harness) <-chan error {
	before := goroutinesIn("sync.(*Cond).Wait", ").WaitIdle(")
	idle := make(chan error, 1)
	go func() { idle <- h.m.WaitIdle(context.Background()) }()
	waitFor(t, func() bool { return goroutinesIn("sync.(*Cond).Wait", ").WaitIdle(") == before+1 }, "WaitIdle waits")
	return idle
}

// Stop's abandon ends a stuck call's key while its handler runs on:
// nothing may call the key again, not an exit, a Submit, a Backoff, a
// Forget, nor a second Shutdown or Stop during the stop.
func TestAnAbandonedCallsKeyGetsNoSecondCall(t *testing.T) {
	var x exclusive
	stuck, entered := make(chan struct{}), make(chan struct{}, 1)
	var afterStop atomic.Bool
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		defer x.enter(keyOf(e))()
		if afterStop.Load() {
			t.Errorf("%v handled after Stop returned", e)
		}
		if asEv(e).Seq == 1 {
			entered <- struct{}{}
			<-stuck
		}
		return nil
	}), WithWorkers(2), WithHandleTimeout(time.Second))
	defer close(stuck)
	h.submit(t, ev{"a", 1}, ev{"a", 2})
	<-entered
	h.clock.Step(2 * time.Second)
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "the call overruns")
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			exit := make(chan fakeExit, 1)
			exit <- fakeExit{}
			<-WatchExit(context.Background(), h.m, "a", exit, func(uint32, time.Time) any { return ev{"a", 100} })
			_ = h.m.Submit("a", ev{"a", 101})
			h.m.Backoff("a", ev{"a", 102})
			h.m.Forget("a")
			ended, cancel := context.WithCancel(context.Background())
			cancel()
			_ = h.m.Shutdown(ended)
			h.m.Stop()
		}()
	}
	h.m.Stop()
	afterStop.Store(true)
	wg.Wait()
	require.False(t, x.twice.Load(), "key a on two goroutines")
	s := h.m.Stats()
	assertBalanced(t, s)
	require.Zero(t, s.Queued+s.KeysInBackoff+s.EventsInBackoff+s.InFlight+s.Overrunning, "%+v", s)
}

// WaitIdle returns ErrStopped at once while the monitor is stopping with
// work left, as its doc says: called while Stop waits for a handler that
// ignores its ctx (no handle timeout), it does not wait for that handler.
func TestWaitIdleWhileAStopWaitsReturnsErrStopped(t *testing.T) {
	r := newRecorder()
	started, release := r.gate(ev{"a", 1})
	h := newHarness(t, r, WithHandleTimeout(0))
	t.Cleanup(release) // before the harness's Stop, which waits for the handler
	h.submit(t, ev{"a", 1})
	<-started
	stopDone := make(chan struct{})
	go func() { h.m.Stop(); close(stopDone) }()
	waitFor(t, stateIs(h.m, stopped), "Stop began")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	require.ErrorIs(t, h.m.WaitIdle(ctx), ErrStopped)
	require.NoError(t, ctx.Err(), "WaitIdle waited for the handler Stop waits for")
	release()
	<-stopDone
}
