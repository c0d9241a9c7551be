package eventmonitor

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The per-key backoff queue on plain times: the monitor serialises every
// call, so these tests need no goroutine and no clock.

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func testPolicy() backoffPolicy { return backoffPolicy{initial: time.Second, max: time.Minute} }

func TestDelayDoublesPerFailureUpToTheCap(t *testing.T) {
	for _, tc := range []struct {
		name         string
		initial, max time.Duration
		want         []time.Duration // for attempts 1, 2, ...
	}{
		{"containerd's", time.Second, 5 * time.Minute, []time.Duration{1e9, 2e9, 4e9, 8e9, 16e9, 32e9, 64e9, 128e9, 256e9, 300e9, 300e9}},
		{"initial is max", time.Second, time.Second, []time.Duration{1e9, 1e9, 1e9}},
		{"an odd cap is reached exactly", 3, 13, []time.Duration{3, 6, 12, 13, 13}},
		{"no overflow near the largest duration", math.MaxInt64 / 3, math.MaxInt64, []time.Duration{math.MaxInt64 / 3, 2 * (math.MaxInt64 / 3), math.MaxInt64, math.MaxInt64}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := backoffPolicy{initial: tc.initial, max: tc.max}
			for i, want := range tc.want {
				require.Equal(t, want, p.delay(i+1), "attempt %d", i+1)
			}
		})
	}
}

func TestJitterSpreadsWithinTheFraction(t *testing.T) {
	p := backoffPolicy{initial: time.Second, max: time.Minute, jitter: 0.25}
	lo, hi := time.Duration(math.MaxInt64), time.Duration(0)
	for range 2000 {
		d := p.dueAfter(t0, 8*time.Second).Sub(t0)
		lo, hi = min(lo, d), max(hi, d)
	}
	require.GreaterOrEqual(t, lo, 6*time.Second)
	require.LessOrEqual(t, hi, 10*time.Second)
	require.Less(t, lo, 7*time.Second, "jitter spreads below the delay")
	require.Greater(t, hi, 9*time.Second, "jitter spreads above the delay")

	p.jitter = 0
	require.Equal(t, t0.Add(8*time.Second), p.dueAfter(t0, 8*time.Second), "no jitter: exact")
	p.jitter = 1
	for range 100 {
		require.Positive(t, p.dueAfter(t0, math.MaxInt64).Sub(t0), "a saturated delay stays positive")
		require.Positive(t, p.dueAfter(t0, 1).Sub(t0), "a delay never shrinks to nothing")
	}
}

// events lists a key's queued events.
func events(k *key) []any {
	var out []any
	for _, it := range k.events {
		out = append(out, it.event)
	}
	return out
}

func TestKeysTakeTurnsAnEventEach(t *testing.T) {
	s := newKeySet(testPolicy(), 0)
	for _, e := range []string{"a1", "a2", "a3", "b1", "c1", "c2"} {
		s.push(e[:1], item{event: e})
	}
	var order []any
	for {
		k, it := s.take()
		if k == nil {
			break
		}
		require.Equal(t, keyRunning, k.state)
		order = append(order, it.event)
		s.done(k)
	}
	require.Equal(t, []any{"a1", "b1", "c1", "a2", "c2", "a3"}, order)
	require.Empty(t, s.byName, "keys with nothing left are forgotten")
	requireConsistent(t, s)
}

func TestAFailedEventWaitsAtItsKeysHead(t *testing.T) {
	s := newKeySet(testPolicy(), 0)
	s.push("a", item{event: "a1"})
	s.push("a", item{event: "a2"})
	k, it := s.take()
	it.failed = &failure{attempts: 1}
	require.Equal(t, time.Second, s.failed(k, it, t0))
	require.Equal(t, keyWaiting, k.state)
	require.Equal(t, t0.Add(time.Second), k.due)
	require.Equal(t, []any{"a1", "a2"}, events(k), "the failed event goes back to the head")
	s.push("a", item{event: "a3"})
	require.Equal(t, []any{"a1", "a2", "a3"}, events(k), "later events wait behind it")
	k2, _ := s.take()
	require.Nil(t, k2, "a waiting key is not ready")
	requireConsistent(t, s)

	it.failed = &failure{attempts: 3}
	s.retryDue(t0.Add(time.Second), false)
	k, _ = s.take()
	require.Equal(t, 4*time.Second, s.failed(k, it, t0.Add(time.Second)), "the third failure waits 4x")
	require.Equal(t, t0.Add(5*time.Second), k.due)
}

func TestRetryDueReleasesKeysInDueOrder(t *testing.T) {
	s := newKeySet(testPolicy(), 0)
	for i, name := range []string{"c", "a", "b"} {
		s.push(name, item{event: name})
		k, it := s.take()
		it.failed = &failure{attempts: 3 - i} // c waits 4s, a 2s, b 1s
		s.failed(k, it, t0)
	}
	require.Equal(t, t0.Add(time.Second), s.nextDue())
	s.retryDue(t0.Add(time.Second-1), false)
	k, _ := s.take()
	require.Nil(t, k, "nothing is due a nanosecond early")
	s.retryDue(t0.Add(2*time.Second), false)
	var released []string
	for k, _ := s.take(); k != nil; k, _ = s.take() {
		released = append(released, k.name)
		s.done(k)
	}
	require.Equal(t, []string{"b", "a"}, released, "due ones only, earliest first, exactly at their due time")
	require.Equal(t, t0.Add(4*time.Second), s.nextDue())
	s.retryDue(time.Time{}, true)
	k, _ = s.take()
	require.Equal(t, "c", k.name, "all: every waiting key")
	require.True(t, s.nextDue().IsZero())
	requireConsistent(t, s)
}

func TestPushBackoff(t *testing.T) {
	backedOff := item{event: "b", failed: &failure{attempts: 1}}
	for _, tc := range []struct {
		name    string
		prepare func(s *keySet) *key
		want    time.Time // the key's due time once it waits
	}{
		{"an idle key waits the initial delay", func(s *keySet) *key { return nil }, t0.Add(time.Second)},
		{"a ready key waits, its queued events too", func(s *keySet) *key {
			s.push("k", item{event: "q"})
			return nil
		}, t0.Add(time.Second)},
		{"a waiting key keeps its due time", func(s *keySet) *key {
			s.push("k", item{event: "q"})
			k, it := s.take()
			it.failed = &failure{attempts: 4}
			s.failed(k, it, t0.Add(-time.Second))
			return nil
		}, t0.Add(7 * time.Second)},
		{"a running key waits once its call ends", func(s *keySet) *key {
			s.push("k", item{event: "q"})
			k, _ := s.take()
			return k
		}, t0.Add(time.Second)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newKeySet(testPolicy(), 0)
			running := tc.prepare(s)
			s.pushBackoff("k", backedOff, t0)
			k := s.byName["k"]
			if running != nil {
				require.Equal(t, keyRunning, k.state)
				s.done(running)
			}
			require.Equal(t, keyWaiting, k.state)
			require.Equal(t, tc.want, k.due)
			require.Equal(t, "b", events(k)[len(k.events)-1], "the event joins the tail")
			requireConsistent(t, s)
		})
	}
}

func TestAFailureDuringACallGivenBackoffWaitsTheLonger(t *testing.T) {
	for _, tc := range []struct {
		attempts int
		want     time.Duration
	}{{1, 2 * time.Second}, {3, 4 * time.Second}} {
		s := newKeySet(testPolicy(), 0)
		s.push("k", item{event: "q"})
		k, it := s.take()
		s.pushBackoff("k", item{event: "b", failed: &failure{attempts: 1}}, t0.Add(time.Second)) // due at 2s
		it.failed = &failure{attempts: tc.attempts}
		s.failed(k, it, t0)
		require.Equal(t, t0.Add(tc.want), k.due, "attempts %d", tc.attempts)
		require.Equal(t, []any{"q", "b"}, events(k))
	}
}

func TestForget(t *testing.T) {
	for _, state := range []keyState{keyReady, keyRunning, keyWaiting} {
		t.Run(fmt.Sprint(state), func(t *testing.T) {
			s := newKeySet(testPolicy(), 0)
			s.push("k", item{event: "k1"})
			s.push("k", item{event: "k2"})
			s.push("other", item{event: "o1"})
			want := []any{"k1", "k2"}
			var k *key
			switch state {
			case keyRunning:
				k, _ = s.take()
				s.pushBackoff("k", item{event: "k3", failed: &failure{attempts: 1}}, t0)
				want = []any{"k2", "k3"}
			case keyWaiting:
				var it item
				k, it = s.take()
				it.failed = &failure{attempts: 1}
				s.failed(k, it, t0)
			}
			var got []any
			for _, it := range s.forget("k") {
				got = append(got, it.event)
			}
			require.Equal(t, want, got)
			requireConsistent(t, s)
			if state == keyRunning {
				require.Equal(t, keyRunning, k.state, "the call goes on")
				s.done(k)
				require.NotContains(t, s.byName, "k", "and no Backoff given before Forget keeps the key waiting")
			} else {
				require.NotContains(t, s.byName, "k")
			}
			next, _ := s.take()
			require.Equal(t, "other", next.name)
			require.Nil(t, s.forget("nothing"))
		})
	}
}

func TestTakeAloneOnlyAKeyThatWasIdle(t *testing.T) {
	s := newKeySet(testPolicy(), 0)
	k := s.push("idle", item{event: "exit"})
	it, ok := s.takeAlone(k)
	require.True(t, ok)
	require.Equal(t, "exit", it.event)
	require.Equal(t, keyRunning, k.state)
	next, _ := s.take()
	require.Nil(t, next, "taken out of the run queue")

	s.push("busy", item{event: "first"})
	k = s.push("busy", item{event: "exit"})
	_, ok = s.takeAlone(k)
	require.False(t, ok, "an earlier event comes first")
	k = s.push("idle", item{event: "exit2"})
	_, ok = s.takeAlone(k)
	require.False(t, ok, "a running key's exit waits for its call")
	requireConsistent(t, s)
}

func TestFullCountsTheCallInProgress(t *testing.T) {
	s := newKeySet(testPolicy(), 2)
	require.False(t, s.full("k"))
	s.push("k", item{event: 1})
	k, it := s.take()
	require.False(t, s.full("k"))
	s.push("k", item{event: 2})
	require.True(t, s.full("k"), "a queued event and the call's")
	it.failed = &failure{attempts: 1}
	s.failed(k, it, t0)
	require.Len(t, k.events, 2, "a failure keeps the key within its bound")
	require.True(t, s.full("k"))
	require.False(t, newKeySet(testPolicy(), 0).full("k"), "0: no bound")
}

// FuzzKeySet runs arbitrary operations and checks the counts and links after
// each, and that every event pushed is queued, in a call or ended, once.
func FuzzKeySet(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 2, 0, 3, 0, 4, 0, 6, 0, 2, 0, 5, 0})
	f.Add([]byte{0, 1, 2, 1, 4, 1, 1, 1, 6, 9, 2, 1, 3, 1, 7, 1, 0, 2, 2, 2})
	f.Fuzz(func(t *testing.T, ops []byte) {
		s := newKeySet(backoffPolicy{initial: time.Second, max: 8 * time.Second}, 0)
		now, next := t0, 0
		calls := map[*key]item{}
		ended := map[int]bool{}
		for i := 0; i+1 < len(ops) && i < 512; i += 2 {
			name := string(rune('a' + ops[i+1]%4))
			switch ops[i] % 8 {
			case 0:
				s.push(name, item{event: next})
				next++
			case 1:
				s.pushBackoff(name, item{event: next, failed: &failure{attempts: 1}}, now)
				next++
			case 2:
				if k, it := s.take(); k != nil {
					calls[k] = it
				}
			case 3, 4: // a call ends: handled, or failed
				for k, it := range calls {
					delete(calls, k)
					if ops[i]%8 == 4 {
						it.failed = &failure{attempts: it.attempts() + 1}
						s.failed(k, it, now)
					} else {
						ended[it.event.(int)] = true
						s.done(k)
					}
					break
				}
			case 5:
				for _, it := range s.forget(name) {
					ended[it.event.(int)] = true
				}
			case 6:
				now = now.Add(time.Duration(ops[i+1]) * 100 * time.Millisecond)
				s.retryDue(now, false)
			case 7:
				s.retryDue(now, true)
			}
			requireConsistent(t, s)
			held := 0
			for _, k := range s.byName {
				for _, it := range k.events {
					if ended[it.event.(int)] {
						t.Fatalf("event %v queued after it ended", it.event)
					}
				}
				held += len(k.events)
			}
			if next != held+len(calls)+len(ended) {
				t.Fatalf("%d events pushed, %d held, in calls or ended: lost or duplicated", next, held+len(calls)+len(ended))
			}
		}
	})
}

// requireConsistent checks keySet's counts, run queue and heap against its
// keys.
func requireConsistent(t testing.TB, s *keySet) {
	t.Helper()
	queued, inHeap, readyKeys := 0, 0, 0
	for name, k := range s.byName {
		switch {
		case name != k.name:
			t.Fatalf("key %q filed as %q", k.name, name)
		case k.state == keyWaiting && (k.index < 0 || k.index >= len(s.due) || s.due[k.index] != k):
			t.Fatalf("waiting key %q not in the heap at its index %d", name, k.index)
		case k.state != keyRunning && len(k.events) == 0:
			t.Fatalf("key %q (%v) holds no event", name, k.state)
		}
		queued += len(k.events)
		if k.state == keyWaiting {
			inHeap += len(k.events)
		}
		if k.state == keyReady {
			readyKeys++
		}
	}
	if queued != s.queued || inHeap != s.inHeap {
		t.Fatalf("counts: queued %d (counted %d), in the heap %d (counted %d)", queued, s.queued, inHeap, s.inHeap)
	}
	inRun := 0
	var last *key
	for k := s.run.head; k != nil; k = k.next {
		if k.state != keyReady || inRun > len(s.byName) {
			t.Fatalf("run queue holds %q (%v), or loops", k.name, k.state)
		}
		inRun, last = inRun+1, k
	}
	if inRun != readyKeys || last != s.run.tail {
		t.Fatalf("run queue holds %d keys of %d ready, or its tail is wrong", inRun, readyKeys)
	}
	for i, k := range s.due {
		if k.index != i || k.state != keyWaiting || i > 0 && k.due.Before(s.due[(i-1)/2].due) {
			t.Fatalf("heap: %q at %d (index %d, %v) breaks the order", k.name, i, k.index, k.state)
		}
	}
}
