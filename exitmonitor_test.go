package eventmonitor

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
