package eventmonitor_test

// The monitor's core promises: order per key, parallelism and fairness
// across keys, Submit, Backoff and Forget, New's options, the handler's ctx,
// a failing handler, the Stats identity and the per-key queue bound.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

// nopHandler handles every event at once.
var nopHandler = eventmonitor.HandlerFunc(func(context.Context, any) error { return nil })

// gateAll gates each event, releasing them all when the test ends.
func gateAll(t *testing.T, r *recorder, events ...any) (started []<-chan struct{}, release []func()) {
	for _, e := range events {
		s, rel := r.gate(e)
		started, release = append(started, s), append(release, rel)
		t.Cleanup(rel) // before the harness's Stop, which waits for the call
	}
	return started, release
}

func TestEventsOfAKeyAreHandledOneAtATimeInOrder(t *testing.T) {
	const keys, perKey = 16, 30
	h := newHarness(t, nil, eventmonitor.WithWorkers(8))
	for s := range perKey {
		for k := range keys {
			e := ev{fmt.Sprintf("k%d", k), s}
			if (k+s)%7 == 0 {
				h.rec.fail(e, 1+s%3) // retried after 1, 2 and 4 s, its key's later events behind it
			}
			h.submit(t, e)
		}
	}
	for i := 0; i < 50 && h.m.Stats().Handled < keys*perKey; i++ {
		h.step(t, 4*time.Second)
	}
	seqs := make([]int, perKey)
	for i := range seqs {
		seqs[i] = i
	}
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		require.Equal(t, evs(key, seqs...), h.rec.handled(key), "key %s out of order", key)
	}
	assert.Empty(t, h.rec.overlapped(), "keys handled on two goroutines at once")
}

func TestWithWorkersHandlesThatManyKeysAtOnce(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithWorkers(3))
	events := []any{ev{"a", 1}, ev{"b", 1}, ev{"c", 1}, ev{"d", 1}}
	started, release := gateAll(t, h.rec, events...)
	h.submit(t, events...)
	for _, s := range started[:3] {
		awaitClosed(t, s, "three keys running at once")
	}
	s := h.m.Stats()
	assert.Equal(t, [2]int{3, 1}, [2]int{s.InFlight, s.Queued}, "in flight, queued")
	select {
	case <-started[3]:
		t.Fatal("a fourth key ran with three workers")
	default:
	}
	release[1]()
	awaitClosed(t, started[3], "the fourth key takes the freed worker")
}

func TestASlowKeyDoesNotDelayOthers(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithWorkers(2))
	started, release := gateAll(t, h.rec, ev{"slow", 1})
	h.submit(t, ev{"slow", 1})
	awaitClosed(t, started[0], "the slow call")
	h.submit(t, ev{"slow", 2})
	var others []any
	for i := range 50 {
		others = append(others, ev{fmt.Sprintf("k%d", i%10), i})
	}
	h.submit(t, others...)
	waitFor(t, "the other keys, on the free worker", func() bool { return len(h.rec.handled()) == len(others) })
	assert.Empty(t, h.rec.handled("slow"), "slow/2 waits for slow/1")
	release[0]()
	h.settle(t)
	assert.Equal(t, evs("slow", 1, 2), h.rec.handled("slow"))
}

// A key with a backlog goes to the back of the run queue after each event.
func TestKeysWithABacklogTakeTurnsAnEventAtATime(t *testing.T) {
	h := newHarness(t, nil) // one worker
	started, release := gateAll(t, h.rec, ev{"x", 0})
	h.submit(t, ev{"x", 0})
	awaitClosed(t, started[0], "x/0")
	h.submit(t, ev{"a", 1}, ev{"a", 2}, ev{"a", 3}, ev{"b", 1}, ev{"b", 2}, ev{"x", 1})
	release[0]()
	h.settle(t)
	assert.Equal(t, []any{ev{"x", 0}, ev{"a", 1}, ev{"b", 1}, ev{"x", 1}, ev{"a", 2}, ev{"b", 2}, ev{"a", 3}},
		h.rec.handled())
}

// What the monitor cannot take, Submit refuses (the event stays the
// caller's), and Backoff, which has no caller to tell, hands to the drop
// handler.
func TestRefusedEventsStayTheCallersOrAreDropped(t *testing.T) {
	for _, tc := range []struct {
		name  string
		key   string
		event any
		end   func(*eventmonitor.Monitor)
		want  error
	}{
		{"empty key", "", ev{"", 1}, nil, eventmonitor.ErrInvalidEvent},
		{"nil event", "a", nil, nil, eventmonitor.ErrInvalidEvent},
		{"after Stop", "a", ev{"a", 1}, (*eventmonitor.Monitor).Stop, eventmonitor.ErrStopped},
		{"after Shutdown", "a", ev{"a", 1}, func(m *eventmonitor.Monitor) { _ = m.Shutdown(context.Background()) }, eventmonitor.ErrStopped},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			if tc.end != nil {
				tc.end(h.m)
			}
			require.ErrorIs(t, h.m.Submit(tc.key, tc.event), tc.want)
			h.settle(t)
			assert.Zero(t, h.m.Stats().Received, "a refused Submit is not received")
			assert.Empty(t, h.drops.list(), "the event stays the caller's: no drop")

			h.m.Backoff(tc.key, tc.event)
			drops := h.drops.list()
			require.Len(t, drops, 1)
			assert.ErrorIs(t, drops[0].Reason, tc.want)
			assert.Equal(t, tc.key, drops[0].Key)
			if tc.event != nil {
				assert.Equal(t, []any{tc.event}, drops[0].Events)
			}
			s := h.m.Stats()
			assert.Equal(t, [2]uint64{1, 1}, [2]uint64{s.Received, s.Dropped}, "a refused Backoff is received and dropped")
			assert.False(t, h.m.InBackoff(tc.key))
			assert.Empty(t, h.rec.log())
		})
	}
}

func TestSubmitIsRefusedOnceShutdownBegins(t *testing.T) {
	h := newHarness(t, nil)
	started, release := gateAll(t, h.rec, ev{"a", 1})
	h.submit(t, ev{"a", 1})
	awaitClosed(t, started[0], "a/1")
	done := make(chan error, 1)
	go func() { done <- h.m.Shutdown(context.Background()) }()
	var seq atomic.Int32
	waitFor(t, "Submit refused while Shutdown drains", func() bool {
		return errors.Is(h.m.Submit("b", ev{"b", int(seq.Add(1))}), eventmonitor.ErrStopped)
	})
	release[0]()
	require.NoError(t, <-done)
	assert.Len(t, h.rec.handled("b"), int(seq.Load())-1, "what Submit accepted was handled")
}

func TestBackoffMakesTheKeyWaitTheInitialDelay(t *testing.T) {
	for _, tc := range []struct {
		name     string
		queue    func(*testing.T, *harness) // a/1 then a/2, one of them by Backoff
		attempts int                        // Pending's, of a/1
	}{
		{"idle key", func(t *testing.T, h *harness) { h.m.Backoff("a", ev{"a", 1}); h.submit(t, ev{"a", 2}) }, 1},
		{"ready key", func(t *testing.T, h *harness) { h.submit(t, ev{"a", 1}); h.m.Backoff("a", ev{"a", 2}) }, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithBackoff(2*time.Second, time.Minute))
			started, release := gateAll(t, h.rec, ev{"x", 0}) // holds the one worker: a stays ready
			h.submit(t, ev{"x", 0})
			awaitClosed(t, started[0], "x/0")
			tc.queue(t, h)
			release[0]()
			h.settle(t)
			assert.True(t, h.m.InBackoff("a"))
			assert.Equal(t, eventmonitor.Pending{Key: "a", Events: evs("a", 1, 2), Attempts: tc.attempts, Due: epoch.Add(2 * time.Second)},
				h.pending("a"))
			h.step(t, 2*time.Second-time.Nanosecond)
			assert.Empty(t, h.rec.handled("a"), "a waits the initial delay")
			h.step(t, time.Nanosecond)
			assert.Equal(t, evs("a", 1, 2), h.rec.handled("a"))
			s := h.m.Stats()
			assert.Equal(t, [2]uint64{0, 1}, [2]uint64{s.Failed, s.Retried}, "failed, retried: the Backoff'd event's call is a retry")
		})
	}
}

func TestABackoffdEventCountsOneAttemptTowardsMaxAttempts(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithMaxAttempts(2))
	h.rec.fail(ev{"a", 1}, 100)
	h.m.Backoff("a", ev{"a", 1})
	h.step(t, time.Second)
	assert.Len(t, h.rec.log(), 1, "one handler call, then given up")
	require.ErrorIs(t, h.drops.reason(ev{"a", 1}), eventmonitor.ErrMaxAttempts)
}

func TestBackoffKeepsTheDueOfAWaitingKey(t *testing.T) {
	for _, tc := range []struct {
		name     string
		failures int             // of a/1: it waits 1 s, then 2 s more
		steps    []time.Duration // to when a/2 is given to Backoff
		due      time.Duration
	}{
		{"due sooner than the Backoff's", 1, []time.Duration{900 * time.Millisecond}, time.Second},
		{"due later than the Backoff's", 2, []time.Duration{time.Second, 500 * time.Millisecond}, 3 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.rec.fail(ev{"a", 1}, tc.failures)
			h.submit(t, ev{"a", 1})
			for _, d := range tc.steps {
				h.step(t, d)
			}
			h.m.Backoff("a", ev{"a", 2})
			p := h.pending("a")
			assert.Equal(t, evs("a", 1, 2), p.Events)
			assert.Equal(t, tc.failures, p.Attempts)
			assert.Equal(t, epoch.Add(tc.due), p.Due, "the key keeps its due time")
			h.step(t, epoch.Add(tc.due).Sub(h.clk.Now())-time.Nanosecond)
			assert.Empty(t, h.rec.handled("a"))
			h.step(t, time.Nanosecond)
			assert.Equal(t, evs("a", 1, 2), h.rec.handled("a"))
			assert.Equal(t, tc.due, h.rec.log()[len(h.rec.log())-1].At)
		})
	}
}

// Backoff during a key's call makes the key wait the initial delay from the
// Backoff once the call ends; if the call fails, the longer of the waits.
func TestBackoffDuringACallWaitsOnceTheCallEnds(t *testing.T) {
	for _, tc := range []struct {
		name   string
		fails  bool
		due    time.Duration
		events []any
	}{
		{"the call succeeds", false, time.Second, evs("a", 2)},
		{"the call fails", true, 1300 * time.Millisecond, evs("a", 1, 2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			if tc.fails {
				h.rec.fail(ev{"a", 1}, 1)
			}
			started, release := gateAll(t, h.rec, ev{"a", 1})
			h.submit(t, ev{"a", 1})
			awaitClosed(t, started[0], "a/1")
			h.m.Backoff("a", ev{"a", 2})
			assert.True(t, h.m.InBackoff("a"), "in backoff once its call ends")
			h.clk.Step(300 * time.Millisecond) // the call ends 300 ms after the Backoff
			release[0]()
			h.settle(t)
			assert.True(t, h.m.InBackoff("a"))
			p := h.pending("a")
			assert.Equal(t, tc.events, p.Events)
			assert.Equal(t, 1, p.Attempts)
			assert.Equal(t, epoch.Add(tc.due), p.Due)
			h.step(t, tc.due-300*time.Millisecond-time.Nanosecond)
			assert.Len(t, h.rec.log(), 1, "nothing handled before the due time")
			h.step(t, time.Nanosecond)
			assert.Equal(t, evs("a", 1, 2), h.rec.handled("a"))
		})
	}
}

func TestForgetReturnsTheQueuedEventsInOrder(t *testing.T) {
	h := newHarness(t, nil)
	h.rec.fail(ev{"a", 1}, 1)
	h.submit(t, ev{"a", 1}, ev{"a", 2}, ev{"a", 3}, ev{"b", 1})
	h.settle(t)
	require.True(t, h.m.InBackoff("a"))
	assert.Equal(t, evs("a", 1, 2, 3), h.m.Forget("a"))
	assert.Empty(t, h.m.Forget("a"), "nothing left")
	assert.Empty(t, h.m.Forget("nobody"))
	assert.False(t, h.m.InBackoff("a"), "the key left backoff")
	assert.Empty(t, h.m.Pending())
	s := h.m.Stats()
	assert.Equal(t, uint64(3), s.Forgotten)
	requireBalanced(t, s)
	h.step(t, time.Second)
	assert.Empty(t, h.rec.handled("a"), "a forgotten event is not retried")
	h.submit(t, ev{"a", 4})
	h.settle(t)
	assert.Equal(t, evs("a", 4), h.rec.handled("a"), "the key starts afresh, waiting for nothing")
}

func TestForgetLeavesTheCallInProgress(t *testing.T) {
	for _, tc := range []struct {
		name      string
		fails     bool
		backoff   bool // a/3 given to Backoff during the call
		forgotten []any
		pending   []any // a's backoff queue once the call ended
	}{
		{"the call succeeds", false, false, evs("a", 2), nil},
		{"the call fails and backs off", true, false, evs("a", 2), evs("a", 1)},
		{"after a Backoff during the call", false, true, evs("a", 2, 3), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			if tc.fails {
				h.rec.fail(ev{"a", 1}, 1)
			}
			started, release := gateAll(t, h.rec, ev{"a", 1})
			h.submit(t, ev{"a", 1}, ev{"a", 2})
			awaitClosed(t, started[0], "a/1")
			if tc.backoff {
				h.m.Backoff("a", ev{"a", 3})
			}
			assert.Equal(t, tc.forgotten, h.m.Forget("a"))
			assert.False(t, h.m.InBackoff("a"), "Forget takes the key out of backoff")
			release[0]()
			h.settle(t)
			assert.Equal(t, tc.pending, h.pending("a").Events)
			assert.Equal(t, tc.pending != nil, h.m.InBackoff("a"))
			h.step(t, time.Second)
			assert.Equal(t, evs("a", 1), h.rec.handled("a"), "the call went on; a failure is retried")
			requireBalanced(t, h.m.Stats())
		})
	}
}

func TestNewReportsEveryInvalidOption(t *testing.T) {
	bad := []struct {
		name string
		opt  eventmonitor.Option
	}{
		{"WithBackoff zero initial", eventmonitor.WithBackoff(0, time.Second)},
		{"WithBackoff initial above max", eventmonitor.WithBackoff(time.Minute, time.Second)},
		{"WithJitter negative", eventmonitor.WithJitter(-0.1)},
		{"WithJitter above 1", eventmonitor.WithJitter(1.5)},
		{"WithJitter NaN", eventmonitor.WithJitter(math.NaN())},
		{"WithWorkers 0", eventmonitor.WithWorkers(0)},
		{"WithWorkers 4097", eventmonitor.WithWorkers(4097)},
		{"WithHandleTimeout negative", eventmonitor.WithHandleTimeout(-time.Nanosecond)},
		{"WithMaxOverruns negative", eventmonitor.WithMaxOverruns(-1)},
		{"WithMaxAttempts negative", eventmonitor.WithMaxAttempts(-1)},
		{"WithMaxQueuedPerKey negative", eventmonitor.WithMaxQueuedPerKey(-1)},
		{"WithIntakeLimit 0", eventmonitor.WithIntakeLimit(0)},
		{"WithResubscribe zero initial", eventmonitor.WithResubscribe(0, time.Second)},
		{"WithResubscribe initial above max", eventmonitor.WithResubscribe(time.Minute, time.Second)},
		{"WithClock nil", eventmonitor.WithClock(nil)},
		{"WithClock typed nil", eventmonitor.WithClock((*testclock.FakeClock)(nil))},
		{"WithConverter typed nil", eventmonitor.WithConverter(eventmonitor.ConverterFunc(nil))},
		{"WithMetrics typed nil", eventmonitor.WithMetrics((*spyMetrics)(nil))},
		{"WithLogger nil", eventmonitor.WithLogger(nil)},
	}
	var all []eventmonitor.Option
	var messages []string
	seen := map[string]bool{}
	for _, tc := range bad {
		m, err := eventmonitor.New(nopHandler, tc.opt)
		require.ErrorIs(t, err, eventmonitor.ErrInvalidOption, tc.name)
		require.Nil(t, m, tc.name)
		if option := strings.Fields(tc.name)[0]; !seen[option] { // the last of an option wins: one of each
			seen[option] = true
			all, messages = append(all, tc.opt), append(messages, err.Error())
		}
	}
	_, err := eventmonitor.New(nopHandler, all...)
	require.ErrorIs(t, err, eventmonitor.ErrInvalidOption)
	for _, msg := range messages {
		assert.Contains(t, err.Error(), msg, "every invalid option is reported together")
	}

	m, err := eventmonitor.New(nopHandler, eventmonitor.WithBackoff(time.Second, time.Second), eventmonitor.WithJitter(1),
		eventmonitor.WithWorkers(4096), eventmonitor.WithHandleTimeout(0), eventmonitor.WithMaxOverruns(0),
		eventmonitor.WithMaxAttempts(0), eventmonitor.WithMaxQueuedPerKey(0), eventmonitor.WithIntakeLimit(1),
		eventmonitor.WithResubscribe(time.Second, time.Second))
	require.NoError(t, err, "the bounds themselves are valid")
	m.Stop()
	m, err = eventmonitor.New(nopHandler, eventmonitor.WithJitter(0), eventmonitor.WithWorkers(1))
	require.NoError(t, err)
	m.Stop()
}

func TestNewRefusesANilHandler(t *testing.T) {
	for name, h := range map[string]eventmonitor.Handler{
		"nil":              nil,
		"HandlerFunc(nil)": eventmonitor.HandlerFunc(nil),
		"(*Mux)(nil)":      (*eventmonitor.Mux)(nil),
	} {
		m, err := eventmonitor.New(h)
		assert.ErrorIs(t, err, eventmonitor.ErrInvalidOption, name)
		assert.Nil(t, m, name)
	}
}

func TestMustNewPanicsOnInvalidOptions(t *testing.T) {
	var recovered any
	func() {
		defer func() { recovered = recover() }()
		eventmonitor.MustNew(nopHandler, eventmonitor.WithWorkers(0))
	}()
	err, ok := recovered.(error)
	require.True(t, ok, "MustNew panics with New's error, got %v", recovered)
	require.ErrorIs(t, err, eventmonitor.ErrInvalidOption)

	clk := testclock.NewFakeClock(epoch)
	r := newRecorder(clk)
	m := eventmonitor.MustNew(r, eventmonitor.WithClock(clk), eventmonitor.WithWorkers(2))
	defer m.Stop()
	require.NoError(t, m.Submit("a", ev{"a", 1}))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, m.WaitIdle(ctx))
	assert.Equal(t, evs("a", 1), r.handled())
}

type probeKey struct{}

func TestKeyFromContextNamesTheKeyBeingHandled(t *testing.T) {
	var mu sync.Mutex
	seen := map[string][2]string{} // event key: the ctx's and a derived ctx's
	h := newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		derived, cancel := context.WithTimeout(context.WithValue(ctx, probeKey{}, 1), time.Hour)
		defer cancel()
		mu.Lock()
		defer mu.Unlock()
		seen[e.(ev).Key] = [2]string{eventmonitor.KeyFromContext(ctx), eventmonitor.KeyFromContext(derived)}
		return nil
	}), eventmonitor.WithWorkers(4))
	for i := range 8 {
		h.submit(t, ev{fmt.Sprintf("k%d", i), i})
	}
	h.settle(t)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, seen, 8)
	for key, got := range seen {
		assert.Equal(t, [2]string{key, key}, got)
	}
	assert.Empty(t, eventmonitor.KeyFromContext(context.Background()), "outside a handler call")
}

func TestAHandlersLogLinesCarryItsKey(t *testing.T) {
	h := newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		log.G(ctx).WithField("seq", e.(ev).Seq).Info("handling")
		derived, cancel := context.WithCancel(ctx)
		defer cancel()
		log.G(derived).WithField("seq", e.(ev).Seq).Info("handling, derived")
		return nil
	}), eventmonitor.WithWorkers(2))
	h.submit(t, ev{"c1", 1}, ev{"c2", 2})
	h.settle(t)
	want := map[int]string{1: "c1", 2: "c2"}
	n := 0
	for _, e := range h.logs.AllEntries() {
		if e.Message == "handling" || e.Message == "handling, derived" {
			n++
			assert.Equal(t, want[e.Data["seq"].(int)], e.Data["key"], "%s: %v", e.Message, e.Data)
		}
	}
	assert.Equal(t, 4, n)
}

func TestAHandlerPanicOrGoexitFailsItsEvent(t *testing.T) {
	for name, fail := range map[string]func(){
		"panic":            func() { panic("boom") },
		"runtime.Goexit":   runtime.Goexit, // as t.FailNow does
		"panic with error": func() { panic(errors.New("boom")) },
	} {
		t.Run(name, func(t *testing.T) {
			var mu sync.Mutex
			calls := map[any]int{}
			h := newHarness(t, eventmonitor.HandlerFunc(func(_ context.Context, e any) error {
				mu.Lock()
				calls[e]++
				first := calls[e] == 1
				mu.Unlock()
				if first && e == (ev{"a", 1}) {
					fail()
				}
				return nil
			})) // one worker: b/1 needs it after a/1's call
			h.submit(t, ev{"a", 1}, ev{"b", 1})
			h.settle(t)
			s := h.m.Stats()
			assert.Equal(t, [2]uint64{1, 1}, [2]uint64{s.Failed, s.Handled}, "failed, handled (b/1, on the same worker slot)")
			assert.Equal(t, 1, h.pending("a").Attempts, "a/1 backs off")
			h.step(t, time.Second)
			s = h.m.Stats()
			assert.Equal(t, [2]uint64{2, 1}, [2]uint64{s.Handled, s.Retried}, "handled, retried")
			mu.Lock()
			defer mu.Unlock()
			assert.Equal(t, 2, calls[ev{"a", 1}])
		})
	}
}

// The identity Received = Filtered + Ignored + Handled + Dropped + Forgotten +
// Queued + EventsInBackoff + InFlight holds in every snapshot.
func TestStatsAccountForEveryEvent(t *testing.T) {
	var rec *recorder
	h := newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		if _, ok := e.(string); ok {
			return fmt.Errorf("%w: a string", eventmonitor.ErrUnsupportedEvent)
		}
		return rec.HandleEvent(ctx, e)
	}), eventmonitor.WithWorkers(2), eventmonitor.WithMaxAttempts(2))
	rec = h.rec
	done, sampled := make(chan struct{}), make(chan int)
	go func() {
		n := 0
		defer func() { sampled <- n }()
		for {
			if s := h.m.Stats(); s.Received != s.Filtered+s.Ignored+s.Handled+s.Dropped+s.Forgotten+
				uint64(s.Queued+s.EventsInBackoff+s.InFlight) {
				t.Errorf("Stats identity: %+v", s)
				return
			}
			n++
			select {
			case <-done:
				return
			default:
				runtime.Gosched()
			}
		}
	}()
	started, release := gateAll(t, h.rec, ev{"g", 1})
	h.rec.fail(ev{"b", 1}, 5)
	h.rec.fail(ev{"c", 1}, 1)
	h.submit(t, ev{"g", 1})
	awaitClosed(t, started[0], "g/1")
	h.submit(t, ev{"a", 1}, ev{"a", 2}, ev{"b", 1}, ev{"c", 1})
	require.NoError(t, h.m.Submit("i", "ignored"))
	h.m.Backoff("d", ev{"d", 1})
	h.submit(t, ev{"d", 2})
	waitFor(t, "a, b, c and i on the free worker", func() bool {
		s := h.m.Stats()
		return s.Handled == 2 && s.Failed == 2 && s.Ignored == 1
	})
	requireBalanced(t, h.m.Stats())
	assert.Equal(t, evs("d", 1, 2), h.m.Forget("d"))
	release[0]()
	h.step(t, time.Second) // c/1 succeeds, b/1 fails its second attempt: dropped
	close(done)
	assert.Positive(t, <-sampled)
	assert.Equal(t, eventmonitor.Stats{Received: 8, Ignored: 1, Handled: 4, Failed: 3, Retried: 2, Dropped: 1, Forgotten: 2},
		h.m.Stats())
}

// WithMaxQueuedPerKey(n) counts the running call's event: a key never holds
// more than n events, not even once its call fails and its event goes back.
func TestQueueBoundCountsTheCallInProgress(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithMaxQueuedPerKey(2))
	h.rec.fail(ev{"a", 1}, 1)
	started, release := gateAll(t, h.rec, ev{"a", 1})
	h.submit(t, ev{"a", 1})
	awaitClosed(t, started[0], "a/1")
	require.NoError(t, h.m.Submit("a", ev{"a", 2}))
	require.ErrorIs(t, h.m.Submit("a", ev{"a", 3}), eventmonitor.ErrQueueFull, "a/1 in its call and a/2 fill the bound")
	h.m.Backoff("a", ev{"a", 4})
	require.ErrorIs(t, h.drops.reason(ev{"a", 4}), eventmonitor.ErrQueueFull)
	release[0]()
	h.settle(t)
	assert.Equal(t, evs("a", 1, 2), h.pending("a").Events, "a/1 failed: the key holds 2")
	require.ErrorIs(t, h.m.Submit("a", ev{"a", 5}), eventmonitor.ErrQueueFull)
	require.NoError(t, h.m.Submit("b", ev{"b", 1}), "the bound is per key")
	h.step(t, time.Second)
	assert.Equal(t, evs("a", 1, 2), h.rec.handled("a"))
	requireBalanced(t, h.m.Stats())
}
