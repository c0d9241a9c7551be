package eventmonitor_test

// WatchExit: where an exit is handled, what it is built from, and when its
// channel closes.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"

	"github.com/eventmonitor/eventmonitor"
)

// exitResult is an ExitStatus.
type exitResult struct {
	code uint32
	at   time.Time
	err  error
}

func (s exitResult) Result() (uint32, time.Time, error) { return s.code, s.at, s.err }

// exitAs builds key's exit as ev{key, code}, so that the recorder orders,
// gates and fails it with key's other events.
func exitAs(key string) func(uint32, time.Time) any {
	return func(code uint32, _ time.Time) any { return ev{key, int(code)} }
}

// exitWatch watches key for an exit with code that is already waiting.
func exitWatch(h *harness, key string, code uint32) <-chan struct{} {
	exitCh := make(chan exitResult, 1)
	exitCh <- exitResult{code: code, at: epoch}
	return eventmonitor.WatchExit(context.Background(), h.m, key, exitCh, exitAs(key))
}

// exitOpen reports whether ch is still open.
func exitOpen(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return false
	default:
		return true
	}
}

func TestWatchExitHandlesAnIdleKeyWithoutAWorker(t *testing.T) {
	var hs *harness
	var deadline time.Time
	var key string
	hs = newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		if e == (ev{"c1", 137}) {
			deadline, _ = ctx.Deadline()
			key = eventmonitor.KeyFromContext(ctx)
		}
		return hs.rec.HandleEvent(ctx, e)
	}), eventmonitor.WithWorkers(1), eventmonitor.WithHandleTimeout(5*time.Second))
	started, release := hs.rec.gate(ev{"a", 1})
	t.Cleanup(release)
	hs.submit(t, ev{"a", 1}, ev{"b", 1})
	<-started // the only worker is busy, and b/1 waits for it

	awaitClosed(t, exitWatch(hs, "c1", 137), "the watcher")
	require.Equal(t, []any{ev{"c1", 137}}, hs.rec.handled(), "handled before the channel closed")
	require.Equal(t, epoch.Add(5*time.Second), deadline, "the handle timeout applies")
	require.Equal(t, "c1", key)
	release()
	hs.settle(t)
	require.Equal(t, []any{ev{"c1", 137}, ev{"a", 1}, ev{"b", 1}}, hs.rec.handled(), "the exit took no worker's turn")
	requireBalanced(t, hs.m.Stats())
}

// On a key that is not idle the exit joins the tail of its queue: never
// beside another call of the key, never ahead of an earlier event.
func TestWatchExitQueuesBehindItsKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		busy func(t *testing.T, h *harness) (release func())
		want []any
	}{
		{"a call runs", func(t *testing.T, h *harness) func() {
			started, release := h.rec.gate(ev{"c1", 1})
			h.submit(t, ev{"c1", 1})
			<-started
			return release
		}, evs("c1", 1, 9)},
		{"events wait for a worker", func(t *testing.T, h *harness) func() {
			started, release := h.rec.gate(ev{"a", 1})
			h.submit(t, ev{"a", 1}, ev{"c1", 1}, ev{"c1", 2})
			<-started
			return release
		}, evs("c1", 1, 2, 9)},
		{"in backoff", func(t *testing.T, h *harness) func() {
			h.rec.fail(ev{"c1", 1}, 1)
			h.submit(t, ev{"c1", 1})
			h.settle(t)
			require.True(t, h.m.InBackoff("c1"))
			return func() { h.step(t, time.Second) }
		}, evs("c1", 1, 9)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithWorkers(1))
			release := tc.busy(t, h)
			t.Cleanup(release)
			received := h.m.Stats().Received
			awaitClosed(t, exitWatch(h, "c1", 9), "the watcher")
			require.Equal(t, received+1, h.m.Stats().Received, "closed before the exit was queued")
			require.Empty(t, h.rec.handled("c1"), "the key went ahead of its queue or its turn")
			release()
			h.settle(t)
			require.Equal(t, tc.want, h.rec.handled("c1"))
			require.Empty(t, h.rec.overlapped())
			requireBalanced(t, h.m.Stats())
		})
	}
}

func TestWatchExitFailedExitBacksOff(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithBackoff(time.Second, time.Minute))
	h.rec.fail(ev{"c1", 2}, 2)
	awaitClosed(t, exitWatch(h, "c1", 2), "the watcher")
	h.settle(t)
	require.Equal(t, eventmonitor.Pending{Key: "c1", Events: evs("c1", 2), Attempts: 1, Due: epoch.Add(time.Second)},
		h.pending("c1"))
	h.step(t, time.Second)
	require.Equal(t, epoch.Add(3*time.Second), h.pending("c1").Due, "the delay doubles")
	h.step(t, 2*time.Second)
	require.Equal(t, evs("c1", 2), h.rec.handled())
	require.False(t, h.m.InBackoff("c1"))
}

// An exit whose status cannot be read is built with UnknownExitCode at the
// clock's now.
func TestWatchExitUnknownStatus(t *testing.T) {
	for _, tc := range []struct {
		name string
		send func(ch chan eventmonitor.ExitStatus)
	}{
		{"Result fails", func(ch chan eventmonitor.ExitStatus) {
			ch <- exitResult{code: 3, at: epoch, err: errors.New("no status")}
		}},
		{"channel closed empty", func(ch chan eventmonitor.ExitStatus) { close(ch) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.clk.Step(time.Hour)
			var code uint32
			var at time.Time
			exitCh := make(chan eventmonitor.ExitStatus, 1)
			tc.send(exitCh)
			awaitClosed(t, eventmonitor.WatchExit(context.Background(), h.m, "c1", exitCh, func(c uint32, a time.Time) any {
				code, at = c, a
				return ev{"c1", int(c)}
			}), "the watcher")
			require.Equal(t, uint32(eventmonitor.UnknownExitCode), code)
			require.Equal(t, epoch.Add(time.Hour), at)
			require.Equal(t, evs("c1", eventmonitor.UnknownExitCode), h.rec.handled())
			var warned bool
			for _, e := range h.logs.AllEntries() {
				warned = warned || e.Message == "cannot read exit status; exit code unknown" && e.Level == logrus.WarnLevel
			}
			require.True(t, warned)
		})
	}
}

func TestWatchExitBuilderPanicDropsTheExit(t *testing.T) {
	h := newHarness(t, nil)
	exitCh := make(chan exitResult, 1)
	exitCh <- exitResult{code: 1, at: epoch}
	awaitClosed(t, eventmonitor.WatchExit(context.Background(), h.m, "c1", exitCh,
		func(uint32, time.Time) any { panic("bad builder") }), "the watcher")
	drops := h.drops.list()
	require.Len(t, drops, 1, "dropped before the channel closed")
	require.ErrorIs(t, drops[0].Reason, eventmonitor.ErrInvalidEvent)
	require.Equal(t, "c1", drops[0].Key)
	require.Nil(t, drops[0].Events)
	s := h.m.Stats()
	require.Equal(t, [2]uint64{1, 1}, [2]uint64{s.Received, s.Dropped})
	requireBalanced(t, s)
}

func TestWatchExitEndsWithItsCtx(t *testing.T) {
	h := newHarness(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	exitCh := make(chan exitResult, 1)
	done := eventmonitor.WatchExit(ctx, h.m, "c1", exitCh, exitAs("c1"))
	require.True(t, exitOpen(done), "closed before anything happened")
	cancel()
	awaitClosed(t, done, "the watcher")
	exitCh <- exitResult{code: 1}
	h.settle(t)
	require.Len(t, exitCh, 1, "an ended watch took the exit")
	require.Zero(t, h.m.Stats().Received)
}

func TestWatchExitEndsWhenStopBegins(t *testing.T) {
	t.Run("no exit yet", func(t *testing.T) {
		h := newHarness(t, nil)
		exitCh := make(chan exitResult, 1)
		done := eventmonitor.WatchExit(context.Background(), h.m, "c1", exitCh, exitAs("c1"))
		h.m.Stop()
		awaitClosed(t, done, "the watcher")
		exitCh <- exitResult{code: 1}
		require.Len(t, exitCh, 1)
		require.Zero(t, h.m.Stats().Received)
	})
	t.Run("an exit in its call", func(t *testing.T) {
		entered := make(chan struct{})
		h := newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, _ any) error {
			close(entered)
			<-ctx.Done()
			return ctx.Err()
		}))
		done := exitWatch(h, "c1", 9)
		<-entered
		require.True(t, exitOpen(done), "closed while its call runs")
		h.m.Stop()
		awaitClosed(t, done, "the watcher")
		require.ErrorIs(t, h.drops.reason(ev{"c1", 9}), eventmonitor.ErrStopped, "failed as Stop cancelled it")
		requireBalanced(t, h.m.Stats())
	})
}

// Once Shutdown was called an exit is refused: dropped with ErrStopped.
func TestWatchExitDuringShutdownDropsTheExit(t *testing.T) {
	for _, before := range []bool{true, false} {
		name := map[bool]string{true: "watching before Shutdown", false: "watching after Shutdown began"}[before]
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithHandleTimeout(0))
			started, release := h.rec.gate(ev{"a", 1})
			t.Cleanup(release)
			h.submit(t, ev{"a", 1})
			<-started // holds Shutdown's drain
			exitCh := make(chan exitResult, 1)
			var done <-chan struct{}
			if before {
				done = eventmonitor.WatchExit(context.Background(), h.m, "c1", exitCh, exitAs("c1"))
			}
			shut := make(chan error, 1)
			go func() { shut <- h.m.Shutdown(context.Background()) }()
			waitFor(t, "Shutdown to begin", func() bool { return h.m.Submit("probe", ev{"probe", 1}) != nil })
			if !before {
				done = eventmonitor.WatchExit(context.Background(), h.m, "c1", exitCh, exitAs("c1"))
			}
			exitCh <- exitResult{code: 9}
			awaitClosed(t, done, "the watcher")
			require.ErrorIs(t, h.drops.reason(ev{"c1", 9}), eventmonitor.ErrStopped)
			release()
			require.NoError(t, streamRecv(t, shut))
			require.NotContains(t, h.rec.handled(), ev{"c1", 9})
			requireBalanced(t, h.m.Stats())
		})
	}
}

func TestWatchExitAfterStopReturnsAClosedChannel(t *testing.T) {
	h := newHarness(t, nil)
	h.m.Stop()
	exitCh := make(chan exitResult, 1)
	exitCh <- exitResult{code: 1}
	require.False(t, exitOpen(eventmonitor.WatchExit(context.Background(), h.m, "c1", exitCh, exitAs("c1"))))
	require.Len(t, exitCh, 1, "the exit was taken")
	require.Zero(t, h.m.Stats().Received)
}

func TestWatchExitOnAHeldMonitorQueuesTheExit(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithDeferredStart())
	awaitClosed(t, exitWatch(h, "c1", 1), "the watcher")
	h.settle(t)
	require.Empty(t, h.rec.log(), "a held monitor handled the exit")
	require.Equal(t, 1, h.m.Stats().Queued)
	h.m.Start()
	h.settle(t)
	require.Equal(t, evs("c1", 1), h.rec.handled())
}

func TestWatchExitPanicsOnNilArguments(t *testing.T) {
	h := newHarness(t, nil)
	ch, build := make(chan exitResult), exitAs("c1")
	bg := context.Background()
	for name, watch := range map[string]func(){
		"ctx":     func() { eventmonitor.WatchExit(nil, h.m, "c1", ch, build) }, //nolint:staticcheck // the nil ctx is the point
		"monitor": func() { eventmonitor.WatchExit(bg, nil, "c1", ch, build) },
		"channel": func() { eventmonitor.WatchExit[exitResult](bg, h.m, "c1", nil, build) },
		"builder": func() { eventmonitor.WatchExit(bg, h.m, "c1", ch, nil) },
	} {
		require.Panics(t, watch, "a nil %s", name)
	}
}

// An exit is the one event of its object that must not be lost: a key at
// WithMaxQueuedPerKey still takes it, behind what it holds.
func TestAnExitIsNeverRefusedForTheQueueBound(t *testing.T) {
	for _, busy := range []string{"a call runs", "in backoff"} {
		t.Run(busy, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithMaxQueuedPerKey(2), eventmonitor.WithHandleTimeout(0))
			release := func() {}
			if busy == "a call runs" {
				var started <-chan struct{}
				started, release = h.rec.gate(ev{"c1", 1})
				t.Cleanup(release)
				h.submit(t, ev{"c1", 1})
				<-started
			} else {
				h.rec.fail(ev{"c1", 1}, 1)
				h.submit(t, ev{"c1", 1})
				h.settle(t)
				release = func() { h.step(t, time.Second) }
			}
			var err error
			seq := 1
			for err == nil { // up to the bound, however the key's call counts
				seq++
				err = h.m.Submit("c1", ev{"c1", seq})
			}
			require.ErrorIs(t, err, eventmonitor.ErrQueueFull)
			awaitClosed(t, exitWatch(h, "c1", 99), "the watcher")
			require.Nil(t, h.drops.reason(ev{"c1", 99}), "the exit was refused")
			release()
			h.settle(t)
			want := evs("c1", 1)
			for i := 2; i < seq; i++ {
				want = append(want, ev{"c1", i})
			}
			require.Equal(t, append(want, ev{"c1", 99}), h.rec.handled(), "the exit handled last")
			require.Empty(t, h.drops.list())
			requireBalanced(t, h.m.Stats())
		})
	}
}
