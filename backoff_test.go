package eventmonitor

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestOrderPerKeyUnderFailures(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	started, release := r.gate(ev{"a", 1})
	r.fail(ev{"a", 2}, 1)

	h.submit(t, evs("a", 1, 2, 3, 4, 5)...)
	<-started
	release()
	h.settled(t)

	// a/2 failed: it and everything behind it wait in backoff, in order.
	require.True(t, h.m.InBackoff("a"))
	p := h.pending("a")
	assert.Equal(t, anys(evs("a", 2, 3, 4, 5)...), p.Events)
	assert.Equal(t, 1, p.Attempts)
	assert.Equal(t, epoch.Add(DefaultInitialBackoff), p.Due)

	// New events of a key in backoff join the tail instead of being handled.
	h.submit(t, ev{"a", 6})
	assert.Equal(t, anys(evs("a", 2, 3, 4, 5, 6)...), h.pending("a").Events)
	assert.Equal(t, anys(ev{"a", 1}), r.handledList())

	h.step(t, DefaultInitialBackoff)
	assert.Equal(t, anys(evs("a", 1, 2, 3, 4, 5, 6)...), r.handledList(), "the replay handles everything")
	assert.False(t, h.m.InBackoff("a"), "a leaves backoff")
	assert.Equal(t, uint64(1), h.m.Stats().Retried)
}

func TestReplayStopsAtFirstFailureAndKeepsTheRest(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	r.fail(ev{"a", 1}, 1)
	r.fail(ev{"a", 3}, 1)
	started, release := r.gate(ev{"a", 1})
	h.submit(t, evs("a", 1, 2, 3, 4)...)
	<-started
	release()
	h.settled(t)
	assert.Equal(t, anys(evs("a", 1, 2, 3, 4)...), h.pending("a").Events)

	h.step(t, time.Second)
	require.Equal(t, uint64(2), h.m.Stats().Failed, "a/3 fails in the replay")
	// The replay handled a/1 and a/2, stopped at a/3 and kept a/3 and a/4.
	// It made progress, so a/3 waits the initial delay, not a doubled one.
	assert.Equal(t, anys(evs("a", 1, 2)...), r.handledList())
	p := h.pending("a")
	assert.Equal(t, anys(evs("a", 3, 4)...), p.Events)
	assert.Equal(t, h.clock.Now().Add(time.Second), p.Due)

	h.step(t, time.Second)
	assert.Equal(t, anys(evs("a", 1, 2, 3, 4)...), r.handledList(), "the second replay succeeds")
}

// Only a replay that fails on the event that failed before doubles the
// delay; one that handled events first starts over at the initial delay,
// and doubles again from there if it then makes no progress.
func TestDelayDoublesOnlyWithoutProgress(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithBackoff(time.Second, time.Minute))
	r.fail(ev{"a", 1}, 2) // fails, then fails its first replay: 1 s, then 2 s
	r.fail(ev{"a", 2}, 2) // after a/1 succeeds: 1 s (progress), then 2 s (none)
	h.submit(t, evs("a", 1, 2, 3)...)

	for i, want := range []time.Duration{1, 2, 1, 2} {
		h.settled(t)
		p := h.pending("a")
		require.Equal(t, want*time.Second, p.Due.Sub(h.clock.Now()), "delay after failure %d", i+1)
		h.clock.Step(p.Due.Sub(h.clock.Now()))
	}
	h.settled(t)
	assert.Equal(t, anys(evs("a", 1, 2, 3)...), r.handledList())
}

func TestDelayDoublesAndCaps(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithBackoff(time.Second, 5*time.Second))
	r.fail(ev{"a", 1}, 100)
	h.submit(t, ev{"a", 1})

	for i, want := range []time.Duration{1, 2, 4, 5, 5, 5} {
		h.settled(t)
		p := h.pending("a")
		require.Equal(t, want*time.Second, p.Due.Sub(h.clock.Now()), "delay after failure %d", i+1)
		require.Equal(t, i+1, p.Attempts)
		h.clock.Step(p.Due.Sub(h.clock.Now()))
	}
}

func TestDelayResetsAfterReplaySucceeds(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	r.fail(ev{"a", 1}, 2) // fails at first, and in the first replay: delay 2 s
	h.submit(t, ev{"a", 1})
	h.step(t, time.Second)
	require.Equal(t, uint64(2), h.m.Stats().Failed, "the replay fails")
	require.Equal(t, 2*time.Second, h.pending("a").Due.Sub(h.clock.Now()))

	// The next replay runs a/1 while a/2 arrives; a/2 joined during the
	// replay, so when it fails it starts over at the initial delay.
	started, release := r.gate(ev{"a", 1})
	r.fail(ev{"a", 2}, 1)
	h.clock.Step(2 * time.Second)
	<-started
	h.submit(t, ev{"a", 2})
	release()
	h.settled(t)
	require.Equal(t, uint64(3), h.m.Stats().Failed, "a/2 fails")
	p := h.pending("a")
	assert.Equal(t, anys(ev{"a", 2}), p.Events)
	assert.Equal(t, time.Second, p.Due.Sub(h.clock.Now()), "delay must reset after a successful replay")
}

func TestJitterStaysInItsBand(t *testing.T) {
	const keys = 200
	r := newRecorder()
	h := newHarness(t, r, WithJitter(0.25), WithWorkers(4))
	for i := range keys {
		e := ev{string(rune('A'+i%26)) + string(rune('a'+i/26)), 1}
		r.fail(e, 1)
		h.submit(t, e)
	}
	h.settled(t)
	require.Equal(t, uint64(keys), h.m.Stats().Failed, "every key fails once")
	seen := map[time.Duration]bool{}
	for _, p := range h.m.Pending() {
		d := p.Due.Sub(epoch)
		assert.GreaterOrEqual(t, d, 750*time.Millisecond)
		assert.LessOrEqual(t, d, 1250*time.Millisecond)
		seen[d] = true
	}
	assert.Greater(t, len(seen), keys/2, "jitter should spread the due times")
}

func TestBackoffPutsEventStraightIntoBackoff(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	h.m.Backoff("a", ev{"a", 1})
	require.True(t, h.m.InBackoff("a"))
	h.submit(t, ev{"a", 2})
	p := h.pending("a")
	assert.Equal(t, anys(evs("a", 1, 2)...), p.Events)
	assert.Equal(t, epoch.Add(time.Second), p.Due)
	assert.Equal(t, 0, r.callCount())

	h.step(t, time.Second)
	assert.Equal(t, anys(evs("a", 1, 2)...), r.handledList(), "the replay handles both")
}

func TestForgetReturnsTheBackoffQueue(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r)
	h.m.Backoff("a", ev{"a", 1})
	h.m.Backoff("a", ev{"a", 2})
	assert.Equal(t, anys(evs("a", 1, 2)...), h.m.Forget("a"))
	assert.False(t, h.m.InBackoff("a"))
	assert.Empty(t, h.m.Pending())
	assert.Nil(t, h.m.Forget("a"))
	s := h.m.Stats()
	assert.Equal(t, uint64(2), s.Forgotten)
	assert.Zero(t, s.KeysInBackoff)
	assert.Zero(t, s.EventsInBackoff)

	// Nothing fires for the forgotten key.
	h.step(t, time.Hour)
	h.submit(t, ev{"b", 1})
	h.settled(t)
	assert.Equal(t, anys(ev{"b", 1}), r.handledList())
}

// Forget during a replay's first call takes what was queued, but the key
// stays in backoff until the call ends: the replay goes on, its
// call the last, and a failure doubles the delay as without Forget. A
// Shutdown whose ctx has ended abandons the call, which ends the replay.
func TestForgetDuringAReplaysCallLeavesItTheReplays(t *testing.T) {
	for _, end := range []string{"handled", "failed", "abandoned"} {
		t.Run(end, func(t *testing.T) {
			r := newRecorder()
			h := newHarness(t, r, WithBackoff(time.Second, time.Minute), WithHandleTimeout(0))
			r.fail(ev{"a", 1}, 1)
			if end == "failed" {
				r.fail(ev{"a", 1}, 2)
			}
			h.submit(t, ev{"a", 1})
			h.settled(t)
			h.submit(t, ev{"a", 2}) // part of the replay
			started, release := r.gate(ev{"a", 1})
			defer release()
			h.clock.Step(time.Second)
			<-started
			require.Equal(t, anys(ev{"a", 2}), h.m.Forget("a"))
			s := h.m.Stats()
			assertBalanced(t, s)
			require.True(t, h.m.InBackoff("a"), "replaying, with no event left")
			require.Equal(t, [2]int{1, 0}, [2]int{s.KeysInBackoff, s.EventsInBackoff})
			switch end {
			case "abandoned":
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				require.ErrorIs(t, h.m.Shutdown(ctx), context.Canceled)
				s := h.m.Stats()
				assertBalanced(t, s)
				require.Equal(t, [3]uint64{1, 1, 0}, [3]uint64{s.Dropped, s.Forgotten, uint64(s.KeysInBackoff + s.InFlight)})
				require.False(t, h.m.InBackoff("a"))
				return
			case "handled":
				release()
				h.settled(t)
				require.False(t, h.m.InBackoff("a"))
				return
			}
			release()
			h.settled(t)
			p := h.pending("a")
			require.Equal(t, [2]any{anys(ev{"a", 1}), 2}, [2]any{p.Events, p.Attempts})
			require.Equal(t, h.clock.Now().Add(2*time.Second), p.Due, "the replay failed on its first event: doubled")
		})
	}
}

func TestDueHeapOrdersManyKeys(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithBackoff(time.Second, time.Hour))
	// Keys put in backoff one second apart replay one at a time, in due order.
	for i := range 5 {
		h.m.Backoff(string(rune('a'+i)), ev{string(rune('a' + i)), 1})
		h.step(t, time.Second)
		require.Len(t, r.handledList(), i+1, "key %d replayed", i)
	}
	got := r.handledList()
	for i, e := range got {
		assert.Equal(t, string(rune('a'+i)), e.(ev).Key)
	}
}

// Guarantee (keyq next): the wait recorded by Backoff during a replay is
// due the initial delay from the Backoff call, not from the replay's end:
// a replay outlasting it leaves the event due at once, and WaitIdle sees
// it handled with no timer or retry left.
func TestBackoffDuringAReplayIsDueFromTheBackoffCall(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(0))
	r.fail(ev{"a", 1}, 1)
	h.submit(t, ev{"a", 1})
	h.settled(t)
	started, release := r.gate(ev{"a", 1})
	h.clock.Step(time.Second)
	<-started
	h.m.Backoff("a", ev{"a", 2})
	h.clock.Step(5 * time.Second) // the replay outlasts the initial delay
	release()
	h.settled(t)
	require.Equal(t, anys(ev{"a", 1}, ev{"a", 2}), r.handledList())
	_, ok := h.m.NextRetry()
	require.False(t, ok)
	require.False(t, h.clock.HasWaiters())
}

// The delay doubles only when a replay fails on the event that failed
// before: with that event given up on (WithMaxAttempts), the next event's
// first failure waits the initial delay.
func TestDropInAReplayDoesNotDoubleTheNextFailure(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithMaxAttempts(2))
	r.fail(ev{"a", 1}, 2)
	r.fail(ev{"a", 2}, 1)
	h.submit(t, ev{"a", 1})
	h.settled(t)
	h.submit(t, ev{"a", 2}) // behind a/1 in backoff
	h.step(t, DefaultInitialBackoff)
	require.Len(t, h.drops.all(), 1, "a/1 failed again: given up on")
	p := h.pending("a")
	require.Equal(t, anys(ev{"a", 2}), p.Events)
	require.Equal(t, 1, p.Attempts)
	require.Equal(t, h.clock.Now().Add(DefaultInitialBackoff), p.Due,
		"a/2 failed for the first time: it waits the initial delay")
}

// A failed event waits the initial delay from its failure even when
// Backoff gave its key an earlier due time during the call: a long call
// had passed that time, and the event was once retried at once.
func TestFailureAfterABackoffDuringItsCallWaits(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithHandleTimeout(0))
	r.fail(ev{"a", 1}, 1)
	started, release := r.gate(ev{"a", 1})
	h.submit(t, ev{"a", 1})
	<-started
	h.m.Backoff("a", ev{"a", 2})  // due in 1 s
	h.clock.Step(5 * time.Second) // a/1 runs for 5 s
	release()                     // and fails
	h.settled(t)
	failedAt := epoch.Add(5 * time.Second)
	require.Empty(t, r.handledList(), "nothing is due before %v", failedAt.Add(DefaultInitialBackoff))
	require.Equal(t, failedAt.Add(DefaultInitialBackoff), h.pending("a").Due)
}

// NextRetry counts a key given Backoff while its call runs once the call
// ended, as its doc says: WaitIdle first, then it agrees with Pending
// (they once disagreed while the call ran, undocumented).
func TestNextRetryCountsABackoffDuringACallOnceTheCallEnds(t *testing.T) {
	r := newRecorder()
	h := newHarness(t, r, WithBackoff(time.Second, time.Minute))
	started, release := r.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1})
	<-started
	h.m.Backoff("a", ev{"a", 2})
	require.True(t, h.m.InBackoff("a"))
	_, ok := h.m.NextRetry()
	require.False(t, ok, "the key waits once its call ends")

	release()
	h.settled(t)
	p := h.pending("a")
	require.Equal(t, anys(ev{"a", 2}), p.Events)
	at, ok := h.m.NextRetry()
	require.True(t, ok)
	require.Equal(t, p.Due, at)
	require.Equal(t, epoch.Add(time.Second), at, "due the initial delay from the Backoff")
}
