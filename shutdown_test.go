package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestShutdownDrainsQueuesAndReplaysBackoffAtOnce(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithBackoff(time.Hour, time.Hour))
	started, release := r.gate(ev{"a", 1})
	h.submit(t, ev{"a", 1})
	<-started
	h.submit(t, ev{"a", 2}, ev{"b", 1})
	h.m.Backoff("c", ev{"c", 1}) // due in an hour: Shutdown must not wait for it
	r.fail(ev{"d", 1}, 100)
	h.m.Backoff("d", ev{"d", 1}) // fails again in the shutdown replay

	done := make(chan error)
	go func() { done <- h.m.Shutdown(context.Background()) }()
	waitFor(t, h.stopping, "Shutdown begins")
	require.ErrorIs(t, h.m.Submit("e", ev{"e", 1}), ErrStopped, "no intake once Shutdown begins")
	release()
	require.NoError(t, <-done)

	assert.ElementsMatch(t, anys(ev{"a", 1}, ev{"a", 2}, ev{"b", 1}, ev{"c", 1}), r.handledList())
	drops := h.drops.all()
	require.Len(t, drops, 1)
	assert.Equal(t, "d", drops[0].Key)
	assert.ErrorIs(t, drops[0].Reason, ErrStopped)
	assert.Equal(t, h.clock.Now(), epoch, "the replay ran at once, not when due")
}

// Shutdown ends WithDeferredStart's hold: it handles what the held monitor
// queued (a Submit, an exit), in order per key, and replays a backoff not
// yet due at once.
func TestShutdownDrainsAHeldMonitor(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithDeferredStart())
	h.submit(t, ev{"a", 1})
	exitCh := make(chan fakeExit, 1)
	exitCh <- fakeExit{code: 3, at: epoch}
	awaitClosed(t, WatchExit(context.Background(), h.m, "a", exitCh, exitOf("a")), "the watcher")
	h.m.Backoff("b", ev{"b", 1})
	h.settled(t)
	require.Zero(t, r.callCount(), "a held monitor handles nothing")

	require.NoError(t, h.m.Shutdown(context.Background()))
	assert.Equal(t, []any{ev{"a", 1}, exitEvent{"a", 3, epoch}}, r.handledOf("a"), "in the order accepted")
	assert.Equal(t, []any{ev{"b", 1}}, r.handledOf("b"))
	assert.Empty(t, h.drops.all())
	assertBalanced(t, h.m.Stats())
}

func TestShutdownDeadlineDropsTheRest(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(time.Minute))
	started, release := r.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1})
	<-started
	h.submit(t, ev{"a", 2})

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- h.m.Shutdown(ctx) }()
	waitFor(t, h.stopping, "Shutdown begins")
	cancel() // Shutdown gives up draining and Stops at once: a/1, ignoring its ctx, is abandoned
	err := <-done
	release() // only now: released as the stop begins, a/1 may return in time to be handled
	require.ErrorIs(t, err, context.Canceled)
	drops := h.drops.all()
	require.Len(t, drops, 2)
	assert.Equal(t, anys(ev{"a", 1}), drops[0].Events, "abandoned")
	assert.Equal(t, anys(ev{"a", 2}), drops[1].Events, "queued")
	for _, d := range drops {
		assert.ErrorIs(t, d.Reason, ErrStopped)
	}
}

// A Stop that begins while Shutdown drains cuts the drain short: what was
// left is dropped, and Shutdown says so rather than returning nil as if it
// had drained everything.
func TestShutdownReportsADrainCutByStop(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	r.onCall = func(ctx context.Context, e any) error {
		if e == (ev{"a", 1}) {
			<-ctx.Done() // held until Stop cancels it
			return ctx.Err()
		}
		return nil
	}
	h.submit(t, ev{"a", 1}, ev{"b", 1}) // b/1 waits for the one worker
	waitFor(t, func() bool { return r.callCount() == 1 }, "a/1 runs")
	done := make(chan error, 1)
	go func() { done <- h.m.Shutdown(context.Background()) }()
	waitFor(t, h.stopping, "Shutdown began")
	h.m.Stop()
	err := <-done
	require.ErrorIs(t, err, ErrStopped)
	require.ErrorContains(t, err, "cut short")
	drops := h.drops.all()
	require.Len(t, drops, 2, "a/1 failed while stopping, b/1 never ran")
	assert.Equal(t, anys(ev{"a", 1}), drops[0].Events)
	assert.Equal(t, anys(ev{"b", 1}), drops[1].Events)
	require.NoError(t, h.m.Shutdown(context.Background()), "a Shutdown after the stop has nothing of its own to report")
}

func TestShutdownAndStopAreSafeTogether(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithWorkers(2))
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 50 {
				err := h.m.Submit("k", ev{"k", i*100 + j})
				if err != nil {
					require.ErrorIs(t, err, ErrStopped)
				}
				h.m.Backoff("b", ev{"b", i*100 + j})
			}
			if i%2 == 0 {
				h.m.Stop()
			} else {
				_ = h.m.Shutdown(context.Background())
			}
		}()
	}
	wg.Wait()
	s := h.m.Stats()
	assert.Equal(t, s.Received, s.Handled+s.Dropped, "every accepted event handled or dropped")
	for _, d := range h.drops.all() {
		assert.True(t, errors.Is(d.Reason, ErrStopped), "reason %v", d.Reason)
	}
}

// A second Shutdown after one that drained everything returns nil: there is
// nothing it could report. It once returned ErrStopped, claiming a Stop had
// cut its drain short.
func TestShutdownAfterADrainedShutdownReturnsNil(t *testing.T) {
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
func TestShutdownDrainsABackoffGivenDuringAReplay(t *testing.T) {
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
	require.NoError(t, awaitErr(t, done), "a key waiting again after its replay")
	require.Equal(t, anys(ev{"a", 1}, ev{"a", 2}), r.handledList())
	require.Empty(t, h.drops.all())
}

// Promise (Shutdown's doc): Shutdown "stops, abandoning them [overrunning
// calls], and returns an error wrapping ErrStopped" that says how many it
// abandoned. Before the fix the count was taken before stop, whose
// abandon looks again: a stuck call whose handler returned in between is
// waited for and settles Handled, and Shutdown reported "abandoned 1
// handler calls" while it abandoned none and dropped nothing. A race: each
// round releases the stuck handler as Shutdown decides; the test fails if
// any round's error claims a drop that did not happen.
func TestShutdownCountsOnlyTheCallsItAbandons(t *testing.T) {
	for round := 0; round < 300; round++ {
		h, release := overrunningCall(t)
		go releaseAfter(release, round%50*20) // as Shutdown decides, a little later each round
		err := h.m.Shutdown(context.Background())
		s := h.m.Stats()
		if err != nil && s.Dropped == 0 {
			t.Fatalf("round %d: Shutdown said %q but dropped nothing: %+v", round, err, s)
		}
		h.m.Stop()
	}
}

// Promise (Shutdown's doc): overrunning calls do not hold Shutdown up: "it
// stops, abandoning them, and returns an error wrapping ErrStopped, as it
// does when a Stop begins before the drain is done". A Stop that takes
// the lock between Shutdown's decision (not drained, not cut) and
// Shutdown's stop abandons the stuck call itself: Shutdown's stop abandons
// none, and Shutdown returned nil (a regression of the fix counting only
// what its own stop abandoned) although an event was dropped.
//
// Each round: one stuck (overran) call; Shutdown begins; as soon as the
// state reads draining (set and decided in the same critical section, so
// Shutdown is then between its decision and its stop), Stop is called.
func TestShutdownReportsAStuckCallAConcurrentStopAbandoned(t *testing.T) {
	for round := 0; round < 1000; round++ {
		h, release := overrunningCall(t)

		stopDone := make(chan struct{})
		go func() {
			defer close(stopDone)
			for !stateIs(h.m, draining)() && !stateIs(h.m, stopped)() {
				runtime.Gosched()
			}
			h.m.Stop()
		}()
		err := h.m.Shutdown(context.Background())
		<-stopDone
		close(release)
		s := h.m.Stats()
		require.Equal(t, uint64(1), s.Dropped, "round %d: %+v", round, s)
		if err == nil {
			t.Fatalf("round %d: Shutdown began a drain, a stuck call was abandoned and its event dropped, "+
				"yet Shutdown returned nil: %+v", round, s)
		}
	}
}

// overrunningCall returns a monitor with one worker whose one call has
// overrun (its deadline and grace passed) until release is closed.
func overrunningCall(t *testing.T) (*harness, chan struct{}) {
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		started <- struct{}{}
		<-release
		return nil
	}), WithLogger(quietLogger()), WithWorkers(1))
	h.submit(t, ev{"a", 1})
	<-started
	h.clock.Step(DefaultHandleTimeout + time.Second) // past the deadline and the grace
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "the call never overran")
	return h, release
}

// stoppingStatus is an exit status whose Result is read until Stop begins:
// its exit is then refused and dropped, during Shutdown's stop.
type stoppingStatus struct{ stopping <-chan struct{} }

func (s stoppingStatus) Result() (uint32, time.Time, error) {
	<-s.stopping
	return 0, epoch, nil
}

// Promise (Shutdown's doc): Shutdown returns an ErrStopped error when it
// stopped with events of its drain left. Each round: one stuck (overran) call, released as Shutdown
// decides, and an exit being read that is refused once Stop begins (a drop
// that is not the drain's: the exit never reached a queue). When the stuck
// handler returns between Shutdown's decision and its stop's abandon, stop
// waits for it, it is Handled, nothing of the drain is lost, yet Shutdown
// reported "stopped before its drain was done" because Stats.Dropped grew
// (a fix for a concurrent Stop looked at it); in the other rounds the same
// drop left Shutdown nil: the result depended on a race, not on what was
// lost.
func TestShutdownErrsOnlyForWhatItsDrainLost(t *testing.T) {
	for round := 0; round < 300; round++ {
		h, release := overrunningCall(t)
		exits := make(chan stoppingStatus, 1)
		exits <- stoppingStatus{h.m.stopping}
		WatchExit(context.Background(), h.m, "x", exits, func(code uint32, _ time.Time) any { return ev{"x", int(code)} })
		go releaseAfter(release, round%50*20) // as Shutdown decides, a little later each round
		err := h.m.Shutdown(context.Background())
		s := h.m.Stats()
		if err != nil && s.Handled == 1 && errors.Is(err, ErrStopped) {
			for _, d := range h.drops.all() {
				require.Equal(t, "x", d.Key, "only the exit is dropped")
			}
			t.Fatalf("round %d: the stuck call was handled and nothing of the drain was lost, "+
				"yet Shutdown said %q (only a refused exit was dropped): %+v", round, err, s)
		}
	}
}

// releaseAfter closes release after yielding the processor spins times.
func releaseAfter(release chan struct{}, spins int) {
	for range spins {
		runtime.Gosched()
	}
	close(release)
}

// goroutinesIn counts the goroutines whose stack holds every one of frames.
func goroutinesIn(frames ...string) int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if !slices.ContainsFunc(frames, func(f string) bool { return !strings.Contains(g, f) }) {
			n++
		}
	}
	return n
}

// stuckOnA returns a harness with one worker whose handler ignores its ctx
// until release is called (at cleanup at the latest), with a/1 running.
func stuckOnA(t *testing.T, opts ...Option) (h *harness, release func()) {
	unblock := make(chan struct{})
	started := make(chan struct{}, 1)
	h = newHarness(t, HandlerFunc(func(context.Context, any) error {
		started <- struct{}{}
		<-unblock // ignores its ctx: overruns
		return nil
	}), append([]Option{WithLogger(quietLogger()), WithWorkers(1)}, opts...)...)
	var once sync.Once
	release = func() { once.Do(func() { close(unblock) }) }
	t.Cleanup(release) // before the harness's own, which checks for leaks
	h.submit(t, ev{"a", 1})
	<-started
	return h, release
}

// Two Shutdowns share a ctx, which ends before the drain could begin (the
// reader holds an envelope). The first to see it stops; the other finds
// that stop begun, so its drain was cut short by a stop that came first:
// ctx's error or ErrStopped, as its doc says, and never nil.
func TestShutdownsSharingACtxBothReportTheLoss(t *testing.T) {
	h, convert := readerInConverter(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errs := make(chan error, 2)
	for range 2 {
		go func() { errs <- h.m.Shutdown(ctx) }()
	}
	waitFor(t, func() bool { return goroutinesIn("(*Monitor).Shutdown", "sync.(*Cond).Wait") == 2 },
		"both Shutdowns wait for the reader")
	cancel()
	waitFor(t, stateIs(h.m, stopped), "a Shutdown saw ctx end and stopped")
	convert() // the envelope is refused and dropped: the stop can finish
	got := []error{awaitErr(t, errs), awaitErr(t, errs)}
	require.True(t, slices.ContainsFunc(got, func(err error) bool { return errors.Is(err, context.Canceled) }),
		"the Shutdown that stopped reports ctx's error: %v", got)
	for _, err := range got {
		if !errors.Is(err, context.Canceled) {
			require.ErrorIs(t, err, ErrStopped)
			require.ErrorContains(t, err, "cut short")
		}
	}
}

// blockingExit's Result blocks until release is closed; entered is closed
// when it is called.
type blockingExit struct{ entered, release chan struct{} }

func (b blockingExit) Result() (uint32, time.Time, error) {
	close(b.entered)
	<-b.release
	return 0, epoch, nil
}

// Shutdown's message counts the events its stop dropped, not those queued
// as it began: an owner may Forget them while the stop waits (here, for an
// exit being read).
func TestShutdownDoesNotReportAsDroppedAnEventForgottenDuringTheStop(t *testing.T) {
	h, _ := stuckOnA(t)
	h.submit(t, ev{"a", 2})
	exit := blockingExit{make(chan struct{}), make(chan struct{})}
	exitCh := make(chan blockingExit, 1)
	exitCh <- exit
	watched := WatchExit(context.Background(), h.m, "x", exitCh, exitOf("x"))
	<-exit.entered // the exit is being read: finishStop waits for it
	h.clock.Step(DefaultHandleTimeout + time.Second)
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "a/1 overruns: the drain can move no more")

	shut := make(chan error, 1)
	go func() { shut <- h.m.Shutdown(context.Background()) }()
	waitFor(t, func() bool { return h.stopping() && h.m.Stats().InFlight == 0 }, "the stop abandoned a/1")
	require.Equal(t, []any{ev{"a", 2}}, h.m.Forget("a"), "a/2 is the owner's again")
	close(exit.release)
	awaitClosed(t, watched, "the watcher")
	err := awaitErr(t, shut)

	require.ErrorIs(t, err, ErrStopped, "a/1 was abandoned")
	require.NotContains(t, err.Error(), "dropped", "a/2 was forgotten")
	for _, d := range h.drops.all() {
		require.NotContains(t, d.Events, any(ev{"a", 2}))
	}
	s := h.m.Stats()
	assertBalanced(t, s)
	require.Equal(t, uint64(1), s.Forgotten)
}

// Promise (Shutdown's doc and contract): Shutdown returns nil when a Stop
// had already begun before it was called: it drained nothing, so it has
// nothing of its own to report. Here Stop begins while a call that ignores
// its ctx runs in time; Shutdown is called, then the call overruns and the
// Stop abandons it. Before the fix Shutdown counted that abandoned call,
// though it was never its drain's, and returned ErrStopped.
func TestShutdownAfterStopReportsNothingOfItsOwn(t *testing.T) {
	h, _ := stuckOnA(t)

	stopDone := make(chan struct{})
	go func() { h.m.Stop(); close(stopDone) }()
	waitFor(t, stateIs(h.m, stopped), "Stop begins")

	done := make(chan error, 1)
	go func() { done <- h.m.Shutdown(context.Background()) }()
	// Shutdown is called after Stop began, and waits in its stop too.
	waitFor(t, func() bool {
		return goroutinesIn("eventmonitor.(*Monitor).Shutdown(") == 1 &&
			goroutinesIn("eventmonitor.(*Monitor).stop(") == 2
	}, "Shutdown waits in its stop")

	h.clock.Step(DefaultHandleTimeout + time.Minute) // the call overruns: Stop abandons it
	<-stopDone
	require.NoError(t, <-done, "a Stop had begun before Shutdown was called: nothing of its own to report")
}

// Promise (contract): Shutdown never errs when nothing of its drain was
// lost. Each round: a stuck (overran) a/1 with a/2 queued behind it, a/1
// released as Shutdown decides. When a/1 returns in the window between
// Shutdown's decision (left = 1) and its stop's lock, a/2 started, ignored
// the stop's cancel and was Handled: nothing was dropped, yet Shutdown
// said it "dropped 1 event". The stop now begins as Shutdown decides.
func TestShutdownErrsOnlyForEventsItDropped(t *testing.T) {
	for round := 0; round < 400; round++ {
		h, release := overrunningCall(t)
		h.submit(t, ev{"a", 2})
		go releaseAfter(release, round%40*10)
		err := h.m.Shutdown(context.Background())
		s := h.m.Stats()
		if err != nil && s.Handled == 2 && len(h.drops.all()) == 0 {
			t.Fatalf("round %d: both events handled, nothing dropped, yet Shutdown said %q: %+v", round, err, s)
		}
	}
}

// An envelope the stream reader took before Shutdown was called is queued
// and drained like the events before it, not dropped as intake ends.
func TestShutdownDrainsAnEnvelopeTakenBeforeIt(t *testing.T) {
	h, release := readerInConverter(t)
	shut := shutdownBegun(t, h, context.Background())
	release()
	require.NoError(t, <-shut)
	assert.Empty(t, h.drops.all())
	assert.EqualValues(t, 1, h.m.Stats().Handled)
}

// A reader waiting for intake room as Shutdown begins is woken by intake's
// end and queues its envelope, which Shutdown drains: no hang, nil,
// nothing dropped; for Start's reader and Run's.
func TestShutdownDrainsWhatAReaderWaitingForRoomHeld(t *testing.T) {
	for _, viaRun := range []bool{false, true} {
		for range 10 {
			release := make(chan struct{})
			h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error { <-release; return nil }),
				WithConverter(testConverter), WithIntakeLimit(1), WithWorkers(1))
			ch := make(chan *Envelope, 3)
			for _, k := range []string{"a", "b", "c"} {
				ch <- envelope(t, "ns", wrapperspb.String(k))
			}
			sub := SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil })
			if viaRun {
				go func() { _ = h.m.Run(context.Background(), sub) }()
			} else {
				h.m.Subscribe(sub)
				h.m.Start()
			}
			waitFor(t, func() bool {
				h.m.mu.Lock()
				defer h.m.mu.Unlock()
				return h.m.accepting == 1 && len(ch) == 0 && h.m.keys.Queued() == 1
			}, "the reader waits for room with c")
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			shut := shutdownBegun(t, h, ctx)
			close(release)
			require.NoError(t, <-shut)
			cancel()
			s := h.m.Stats()
			assert.EqualValues(t, 3, s.Handled, "%+v", s)
			assert.Empty(t, h.drops.all())
			assertBalanced(t, s)
		}
	}
}

// While Shutdown waits for an envelope the reader took (here in a slow
// converter) to be queued, intake has ended for everything else: Submit
// returns ErrStopped.
func TestShutdownRefusesSubmitWhileItWaitsForTheReader(t *testing.T) {
	h, release := readerInConverter(t)
	shut := shutdownBegun(t, h, context.Background())
	err := h.m.Submit("late", ev{"late", 1})
	release()
	require.NoError(t, <-shut)
	require.ErrorIs(t, err, ErrStopped, "Submit after Shutdown began (handled: %d)", h.m.Stats().Handled)
}

// While Shutdown waits for an envelope the reader took, a Backoff and an
// exit (no caller to refuse them to) are refused: each must be Received
// and Dropped with ErrStopped, reaching the drop handler; the identity holds.
func TestShutdownRefusesBackoffAndExitsWhileItWaitsForTheReader(t *testing.T) {
	h, release := readerInConverter(t)
	exitCh := make(chan fakeExit, 1)
	watched := WatchExit(context.Background(), h.m, "x", exitCh, func(code uint32, _ time.Time) any { return ev{"x", int(code)} })
	shut := shutdownBegun(t, h, context.Background())
	h.m.Backoff("b", ev{"b", 1})
	exitCh <- fakeExit{code: 7}
	<-watched
	h.m.mu.Lock()
	st := h.m.state
	h.m.mu.Unlock()
	require.Equal(t, running, st, "still waiting for the reader")
	release()
	require.NoError(t, <-shut)
	s := h.m.Stats()
	assertBalanced(t, s)
	assert.EqualValues(t, 3, s.Received, "%+v", s)
	assert.EqualValues(t, 2, s.Dropped, "%+v", s)
	assert.EqualValues(t, 1, s.Handled, "%+v", s)
	keys := map[string]bool{}
	for _, d := range h.drops.all() {
		assert.ErrorIs(t, d.Reason, ErrStopped)
		keys[d.Key] = true
	}
	assert.Equal(t, map[string]bool{"b": true, "x": true}, keys)
}

// Under a flood (the stream always has an envelope ready), Shutdown does
// not wait on the reader for ever: it sees intake end within a few
// envelopes, which the drain then handles; none is dropped, though the
// reader's select may take one more after intake ended.
func TestShutdownEndsUnderAFlood(t *testing.T) {
	for _, viaRun := range []bool{false, true} {
		for range 50 {
			h := newHarness(t, HandlerFunc(func(context.Context, any) error { return nil }),
				WithConverter(testConverter), WithLogger(quietLogger()))
			ch := make(chan *Envelope, 64)
			stopFeed, fed := make(chan struct{}), make(chan struct{})
			env := envelope(t, "ns", wrapperspb.String("k"))
			go func() {
				defer close(fed)
				for {
					select {
					case ch <- env:
					case <-stopFeed:
						return
					}
				}
			}()
			sub := SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil })
			ran := make(chan struct{})
			if viaRun {
				go func() { defer close(ran); _ = h.m.Run(context.Background(), sub) }()
			} else {
				close(ran)
				h.m.Subscribe(sub)
				h.m.Start()
			}
			waitFor(t, func() bool { return h.m.Stats().Received > 100 }, "flowing")
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err := h.m.Shutdown(ctx)
			cancel()
			close(stopFeed)
			<-fed
			<-ran
			require.NoError(t, err, "through Run: %v", viaRun)
			require.Empty(t, h.drops.all(), "through Run: %v: the reader took these after Shutdown began its drain", viaRun)
			assertBalanced(t, h.m.Stats())
		}
	}
}

// readerInConverter returns a monitor whose Start reader took one envelope
// (key "a") and is converting it, held until release is called.
func readerInConverter(t *testing.T) (h *harness, release func()) {
	entered, held := make(chan struct{}), make(chan struct{})
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) {
		close(entered)
		<-held
		return "a", ev{"a", 0}, nil
	})
	h = newHarness(t, newRecorder(), WithConverter(conv))
	ch := make(chan *Envelope, 1)
	ch <- &Envelope{Topic: "/tasks/exit", Event: payload(t, wrapperspb.String("a"))}
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil }))
	h.m.Start()
	<-entered
	return h, func() { close(held) }
}

// shutdownBegun calls Shutdown(ctx) in a goroutine and returns, once it
// ended intake, the channel its result comes on.
func shutdownBegun(t *testing.T, h *harness, ctx context.Context) <-chan error {
	shut := make(chan error, 1)
	go func() { shut <- h.m.Shutdown(ctx) }()
	waitFor(t, func() bool { return h.m.intake.Err() != nil }, "Shutdown ended intake")
	return shut
}

// awaitErr returns what ch (a Shutdown's or Run's result) delivers,
// failing the test if it takes 10 s.
func awaitErr(t *testing.T, ch <-chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("no result within 10 s: Shutdown or Run hung")
		return nil
	}
}

// Shutdown whose ctx has already ended stops at once: it starts no drain.
// The one event waits in backoff, not due; it is dropped with ErrStopped,
// never replayed nor handed to the handler (once, the drain began,
// replayed it at once, and the stop then abandoned the call, so the drop
// blamed a running handler, and the handler sometimes ran after).
func TestShutdownWithAnEndedCtxStartsNoCall(t *testing.T) {
	var calls atomic.Int32
	block := make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		calls.Add(1)
		<-block
		return nil
	}))
	defer close(block)
	h.m.Backoff("a", ev{"a", 1}) // due at epoch+1s; the clock never moves
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, h.m.Shutdown(ctx), context.Canceled)

	reason, ok := dropReason(h, ev{"a", 1})
	require.True(t, ok, "a/1 dropped")
	require.ErrorIs(t, reason, ErrStopped)
	s := h.m.Stats()
	assert.Zero(t, s.Retried, "a replay started after Shutdown's ctx had ended: %+v", s)
	assert.NotContains(t, reason.Error(), "still running",
		"a/1 was waiting in backoff when Shutdown was called, not in a handler")
	assert.Zero(t, calls.Load(), "handler called for an event dropped by a Shutdown whose ctx had ended")
}

// dropReason returns the reason e was dropped for, and whether it was.
func dropReason(h *harness, e any) (error, bool) {
	for _, d := range h.drops.all() {
		for _, x := range d.Events {
			if x == e {
				return d.Reason, true
			}
		}
	}
	return nil, false
}

// Shutdown with a ctx already ended, on a monitor with nothing to drain,
// lost nothing: it returns nil (it once returned ctx's error, after an
// ended ctx no longer started a drain).
func TestShutdownWithAnEndedCtxOnAnEmptyMonitorReturnsNil(t *testing.T) {
	h := newHarness(t, newRecorder())
	h.submit(t, ev{"a", 1})
	h.settled(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, h.m.Shutdown(ctx), "nothing was queued, running or in backoff: nothing was lost")
	require.Empty(t, h.drops.all())
}

// A call Stop withdraws before its handler began is never made, and its
// drop says so: here a replay's call waits in its retry log line (user
// code, before the call is made) when Shutdown's ctx has ended (the drop
// once said the handler was "still running").
func TestAWithdrawnCallsDropDoesNotBlameARunningHandler(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithBackoff(time.Second, time.Minute))
	hook := newBlockHook(logrus.InfoLevel, "retrying backed-off events")
	h.m.cfg.logger.Logger.AddHook(hook)
	defer close(hook.release)
	r.fail(ev{"a", 1}, 1)
	h.submit(t, ev{"a", 1})
	h.settled(t) // a/1 failed once: in backoff, due in a second
	require.Equal(t, 1, r.callCount())
	h.clock.Step(time.Second)
	<-hook.blocked // the replay's call was taken; its goroutine logs the retry

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, h.m.Shutdown(ctx), context.Canceled)
	reason, ok := dropReason(h, ev{"a", 1})
	require.True(t, ok, "a/1 dropped: %+v", h.drops.all())
	require.ErrorIs(t, reason, ErrStopped)
	assert.Equal(t, 1, r.callCount(), "the withdrawn call was made")
	assert.Contains(t, reason.Error(), "withdrawn before its handler began")
}

// A Stop begun while Shutdown waits for the reader drops what Shutdown was
// to drain: work queued (b/1, behind a/1 on the one worker), or only the
// envelope the reader holds. Shutdown reports that Stop, wrapping
// ErrStopped (it once returned nil, deciding whether a Stop had begun
// only after its wait, and then not counting the envelope).
func TestShutdownReportsAStopBegunWhileItWaitedForTheReader(t *testing.T) {
	for _, queued := range []bool{true, false} {
		t.Run(fmt.Sprint("queued=", queued), func(t *testing.T) {
			h, convert := readerInConverter(t) // the reader holds a/0: Shutdown waits for it
			lost, release := ev{"a", 0}, func() {}
			if queued {
				var started <-chan struct{}
				started, release = h.m.handler.(*recorder).gate(ev{"a", 1})
				defer release()
				h.submit(t, ev{"a", 1}, ev{"b", 1})
				<-started
				lost = ev{"b", 1}
			}
			shut := shutdownBegun(t, h, context.Background())
			stopped := make(chan struct{})
			go func() { defer close(stopped); h.m.Stop() }()
			waitFor(t, h.stopping, "Stop began")
			release() // a/1 returns: Stop's wait for calls ends
			convert() // a/0 is refused: Stop and Shutdown go on
			<-stopped
			err := <-shut

			reason, ok := dropReason(h, lost)
			require.True(t, ok, "%v was dropped by the Stop: %+v", lost, h.drops.all())
			require.ErrorIs(t, reason, ErrStopped)
			require.ErrorIs(t, err, ErrStopped, "Shutdown's drain never ran and %v was dropped, yet it returned %v", lost, err)
			assertBalanced(t, h.m.Stats())
		})
	}
}

// A Shutdown after a Stop (or a Shutdown) has ended loses nothing, and
// returns nil even with a ctx already ended (it once returned ctx's
// error, the ended ctx alone deciding).
func TestShutdownWithAnEndedCtxAfterAStopReturnsNil(t *testing.T) {
	for _, first := range []string{"Stop", "Shutdown"} {
		t.Run("after"+first, func(t *testing.T) { shutdownWithAnEndedCtxAfter(t, first) })
	}
}

func shutdownWithAnEndedCtxAfter(t *testing.T, first string) {
	h := newHarness(t, newRecorder())
	h.submit(t, ev{"a", 1})
	h.settled(t)
	if first == "Stop" {
		h.m.Stop()
	} else {
		require.NoError(t, h.m.Shutdown(context.Background()))
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	err := h.m.Shutdown(ended)
	require.Empty(t, h.drops.all())
	require.EqualValues(t, 1, h.m.Stats().Handled)
	require.NoError(t, err, "a %s had already begun (and ended): this Shutdown lost nothing, yet it returned %v", first, err)
}

// Shutdown's error names all its drain lost: with WithMaxOverruns(0) and
// one worker, a stuck a/1 keeps its worker from b/1, and the drain both
// abandons a/1 and drops b/1 (the error once named only a/1).
func TestShutdownErrorNamesTheEventsStuckCallsKeptFromTheWorkers(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	started := make(chan struct{}, 1)
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if e == (ev{"a", 1}) {
			started <- struct{}{}
			<-release // ignores its ctx
		}
		return nil
	}), WithLogger(quietLogger()), WithWorkers(1), WithMaxOverruns(0))
	h.submit(t, ev{"a", 1})
	<-started
	h.submit(t, ev{"b", 1}) // waits for the one worker, which a/1 keeps
	h.clock.Step(DefaultHandleTimeout + time.Second)
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "a/1 overruns")

	err := h.m.Shutdown(context.Background())
	require.ErrorIs(t, err, ErrStopped)
	_, aDropped := dropReason(h, ev{"a", 1})
	_, bDropped := dropReason(h, ev{"b", 1})
	require.True(t, aDropped && bDropped, "a/1 abandoned, b/1 dropped: %+v", h.drops.all())
	require.Contains(t, err.Error(), "dropped 1 event",
		"the drain lost b/1 (kept from the worker by stuck a/1) as well as a/1, but the error says only %q", err)
}

// Shutdown's result, case by case, from what its drain left and what its
// stop abandoned (drainOutcome.err). ctx's error only where ctx's end cost
// something: a Stop that found the drain done, ctx ended meanwhile, and a
// call that returned but was still being reported as ctx ended (ctx
// ending only after the drain), are nil or ErrStopped.
func TestShutdownResultFollowsWhatItsDrainLost(t *testing.T) {
	live := context.Background()
	ended, cancel := context.WithCancel(live)
	cancel()
	for _, tc := range []struct {
		name string
		o    drainOutcome
		ctx  context.Context
		want error // nil, context.Canceled or ErrStopped
	}{
		{"drained", drainOutcome{}, live, nil},
		{"drained; or a Stop found it done; ctx ended after", drainOutcome{}, ended, nil},
		{"drained but for a call being reported as ctx ended", drainOutcome{ended: true}, ended, nil},
		{"calls abandoned as ctx ended", drainOutcome{ended: true, byCtx: 1, gaveUp: 1}, ended, context.Canceled},
		{"events left as ctx ended", drainOutcome{atStop: atStop{left: 2}, ended: true}, ended, context.Canceled},
		{"reader still reading as ctx ended", drainOutcome{atStop: atStop{reading: true}, ended: true}, ended, context.Canceled},
		{"cut by a Stop", drainOutcome{atStop: atStop{cut: true, left: 1}}, live, ErrStopped},
		{"cut by a Stop with only a call being reported left", drainOutcome{atStop: atStop{cut: true}}, live, nil},
		{"cut by a Stop with a handler running", drainOutcome{atStop: atStop{cut: true, running: 1}}, live, ErrStopped},
		{"handlers running as ctx ended", drainOutcome{atStop: atStop{running: 1}, ended: true}, ended, context.Canceled},
		{"stuck calls abandoned and their key's events dropped", drainOutcome{atStop: atStop{left: 1, dropped: 1}}, live, ErrStopped},
		{"events held back, forgotten during the stop", drainOutcome{atStop: atStop{left: 1}}, live, nil},
		{"stuck call abandoned, ctx ended after the drain", drainOutcome{gaveUp: 1}, ended, ErrStopped},
		{"a Stop had begun before", drainOutcome{atStop: atStop{left: 3}, stoppedFirst: true, gaveUp: 1}, live, nil},
		{"a Stop had begun before and had ended, ctx ended", drainOutcome{stoppedFirst: true}, ended, nil},
		{"a Stop had begun before, calls abandoned as ctx ended", drainOutcome{stoppedFirst: true, byCtx: 1, gaveUp: 1}, ended, context.Canceled},
	} {
		err := tc.o.err(tc.ctx)
		if tc.want == nil {
			assert.NoError(t, err, tc.name)
		} else {
			assert.ErrorIs(t, err, tc.want, tc.name)
		}
	}
	err := drainOutcome{atStop: atStop{left: 1, dropped: 1}, gaveUp: 1}.err(live)
	assert.ErrorContains(t, err, "abandoned 1 handler call")
	assert.ErrorContains(t, err, "dropped 1 event that stuck calls held back")
}

// Two Shutdowns wait for one drain, which a stuck call ends; no Stop is
// called. Both report the abandoned call, and neither a cut (the second
// once read the first's own stop as a Stop that cut its drain short).
func TestConcurrentShutdownsReportTheSameLoss(t *testing.T) {
	h, _ := stuckOnA(t)
	errs := make(chan error, 2)
	for range 2 {
		go func() { errs <- h.m.Shutdown(context.Background()) }()
	}
	// Both wait in the drain loop for a/1, which has not overrun yet.
	waitFor(t, func() bool {
		return goroutinesIn("(*Monitor).Shutdown", "sync.(*Cond).Wait") == 2
	}, "both Shutdowns wait for the drain")
	h.clock.Step(DefaultHandleTimeout + time.Second) // a/1 overruns: the drain can move no more
	got := []error{awaitErr(t, errs), awaitErr(t, errs)}
	for _, err := range got {
		require.ErrorIs(t, err, ErrStopped)
		require.ErrorContains(t, err, "abandoned 1 handler call")
		require.NotContains(t, err.Error(), "cut short",
			"no Stop was called: the drain was not cut short, it ended on a stuck call (errors: %v)", got)
	}
}

// blockingMetrics blocks HandlerDone until release is closed.
type blockingMetrics struct {
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (b *blockingMetrics) HandlerDone(time.Duration, error) {
	b.once.Do(func() { close(b.entered) })
	<-b.release
}
func (b *blockingMetrics) Recovered(time.Duration) {}
func (b *blockingMetrics) Dropped(error, int)      {}

// Shutdown's ctx ends while its one call, whose handler returned nil, is
// still being reported (Metrics; a log hook does the same). Nothing was
// lost, so Shutdown returns nil (it once returned ctx's error, counting
// calls being settled as in progress).
func TestShutdownWhoseCtxEndsAsACallIsReportedLosesNothing(t *testing.T) {
	bm := &blockingMetrics{entered: make(chan struct{}), release: make(chan struct{})}
	r := newRecorder()
	h := newHarness(t, r, WithMetrics(bm))
	h.submit(t, ev{"a", 1})
	<-bm.entered // a/1 returned nil; its report is under way
	require.Equal(t, 0, h.m.Stats().InFlight, "Stats: no call in flight")
	ctx, cancel := context.WithCancel(context.Background())
	shut := shutdownBegun(t, h, ctx)
	waitFor(t, func() bool { return goroutinesIn("(*Monitor).Shutdown", "sync.(*Cond).Wait") == 1 }, "Shutdown waits")
	cancel()
	waitFor(t, stateIs(h.m, stopped), "Shutdown sees ctx end and stops, waiting for a/1's report")
	close(bm.release)
	err := awaitErr(t, shut)
	require.Equal(t, anys(ev{"a", 1}), r.handledList())
	require.Empty(t, h.drops.all())
	require.Equal(t, uint64(1), h.m.Stats().Handled)
	t.Logf("Shutdown: %v; %+v", err, h.m.Stats())
	require.NoError(t, err, "Shutdown lost nothing: a/1 was handled, nothing dropped or abandoned")
}

// The drain ends on a stuck call with ctx live; the stop abandons it as
// overrun, and ctx ends only after that, as the drop handler gets the
// abandoned event. Shutdown reports the abandoned call with ErrStopped
// (it once returned ctx's error, read as Shutdown returned rather than as
// the drain ended).
func TestShutdownWhoseCtxEndsAfterTheDrainReportsWhatTheDrainLost(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h, _ := stuckOnA(t)
	var drops dropLog
	h.m.cfg.onDrop = func(d Drop) { drops.add(d); cancel() } // ctx ends after the drain, during the stop
	h.clock.Step(DefaultHandleTimeout + time.Second)         // a/1 overruns before Shutdown: the drain can move no more
	waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "a/1 overruns")
	err := h.m.Shutdown(ctx)
	require.Len(t, drops.all(), 1, "a/1 abandoned and dropped")
	require.ErrorIs(t, err, ErrStopped, "ctx was live when the drain ended and the call was abandoned; got %v", err)
}

// A Stop cuts the drain while Shutdown waits for the stream reader; ctx
// ends only afterwards, costing nothing. Shutdown reports the cut
// (ErrStopped), as when ctx never ends (it once returned ctx's error,
// reading its ctx when it woke, not as the stop began, and waited for the
// reader after the Stop).
func TestShutdownCutByAStopReportsTheCutWhenCtxEndsAfter(t *testing.T) {
	for _, ctxEnds := range []bool{false, true} {
		t.Run(map[bool]string{false: "ctxLive", true: "ctxEndsAfterTheStop"}[ctxEnds], func(t *testing.T) {
			h, convert := readerInConverter(t) // the reader holds a/0: Shutdown waits for it
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			shut := shutdownBegun(t, h, ctx)
			stopDone := make(chan struct{})
			go func() { defer close(stopDone); h.m.Stop() }()
			waitFor(t, stateIs(h.m, stopped), "Stop began, cutting the drain before it began")
			if ctxEnds {
				cancel() // after the cut: Shutdown's derived ctx has ended once this returns
			}
			convert() // a/0 is refused: the Stop drops it
			<-stopDone
			err := awaitErr(t, shut)

			reason, ok := dropReason(h, ev{"a", 0})
			require.True(t, ok, "a/0 dropped by the Stop: %+v", h.drops.all())
			require.ErrorIs(t, reason, ErrStopped)
			require.NotErrorIs(t, err, context.Canceled,
				"ctx ended only after the Stop had cut the drain and abandoned nothing; got %v", err)
			require.ErrorIs(t, err, ErrStopped, "the Stop cut the drain short")
		})
	}
}

// Two Shutdowns wait for one drain, which a/1 ends by overrunning. The
// first to wake stops with its ctx live; only then does the second's ctx
// end, costing nothing. Both report the abandoned call (the second once
// returned ctx's error in about 3 rounds in 10, whenever it had not woken
// before its ctx ended).
func TestSecondShutdownWhoseCtxEndsAfterAnotherStoppedReportsWhatTheDrainLost(t *testing.T) {
	canceled := 0
	const rounds = 20
	for round := 0; round < rounds; round++ {
		h, release := stuckOnA(t)
		errs := make(chan error, 2)
		ctx, cancel := context.WithCancel(context.Background())
		for _, c := range []context.Context{context.Background(), ctx} {
			go func() { errs <- h.m.Shutdown(c) }()
		}
		waitFor(t, func() bool { return goroutinesIn("(*Monitor).Shutdown", "sync.(*Cond).Wait") == 2 }, "both Shutdowns wait for the drain")
		h.clock.Step(DefaultHandleTimeout + time.Second) // a/1 overruns: the drain is done
		<-h.m.stopping                                   // a Shutdown, its ctx live, began the stop
		cancel()                                         // the second's ctx ends only now
		for range 2 {
			if err := awaitErr(t, errs); errors.Is(err, context.Canceled) {
				canceled++
			} else {
				require.ErrorIs(t, err, ErrStopped, "round %d", round)
				require.ErrorContains(t, err, "abandoned 1 handler call", "round %d", round)
			}
		}
		release()
	}
	require.Zero(t, canceled, "in %d of %d rounds a Shutdown whose ctx ended after the drain was done "+
		"(the stop had begun, with its ctx live) returned ctx's error", canceled, rounds)
}

// A Stop, or ctx's end, that takes the lock after the pass that left a
// Shutdown's drain unable to move, but before the Shutdown has it again,
// cuts nothing short: Shutdown reports what the drain lost, as when it
// stops first, not a cut nor ctx's error; the stuck call is abandoned as
// it overran either way. The
// test holds mu across the pass and the stop's first step or ctx's end,
// the interleavings the race allows.
func TestAStopOrCtxEndAfterTheDrainIsDoneCutsNothing(t *testing.T) {
	for _, tc := range []struct {
		name      string
		heldBack  bool // b/1 waits for the one worker, which a/1 keeps
		stopFirst bool // a Stop takes mu in the same window
	}{{"an event held back", true, false}, {"only the stuck call", false, false}, {"a Stop first", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			opts := []Option{}
			if tc.heldBack {
				opts = append(opts, WithMaxOverruns(0))
			}
			h, _ := stuckOnA(t, opts...)
			if tc.heldBack {
				h.submit(t, ev{"b", 1})
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			errs := make(chan error, 1)
			go func() { errs <- h.m.Shutdown(ctx) }()
			waitFor(t, func() bool {
				return goroutinesIn("(*Monitor).Shutdown", "sync.(*Cond).Wait") == 1
			}, "Shutdown waits for the drain")
			h.m.mu.Lock()
			h.m.expire(h.clock.Now().Add(DefaultHandleTimeout + time.Second)) // the pass: a/1 overruns
			h.m.reconcile()
			require.False(t, h.m.drainable(), "the drain can move no more")
			cancel()
			if tc.stopFirst {
				h.m.beginStop(h.m.cutsDrain()) // as Stop does
			}
			h.m.mu.Unlock()
			if tc.stopFirst {
				h.m.Stop()
			}
			err := awaitErr(t, errs)
			assertBalanced(t, h.m.Stats())
			require.NotErrorIs(t, err, context.Canceled, "ctx ended after the drain was done")
			require.ErrorIs(t, err, ErrStopped)
			assert.ErrorContains(t, err, "abandoned 1 handler call")
			assert.NotContains(t, err.Error(), "cut short")
		})
	}
}

// A Stop while a returned call is being reported, beside a stuck call,
// cuts nothing short: it waits for the report, and nothing else is
// queued. The stuck call does not count as work the drain had left, as it
// does not hold up the drain either.
func TestAStopDuringAReportBesideAStuckCallCutsNothing(t *testing.T) {
	for _, withStop := range []bool{false, true} {
		t.Run(fmt.Sprint("Stop:", withStop), func(t *testing.T) {
			bm := &blockingMetrics{entered: make(chan struct{}), release: make(chan struct{})}
			unblock, started := make(chan struct{}), make(chan struct{})
			h := newHarness(t, HandlerFunc(func(_ context.Context, e any) error {
				if e == (ev{"a", 1}) {
					close(started)
					<-unblock // ignores its ctx: overruns
				}
				return nil
			}), WithLogger(quietLogger()), WithWorkers(1), WithMetrics(bm))
			t.Cleanup(func() { close(unblock) }) // before the harness's own, which checks for leaks
			var once sync.Once
			releaseReport := func() { once.Do(func() { close(bm.release) }) }
			defer releaseReport()
			h.submit(t, ev{"a", 1})
			<-started
			h.clock.Step(DefaultHandleTimeout + time.Second)
			waitFor(t, func() bool { return h.m.Stats().Overrunning == 1 }, "a/1 overruns, its slot given away")
			h.submit(t, ev{"b", 1})
			<-bm.entered // b/1 returned nil; its report is under way

			shut := shutdownBegun(t, h, context.Background())
			waitFor(t, func() bool {
				return goroutinesIn("(*Monitor).Shutdown", "sync.(*Cond).Wait") == 1
			}, "Shutdown waits for b/1's report")
			stopDone := make(chan struct{})
			if withStop {
				go func() { defer close(stopDone); h.m.Stop() }()
				waitFor(t, stateIs(h.m, stopped), "the Stop began during b/1's report")
			} else {
				close(stopDone)
			}
			releaseReport()
			err := awaitErr(t, shut)
			<-stopDone
			assertBalanced(t, h.m.Stats())
			require.EqualValues(t, 1, h.m.Stats().Handled, "b/1 handled either way")
			require.ErrorIs(t, err, ErrStopped)
			require.ErrorContains(t, err, "abandoned 1 handler call")
			require.NotContains(t, err.Error(), "cut short", "the Stop waited for b/1's report")
		})
	}
}
