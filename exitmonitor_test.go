package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

type fakeExit struct {
	code uint32
	at   time.Time
	err  error
}

func (e fakeExit) Result() (uint32, time.Time, error) { return e.code, e.at, e.err }

type exitEvent struct {
	Key  string
	Code uint32
	At   time.Time
}

func exitOf(key string) func(uint32, time.Time) any {
	return func(code uint32, at time.Time) any { return exitEvent{key, code, at} }
}

func TestWatchExitHandlesTheExit(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	exitCh := make(chan fakeExit, 1)
	done := WatchExit(context.Background(), h.m, "c1", exitCh, exitOf("c1"))
	at := epoch.Add(-time.Minute)
	exitCh <- fakeExit{code: 137, at: at}
	<-done
	assert.Equal(t, anys(exitEvent{"c1", 137, at}), r.handledList(), "handled before done closes, on the watcher's goroutine")
}

func TestWatchExitUnknownStatus(t *testing.T) {
	for name, send := range map[string]func(chan fakeExit){
		"Result error":   func(c chan fakeExit) { c <- fakeExit{code: 1, err: errors.New("no status")} },
		"channel closed": func(c chan fakeExit) { close(c) },
	} {
		t.Run(name, func(t *testing.T) {
			r := newRecorder()
			h := newHarness(t, r)
			h.clock.Step(time.Hour)
			exitCh := make(chan fakeExit, 1)
			done := WatchExit(context.Background(), h.m, "c1", exitCh, exitOf("c1"))
			send(exitCh)
			<-done
			assert.Equal(t, anys(exitEvent{"c1", UnknownExitCode, epoch.Add(time.Hour)}), r.handledList())
		})
	}
}

func TestWatchExitFailureGoesToBackoff(t *testing.T) {
	r := newRecorder()
	r.onCall = func(ctx context.Context, e any) error { return errors.New("shim busy") }
	h := newHarness(t, r)
	exitCh := make(chan fakeExit, 1)
	exitCh <- fakeExit{code: 0, at: epoch}
	<-WatchExit(context.Background(), h.m, "c1", exitCh, exitOf("c1"))
	require.True(t, h.m.InBackoff("c1"))
	assert.Equal(t, anys(exitEvent{"c1", 0, epoch}), h.pending("c1").Events)
}

func TestWatchExitCancelled(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	ctx, cancel := context.WithCancel(context.Background())
	exitCh := make(chan fakeExit, 1)
	done := WatchExit(ctx, h.m, "c1", exitCh, exitOf("c1"))
	cancel()
	<-done
	exitCh <- fakeExit{code: 1}
	assert.Zero(t, r.callCount(), "a cancelled watch handles nothing")
	assert.Zero(t, h.m.Stats().Received)
}

// An ended ctx wins over an exit already waiting: the watcher's select
// would pick between them at random.
func TestWatchExitWithAnEndedCtxHandlesNoExit(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for i := range 64 {
		key := fmt.Sprintf("c%d", i)
		exitCh := make(chan fakeExit, 1)
		exitCh <- fakeExit{code: uint32(i), at: epoch}
		awaitClosed(t, WatchExit(ctx, h.m, key, exitCh, exitOf(key)), "watcher "+key)
	}
	h.settled(t)
	assert.Zero(t, r.callCount())
	assert.Zero(t, h.m.Stats().Received)
}

// An exit the watcher takes is handled, even when ctx ends as it is
// taken: an exit is either left in exitCh or handled, never taken and
// thrown away.
func TestWatchExitNeverDiscardsAnExitItTook(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	for i := range 64 {
		key := fmt.Sprintf("c%d", i)
		ctx, cancel := context.WithCancel(context.Background())
		exitCh := make(chan fakeExit, 1)
		exitCh <- fakeExit{code: uint32(i), at: epoch}
		done := WatchExit(ctx, h.m, key, exitCh, exitOf(key))
		cancel()
		awaitClosed(t, done, "watcher "+key)
		h.settled(t)
		taken, handled := len(exitCh) == 0, len(r.handledOf(key))
		assert.Equal(t, taken, handled == 1, "exit %d: taken %v, handled %d times", i, taken, handled)
	}
	assertBalanced(t, h.m.Stats())
}

func TestWatchExitQueuesBehindABusyKey(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithWorkers(2))
	started, release := r.gate(ev{"c1", 1})
	h.submit(t, ev{"c1", 1})
	<-started
	exitCh := make(chan fakeExit, 1)
	exitCh <- fakeExit{code: 2, at: epoch}
	<-WatchExit(context.Background(), h.m, "c1", exitCh, exitOf("c1"))
	assert.Equal(t, 1, r.callCount(), "the exit waits while another call for its key runs")
	release()
	waitFor(t, func() bool { return len(r.handledList()) == 2 }, "exit handled after c1/1")
	assert.Equal(t, []any{ev{"c1", 1}, exitEvent{"c1", 2, epoch}}, r.handledList())
	assert.Equal(t, 1, r.maxConc["c1"])
}

func TestWatchExitEndsOnStop(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	done := WatchExit(context.Background(), h.m, "c1", make(chan fakeExit), exitOf("c1"))
	h.m.Stop()
	<-done
	<-WatchExit(context.Background(), h.m, "c2", make(chan fakeExit), exitOf("c2"))
}

// TestWatchExitWaitsForADeferredStart: under WithDeferredStart an exit is
// queued, not handled inline, until Start.
func TestWatchExitWaitsForADeferredStart(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithDeferredStart())
	exitCh := make(chan fakeExit, 1)
	done := WatchExit(context.Background(), h.m, "c1", exitCh, exitOf("c1"))
	exitCh <- fakeExit{code: 1, at: epoch}
	<-done
	assert.Empty(t, r.handledList(), "nothing is handled before Start")
	assert.Equal(t, 1, h.m.Stats().Queued, "the exit waits in its key's queue")
	h.m.Start()
	h.settled(t)
	assert.Equal(t, anys(exitEvent{"c1", 1, epoch}), r.handledList())
}

// TestWaitIdleOnAHeldMonitorInBackoff: a held monitor arms no timer for a
// key in backoff, and WaitIdle must take that as idle rather than wake the
// scheduler again and again.
func TestWaitIdleOnAHeldMonitorInBackoff(t *testing.T) {
	h := newHarness(t, newRecorder(), WithDeferredStart())
	h.m.Backoff("b", ev{"b", 1})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	require.NoError(t, h.m.WaitIdle(ctx))
	assert.True(t, h.m.InBackoff("b"))
}

type ptrExit struct{ code uint32 }

func (p *ptrExit) Result() (uint32, time.Time, error) { return p.code, time.Time{}, nil }

type exitSeen struct {
	code uint32
	at   time.Time
	err  error
}

// A status whose Result panics or fails gives UnknownExitCode at the clock's
// now, with the panic or Result's error; a builder that panics is a drop.
func TestWatchExitResultOnPanicAndError(t *testing.T) {
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { return nil }))
	h.clock.Step(time.Hour)
	now := h.clock.Now()
	seen := make(chan exitSeen, 3)
	build := func(code uint32, at time.Time, err error) any {
		seen <- exitSeen{code, at, err}
		return code
	}

	// Result panics: a nil *ptrExit.
	pch := make(chan *ptrExit, 1)
	pch <- nil
	<-WatchExitResult(context.Background(), h.m, "p", pch, build)
	got := <-seen
	assert.Equal(t, uint32(UnknownExitCode), got.code)
	assert.Equal(t, now, got.at)
	require.Error(t, got.err)
	assert.Contains(t, got.err.Error(), "reading the exit status panicked")

	// Result fails, with a code and time that must not be used.
	boom := errors.New("boom")
	ech := make(chan fakeExit, 1)
	ech <- fakeExit{code: 7, at: epoch.Add(-time.Minute), err: boom}
	<-WatchExitResult(context.Background(), h.m, "e", ech, build)
	got = <-seen
	assert.Equal(t, exitSeen{UnknownExitCode, now, boom}, got)

	// A real status passes through untouched.
	ech <- fakeExit{code: 3, at: epoch.Add(-time.Minute)}
	<-WatchExitResult(context.Background(), h.m, "ok", ech, build)
	assert.Equal(t, exitSeen{3, epoch.Add(-time.Minute), nil}, <-seen)

	// The builder panicking is a drop of nothing, counted once.
	ech <- fakeExit{code: 1}
	<-WatchExitResult(context.Background(), h.m, "bp", ech, func(uint32, time.Time, error) any { panic("bad builder") })
	drops := h.drops.all()
	require.Len(t, drops, 1)
	assert.ErrorIs(t, drops[0].Reason, ErrInvalidEvent)
	assert.Nil(t, drops[0].Events)
	h.settled(t)
	assertBalanced(t, h.m.Stats())
}

// Run's reader under an intake limit of 1, exits watched on busy and idle
// keys, and a Stop or Shutdown at a varying moment: every envelope the
// subscriber handed over and every exit a watcher read is Received once
// and accounted for, no key runs on two goroutines, and nothing hangs.
func TestStreamAndExitsAcrossStopAccountForEveryEvent(t *testing.T) {
	for i := range 30 {
		var x exclusive
		h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
			defer x.enter(keyOf(e))()
			if i%3 == 0 {
				time.Sleep(time.Duration(i%4) * 100 * time.Microsecond)
			}
			return nil
		}), WithConverter(testConverter), WithIntakeLimit(1), WithWorkers(2))
		var sent atomic.Int64
		feedCtx, stopFeeding := context.WithCancel(context.Background())
		ch := make(chan *Envelope)
		fed := make(chan struct{})
		go func() {
			defer close(fed)
			for j := 0; ; j++ {
				select {
				case ch <- envelope(t, "ns", wrapperspb.String(fmt.Sprintf("k%d", j%3))):
					sent.Add(1)
				case <-feedCtx.Done():
					return
				}
			}
		}()
		ran := make(chan error, 1)
		go func() {
			ran <- h.m.Run(context.Background(), SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) {
				return ch, nil
			}))
		}()
		var exits []chan fakeExit
		var dones []<-chan struct{}
		for j := range 6 {
			c := make(chan fakeExit, 1)
			exits = append(exits, c)
			k := fmt.Sprintf("k%d", j%4)
			dones = append(dones, WatchExit(context.Background(), h.m, k, c,
				func(code uint32, at time.Time) any { return wrapperspb.String(k) }))
		}
		for j, c := range exits {
			if j%2 == 0 {
				c <- fakeExit{code: uint32(j)}
			}
		}
		waitFor(t, func() bool { return h.m.Stats().Received >= uint64(i%5) }, "round %d: events read", i)
		for j, c := range exits {
			if j%2 == 1 {
				c <- fakeExit{code: uint32(j)}
			}
		}
		if i%2 == 0 {
			h.m.Stop()
		} else {
			_ = h.m.Shutdown(context.Background())
		}
		select {
		case err := <-ran:
			require.ErrorIs(t, err, ErrStopped)
		case <-time.After(10 * time.Second):
			t.Fatal("Run did not return after Stop")
		}
		stopFeeding()
		<-fed
		for _, d := range dones {
			select {
			case <-d:
			case <-time.After(10 * time.Second):
				t.Fatal("a watcher did not end")
			}
		}
		read := 0
		for _, c := range exits {
			read += 1 - len(c)
		}
		s := h.m.Stats()
		assertBalanced(t, s)
		require.EqualValues(t, sent.Load()+int64(read), s.Received, "round %d: %+v", i, s)
		require.Zero(t, s.Queued+s.InFlight+s.EventsInBackoff)
		require.False(t, x.twice.Load(), "a key on two goroutines")
	}
}

// WaitIdle waits for an exit a watcher has received until it is queued
// or dropped: here its builder blocks (it once returned idle with the
// exit neither handled, queued nor dropped).
func TestWaitIdleWaitsForAnExitAWatcherReceived(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	building, release := make(chan struct{}), make(chan struct{})
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	exitCh := make(chan fakeExit) // unbuffered: the send returns once the watcher has the exit
	done := WatchExit(context.Background(), h.m, "c1", exitCh, func(code uint32, at time.Time) any {
		close(building)
		<-release // an exit builder that takes a while (or a scheduler that runs WaitIdle first)
		return exitEvent{"c1", code, at}
	})
	exitCh <- fakeExit{code: 137, at: epoch}
	<-building

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond) // it must not say idle before it ends
	defer cancel()
	err := h.m.WaitIdle(ctx)
	handledBefore := r.callCount()
	close(release)
	<-done
	assert.Error(t, err, "WaitIdle said idle while the exit it was given was still being built "+
		"(handled %d, stats %+v)", handledBefore, h.m.Stats())
	h.settled(t)
	require.Equal(t, anys(exitEvent{"c1", 137, epoch}), r.handledList())
}

// An exit's status problems reach the builder: a status error
// gives the builder UnknownExitCode, the clock's now and Result's error; a
// channel closed empty gives ErrNoExitStatus; a panicking Result gives
// errExitStatusPanic; a panicking builder drops the exit (ErrInvalidEvent,
// the key, no events).
func TestExitStatusProblemsReachTheBuilder(t *testing.T) {
	type seen struct {
		code uint32
		at   time.Time
		err  error
	}
	statusErr := errors.New("no status")
	for _, tc := range []struct {
		name    string
		send    func(chan ExitStatus)
		panics  bool
		want    seen
		wantErr error
	}{
		{"status error", func(ch chan ExitStatus) { ch <- fakeExit{code: 3, at: epoch, err: statusErr} }, false,
			seen{UnknownExitCode, epoch.Add(time.Hour), statusErr}, statusErr},
		{"closed empty", func(ch chan ExitStatus) { close(ch) }, false,
			seen{UnknownExitCode, epoch.Add(time.Hour), ErrNoExitStatus}, ErrNoExitStatus},
		{"Result panics", func(ch chan ExitStatus) { ch <- panickyStatus{} }, false,
			seen{UnknownExitCode, epoch.Add(time.Hour), nil}, errExitStatusPanic},
		{"real status", func(ch chan ExitStatus) { ch <- fakeExit{code: 3, at: epoch} }, false,
			seen{3, epoch, nil}, nil},
		{"builder panics", func(ch chan ExitStatus) { ch <- fakeExit{code: 3, at: epoch} }, true, seen{}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRecorder()
			h := newHarness(t, r)
			h.clock.SetTime(epoch.Add(time.Hour))
			var got seen
			exitCh := make(chan ExitStatus, 1)
			tc.send(exitCh)
			awaitClosed(t, WatchExitResult(context.Background(), h.m, "c1", exitCh, func(code uint32, at time.Time, err error) any {
				got = seen{code, at, err}
				if tc.panics {
					panic("builder")
				}
				return exitEvent{"c1", code, at}
			}), "the watcher")
			h.settled(t)
			s := h.m.Stats()
			assertBalanced(t, s)
			if tc.panics {
				drops := h.drops.all()
				require.Len(t, drops, 1)
				assert.ErrorIs(t, drops[0].Reason, ErrInvalidEvent)
				assert.Equal(t, "c1", drops[0].Key)
				assert.Nil(t, drops[0].Events)
				return
			}
			assert.Equal(t, tc.want.code, got.code)
			assert.True(t, tc.want.at.Equal(got.at), "at %v", got.at)
			if tc.wantErr == nil {
				assert.NoError(t, got.err)
			} else {
				assert.ErrorIs(t, got.err, tc.wantErr)
			}
			assert.Equal(t, uint64(1), s.Handled)
		})
	}
}

type panickyStatus struct{}

func (panickyStatus) Result() (uint32, time.Time, error) { panic("status") }

// WatchExit's channel, for an inline exit that fails as Stop cancels it,
// closes only once its drop (ErrStopped) was handed over.
func TestAnInlineExitFailingAtStopIsDroppedBeforeItsChannelCloses(t *testing.T) {
	entered := make(chan struct{})
	h := newHarness(t, HandlerFunc(func(ctx context.Context, _ any) error {
		close(entered)
		<-ctx.Done()
		return ctx.Err()
	}))
	exitCh := make(chan fakeExit, 1)
	exitCh <- fakeExit{code: 9, at: epoch}
	done := WatchExit(context.Background(), h.m, "c1", exitCh, exitOf("c1"))
	<-entered
	h.m.Stop()
	awaitClosed(t, done, "done")
	drops := h.drops.all()
	require.Len(t, drops, 1, "handed over before done closed")
	assert.ErrorIs(t, drops[0].Reason, ErrStopped)
	assertBalanced(t, h.m.Stats())
	assert.EqualValues(t, 1, h.m.Stats().Failed)
}

// A watcher held up between registering its inline call and making it:
// Stop, once the deadline and grace pass, withdraws the call, so the
// handler never runs and the exit is dropped once. White-box:
// the test plays the watcher, calling queueExit and then handle itself.
func TestStopWithdrawsAnInlineExitNotYetBegun(t *testing.T) {
	var calls atomic.Int32
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { calls.Add(1); return nil }))
	c := h.m.queueExit("c1", fakeExit{code: 3, at: epoch}, true, func(code uint32, at time.Time, _ error) any {
		return exitEvent{"c1", code, at}
	})
	require.NotNil(t, c, "an idle key's exit is handled inline")
	stopDone := make(chan struct{})
	go func() { h.m.Stop(); close(stopDone) }()
	waitFor(t, stateIs(h.m, stopped), "Stop begins")
	h.clock.Step(DefaultHandleTimeout + time.Second)
	awaitClosed(t, stopDone, "Stop")
	assert.Nil(t, h.m.handle(c), "a withdrawn call is not made")
	assert.Zero(t, calls.Load())
	drops := h.drops.all()
	require.Len(t, drops, 1)
	assert.ErrorContains(t, drops[0].Reason, "withdrawn")
	assertBalanced(t, h.m.Stats())
	assert.EqualValues(t, 1, h.m.Stats().Received)
}

// Order across sources is the order accepted: an envelope of k the stream
// reader converted before k's exit arrived, but holds at WithIntakeLimit,
// is handled after the exit, which runs inline at once (WatchExit's doc).
func TestAnExitOvertakesAnEnvelopeHeldAtTheIntakeLimit(t *testing.T) {
	r := newRecorder()
	gate := make(chan struct{})
	r.onCall = func(_ context.Context, e any) error {
		if e == (ev{"a", 1}) {
			<-gate
		}
		return nil
	}
	h := newHarness(t, r, WithConverter(testConverter), WithIntakeLimit(1), WithWorkers(1))
	h.submit(t, ev{"a", 1}, ev{"a", 2}) // a/1 runs, a/2 queued: the intake is full
	ch := make(chan *Envelope, 1)
	ch <- envelope(t, "", wrapperspb.String("k"))
	h.m.Subscribe(SubscriberFunc(func(context.Context, ...string) (<-chan *Envelope, <-chan error) { return ch, nil }))
	h.m.Start()
	waitFor(t, func() bool {
		h.m.mu.Lock()
		defer h.m.mu.Unlock()
		return h.m.accepting == 1 && len(ch) == 0
	}, "the reader holds k's envelope at the intake limit")
	exitCh := make(chan fakeExit, 1)
	exitCh <- fakeExit{code: 0, at: epoch}
	awaitClosed(t, WatchExit(context.Background(), h.m, "k", exitCh, exitOf("k")), "k's exit")
	close(gate)
	h.settled(t)
	got := r.handledList()
	require.Len(t, got, 4)
	assert.Equal(t, exitEvent{"k", 0, epoch}, got[0], "the exit first")
	assert.Equal(t, anys(ev{"a", 1}, ev{"a", 2}), got[1:3])
	last, ok := got[3].(*wrapperspb.StringValue)
	require.True(t, ok, "the envelope last, not %v", got[3])
	assert.Equal(t, "k", last.GetValue())
}
