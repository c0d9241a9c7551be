package eventmonitor_test

// Stop, Shutdown and WaitIdle: what they wait for, what they abandon, what
// they hand to the drop handler, and that every event ends exactly once.

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/eventmonitor/eventmonitor"
)

// stopExit is an exit status WatchExit reads.
type stopExit struct{}

func (stopExit) Result() (uint32, time.Time, error) { return 0, epoch, nil }

// stopBegan closes once Stop (or Shutdown's stop) began: a watcher's
// channel with no exit closes then.
func stopBegan(m *eventmonitor.Monitor) <-chan struct{} {
	return eventmonitor.WatchExit(context.Background(), m, "stop-probe", make(chan stopExit),
		func(uint32, time.Time) any { return "never" })
}

// stopAsync runs fn in a goroutine; the channel closes when fn returned.
func stopAsync(fn func()) <-chan struct{} {
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	return done
}

// stopShutdown runs m.Shutdown(ctx) in a goroutine; wait returns its error.
func stopShutdown(t *testing.T, m *eventmonitor.Monitor, ctx context.Context) (wait func() error) {
	var err error
	done := stopAsync(func() { err = m.Shutdown(ctx) })
	return func() error { t.Helper(); awaitClosed(t, done, "Shutdown"); return err }
}

// stopRequireDropped checks that each event reached the drop handler with
// ErrStopped.
func stopRequireDropped(t *testing.T, h *harness, events ...any) {
	t.Helper()
	for _, e := range events {
		require.ErrorIs(t, h.drops.reason(e), eventmonitor.ErrStopped, "%v dropped with ErrStopped", e)
	}
}

// stopRequireDone checks that s holds nothing queued, waiting or running.
func stopRequireDone(t *testing.T, s eventmonitor.Stats) {
	t.Helper()
	requireBalanced(t, s)
	require.Zero(t, s.Queued+s.EventsInBackoff+s.KeysInBackoff+s.InFlight, "%+v", s)
}

type stopMetrics struct{ done, recovered, dropped atomic.Int32 }

func (m *stopMetrics) HandlerDone(time.Duration, error) { m.done.Add(1) }
func (m *stopMetrics) Recovered(time.Duration)          { m.recovered.Add(1) }
func (m *stopMetrics) Dropped(error, int)               { m.dropped.Add(1) }

// stopBlockHook holds the first log line with msg until release closes.
type stopBlockHook struct {
	msg              string
	once             sync.Once
	blocked, release chan struct{}
}

func (h *stopBlockHook) Levels() []logrus.Level { return logrus.AllLevels }
func (h *stopBlockHook) Fire(e *logrus.Entry) error {
	if e.Message == h.msg {
		h.once.Do(func() { close(h.blocked); <-h.release })
	}
	return nil
}

func TestStopCancelsCallsInProgressAndWaitsForThem(t *testing.T) {
	release, cancelled := make(chan struct{}), make(chan error, 2)
	unblock := sync.OnceFunc(func() { close(release) })
	defer unblock()
	h := newHarness(t, eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		<-ctx.Done()
		cancelled <- ctx.Err()
		<-release
		if e == "fails" {
			return ctx.Err()
		}
		return nil
	}), eventmonitor.WithWorkers(2))
	h.submit(t, "ok", "fails")
	waitFor(t, "both calls", func() bool { return h.m.Stats().InFlight == 2 })
	stopped := stopAsync(h.m.Stop)
	for range 2 {
		select {
		case err := <-cancelled:
			require.Equal(t, context.Canceled, err)
		case <-time.After(10 * time.Second):
			t.Fatal("Stop did not cancel the calls in progress")
		}
	}
	select {
	case <-stopped:
		t.Fatal("Stop returned while its calls ran")
	default:
	}
	unblock()
	awaitClosed(t, stopped, "Stop")
	s := h.m.Stats()
	require.Equal(t, [2]uint64{1, 1}, [2]uint64{s.Handled, s.Dropped}, "ok handled, fails dropped: %+v", s)
	stopRequireDropped(t, h, "fails")
	stopRequireDone(t, s)
}

func TestStopDropsWhatIsLeftWithErrStopped(t *testing.T) {
	sub := newFakeSubscriber(8)
	h := newHarness(t, nil, eventmonitor.WithConverter(keyConverter), eventmonitor.WithBackoff(time.Hour, time.Hour))
	runMonitor(t, h.m, sub)
	st := sub.next(t)
	started, release := h.rec.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1})
	awaitClosed(t, started, "a/1 starts")
	h.submit(t, ev{"a", 2}, ev{"b", 1}, ev{"a", 3})
	h.m.Backoff("c", ev{"c", 1})
	h.submit(t, ev{"c", 2})
	received := func(n uint64) {
		waitFor(t, "envelopes received", func() bool { return h.m.Stats().Received == n })
	}
	other := envelope(t, "ns2", "s")
	other.Topic = "/other"
	for _, env := range []*eventmonitor.Envelope{envelope(t, "ns1", "s"), envelope(t, "ns1", "s"), envelope(t, "ns2", "s"), other} {
		st.ch <- env
	}
	received(10)
	h.submit(t, ev{"s", 1})

	began := stopBegan(h.m)
	stopped := stopAsync(h.m.Stop)
	awaitClosed(t, began, "Stop begins")
	release()
	awaitClosed(t, stopped, "Stop")
	require.Equal(t, evs("a", 1), h.rec.handled(), "the call in progress completes")

	type run struct {
		topic, ns string
		events    int
	}
	events, runs := map[string][]any{}, map[string][]run{}
	for _, d := range h.drops.list() {
		require.ErrorIs(t, d.Reason, eventmonitor.ErrStopped)
		events[d.Key] = append(events[d.Key], d.Events...)
		runs[d.Key] = append(runs[d.Key], run{d.Topic, d.Namespace, len(d.Events)})
	}
	require.Equal(t, evs("a", 2, 3), events["a"])
	require.Equal(t, evs("b", 1), events["b"])
	require.Equal(t, evs("c", 1, 2), events["c"], "the backoff queue, in order")
	require.Equal(t, []run{{"/test", "ns1", 2}, {"/test", "ns2", 1}, {"/other", "ns2", 1}, {"", "", 1}}, runs["s"],
		"one Drop per run of one origin")
	require.Equal(t, ev{"s", 1}, events["s"][4])
	require.Len(t, events, 4)
	s := h.m.Stats()
	require.Equal(t, [2]uint64{1, 10}, [2]uint64{s.Handled, s.Dropped})
	stopRequireDone(t, s)
}

// Stop and Shutdown abandon a call that ignores its ctx once it overruns;
// its late return reports nothing, and its key's next event is dropped,
// never handed to the handler. Shutdown drains p meanwhile.
func TestStopAbandonsAnOverrunningCall(t *testing.T) {
	for _, via := range []string{"Stop", "Shutdown"} {
		for _, from := range []string{"Submit", "WatchExit"} {
			t.Run(via+" "+from, func(t *testing.T) {
				before := goleak.IgnoreCurrent()
				mt := &stopMetrics{}
				h := newHarness(t, nil, eventmonitor.WithHandleTimeout(10*time.Second), eventmonitor.WithMetrics(mt),
					eventmonitor.WithBackoff(time.Hour, time.Hour))
				started, release := h.rec.gate(ev{"a", 1}) // ignores its ctx
				defer release()
				if from == "WatchExit" { // an exit of an idle key is handled on its watcher
					exits := make(chan stopExit, 1)
					exits <- stopExit{}
					eventmonitor.WatchExit(context.Background(), h.m, "a", exits, func(uint32, time.Time) any { return ev{"a", 1} })
				} else {
					h.submit(t, ev{"a", 1})
				}
				awaitClosed(t, started, "a/1 starts")
				h.submit(t, ev{"a", 2})
				schedArmed(t, h)
				h.clk.Step(11*time.Second - time.Nanosecond) // past its deadline, within the grace
				schedArmed(t, h)
				h.m.Backoff("p", ev{"p", 1}) // Shutdown retries it at once
				var err error
				began := stopBegan(h.m)
				done := stopAsync(func() {
					if via == "Stop" {
						h.m.Stop()
					} else {
						err = h.m.Shutdown(context.Background())
					}
				})
				if via == "Stop" {
					awaitClosed(t, began, "Stop begins")
				} else {
					waitFor(t, "Shutdown begins", func() bool { return !h.m.InBackoff("p") })
				}
				select {
				case <-done:
					t.Fatalf("%s returned within the grace", via)
				default:
				}
				h.clk.Step(time.Nanosecond)
				awaitClosed(t, done, via)
				require.NoError(t, err)
				stopRequireDropped(t, h, ev{"a", 1}, ev{"a", 2})
				handled := uint64(0) // p's
				if via == "Shutdown" {
					handled = 1
				}
				s := h.m.Stats()
				require.Equal(t, [2]uint64{handled, 3 - handled}, [2]uint64{s.Handled, s.Dropped})
				stopRequireDone(t, s)

				release()
				require.NoError(t, goleak.Find(before), "the abandoned call's goroutine returns")
				require.Equal(t, s, h.m.Stats(), "the late return is not counted")
				require.Zero(t, schedCalls(h, ev{"a", 2}), "a/2 was handed to the handler")
				require.Equal(t, [3]int32{int32(handled), int32(handled), int32(3 - handled)},
					[3]int32{mt.done.Load(), mt.recovered.Load(), mt.dropped.Load()},
					"Metrics: HandlerDone for p's call only, a Drop each for a/1, a/2 and maybe p")
				require.False(t, h.logged(schedLateLine, "a"), "the abandoned call's return is logged")
			})
		}
	}
}

// A call a worker took, but whose handler had not begun when the stop
// abandoned it, is withdrawn: its event is dropped and its handler never
// runs. That is a first attempt whose worker had not run yet, or a retry
// whose worker a log hook holds in its log line.
func TestAWithdrawnCallIsNeverInvoked(t *testing.T) {
	t.Run("a first attempt whose worker has not run yet", func(t *testing.T) {
		// One P keeps the workers Shutdown's drain starts from running
		// before its ended ctx abandons their calls.
		defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
		for i := range 20 {
			before := goleak.IgnoreCurrent()
			h := newHarness(t, nil, eventmonitor.WithDeferredStart(), eventmonitor.WithWorkers(4))
			all := []any{ev{"a", i}, ev{"b", i}, ev{"c", i}, ev{"d", i}}
			h.submit(t, all...)
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			require.ErrorIs(t, h.m.Shutdown(ctx), context.Canceled)
			stopRequireDropped(t, h, all...)
			require.NoError(t, goleak.Find(before))
			require.Empty(t, h.rec.log(), "the handler ran for events Shutdown dropped")
			s := h.m.Stats()
			require.Equal(t, [2]uint64{0, 4}, [2]uint64{s.Handled, s.Dropped})
		}
	})
	for _, how := range []string{"Shutdown's ctx ended", "overran while Stop waits"} {
		t.Run(how, func(t *testing.T) {
			hook := &stopBlockHook{msg: "retrying backed-off events", blocked: make(chan struct{}), release: make(chan struct{})}
			unblock := sync.OnceFunc(func() { close(hook.release) })
			defer unblock()
			l := logrus.New()
			l.SetOutput(io.Discard)
			l.AddHook(hook)
			before := goleak.IgnoreCurrent()
			h := newHarness(t, nil, eventmonitor.WithLogger(logrus.NewEntry(l)))
			h.m.Backoff("a", ev{"a", 1})
			h.settle(t)
			h.clk.Step(time.Second)
			awaitClosed(t, hook.blocked, "the retry's log line")
			if how == "Shutdown's ctx ended" {
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				require.ErrorIs(t, h.m.Shutdown(ctx), context.Canceled)
			} else {
				stopped := stopAsync(h.m.Stop)
				schedArmed(t, h)
				h.clk.Step(11 * time.Second) // the deadline and the grace
				awaitClosed(t, stopped, "Stop")
			}
			stopRequireDropped(t, h, ev{"a", 1})
			unblock()
			require.NoError(t, goleak.Find(before))
			require.Empty(t, h.rec.log(), "the withdrawn call's handler ran")
			s := h.m.Stats()
			require.Equal(t, [2]uint64{0, 1}, [2]uint64{s.Handled, s.Dropped})
			stopRequireDone(t, s)
		})
	}
}

// A Stop does not return while another Stop still hands over the drop of a
// call it abandoned.
func TestAStopWaitsForAnotherStopsAbandonedDrop(t *testing.T) {
	dropping, letDrop := make(chan struct{}), make(chan struct{})
	release := sync.OnceFunc(func() { close(letDrop) })
	defer release()
	var h *harness
	h = newHarness(t, nil, eventmonitor.WithDropHandler(func(d eventmonitor.Drop) {
		if len(d.Events) == 1 && d.Events[0] == (ev{"a", 1}) {
			close(dropping)
			<-letDrop
		}
		h.drops.add(d)
	}))
	started, unblock := h.rec.gate(ev{"a", 1}) // ignores its ctx: overruns
	defer unblock()
	h.submit(t, ev{"a", 1})
	awaitClosed(t, started, "a/1 starts")
	began := stopBegan(h.m)
	first := stopAsync(h.m.Stop)
	awaitClosed(t, began, "the first Stop begins")
	schedArmed(t, h)
	h.clk.Step(11 * time.Second) // the deadline and the grace: the first Stop abandons a/1
	awaitClosed(t, dropping, "the abandoned call's drop")
	second := stopAsync(h.m.Stop)
	require.Never(t, func() bool {
		select {
		case <-second:
			return true
		default:
			return false
		}
	}, 100*time.Millisecond, time.Millisecond, "the second Stop returned while the first still hands over its drop")
	release()
	awaitClosed(t, first, "the first Stop")
	awaitClosed(t, second, "the second Stop")
	stopRequireDropped(t, h, ev{"a", 1})
}

// Stops and Shutdowns at once each return only once the stop is done, its
// drops delivered (here the first drop waits meanwhile).
func TestStopIsIdempotentAndSafeForConcurrentUse(t *testing.T) {
	var h *harness
	var first sync.Once
	dropping, drop := make(chan struct{}), make(chan struct{})
	letDrop := sync.OnceFunc(func() { close(drop) })
	defer letDrop()
	h = newHarness(t, nil, eventmonitor.WithWorkers(2), eventmonitor.WithDropHandler(func(d eventmonitor.Drop) {
		h.drops.add(d)
		first.Do(func() { close(dropping); <-drop })
	}))
	started, release := h.rec.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1})
	awaitClosed(t, started, "a/1 starts")
	all := []any{ev{"a", 1}, ev{"a", 2}, ev{"b", 1}, ev{"a", 3}, ev{"b", 2}, ev{"c", 1}}
	h.submit(t, all[1:5]...)
	h.m.Backoff("c", ev{"c", 1})
	began := stopBegan(h.m)
	var returned atomic.Int32
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for i := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				h.m.Stop()
			} else {
				errs <- h.m.Shutdown(context.Background())
			}
			returned.Add(1)
			if s := h.m.Stats(); s.Queued+s.EventsInBackoff+s.InFlight != 0 || uint64(len(h.drops.events())) != s.Dropped {
				t.Errorf("returned before the stop was done: %+v, %d events dropped", s, len(h.drops.events()))
			}
		}()
	}
	awaitClosed(t, began, "a Stop begins")
	require.Zero(t, returned.Load(), "returned while a/1 ran")
	release()
	awaitClosed(t, dropping, "the stop's first drop")
	require.Never(t, func() bool { return returned.Load() > 0 }, 50*time.Millisecond, time.Millisecond,
		"returned while the stop's drops were delivered")
	letDrop()
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	seen := map[any]int{}
	for _, e := range append(h.rec.handled(), h.drops.events()...) {
		seen[e]++
	}
	for _, e := range all {
		require.Equal(t, 1, seen[e], "%v handled or dropped once", e)
	}
	stopRequireDone(t, h.m.Stats())
	h.m.Stop()
	require.NoError(t, h.m.Shutdown(context.Background()))
}

func TestAfterStopIntakeIsRefused(t *testing.T) {
	for _, via := range []string{"Stop", "Shutdown"} {
		t.Run(via, func(t *testing.T) {
			h := newHarness(t, nil)
			h.submit(t, ev{"a", 1})
			h.settle(t)
			if via == "Stop" {
				h.m.Stop()
			} else {
				require.NoError(t, h.m.Shutdown(context.Background()))
			}
			require.ErrorIs(t, h.m.Submit("a", ev{"a", 2}), eventmonitor.ErrStopped)
			h.m.Backoff("b", ev{"b", 1})
			drops := h.drops.list()
			require.Len(t, drops, 1)
			require.Equal(t, eventmonitor.Drop{Key: "b", Events: evs("b", 1), Reason: drops[0].Reason}, drops[0])
			require.ErrorIs(t, drops[0].Reason, eventmonitor.ErrStopped)
			require.False(t, h.m.InBackoff("b"))
			require.Empty(t, h.m.Pending())
			s := h.m.Stats()
			require.Equal(t, [3]uint64{2, 1, 1}, [3]uint64{s.Received, s.Handled, s.Dropped}, "%+v", s)
			stopRequireDone(t, s)
		})
	}
}

// Stop waits for every goroutine of the monitor: the scheduler, the stream
// reader, exit watchers and calls.
func TestNoGoroutineOutlivesStop(t *testing.T) {
	before := goleak.IgnoreCurrent()
	sub := newFakeSubscriber(1)
	h := newHarness(t, nil, eventmonitor.WithConverter(keyConverter), eventmonitor.WithWorkers(3))
	var runErr error
	ran := stopAsync(func() { runErr = h.m.Run(context.Background(), sub) })
	sub.next(t).ch <- envelope(t, "ns", "s")
	h.m.Backoff("b", ev{"b", 1}) // the scheduler times it
	started, release := h.rec.gate(ev{"c", 1})
	defer release()
	h.submit(t, ev{"c", 1})
	awaitClosed(t, started, "c/1 starts")
	watched := eventmonitor.WatchExit(context.Background(), h.m, "d", make(chan stopExit), func(uint32, time.Time) any { return "d" })
	waitFor(t, "the envelope", func() bool { return h.m.Stats().Received == 3 })
	stopped := stopAsync(h.m.Stop)
	awaitClosed(t, watched, "the watcher ends as Stop begins")
	release()
	awaitClosed(t, stopped, "Stop")
	awaitClosed(t, ran, "Run")
	require.ErrorIs(t, runErr, eventmonitor.ErrStopped)
	require.NoError(t, goleak.Find(before))
	stopRequireDone(t, h.m.Stats())
}

// Shutdown handles what is queued and retries every key in backoff at once,
// not when due, on a running monitor and on one held until then.
func TestShutdownHandlesEverythingQueuedAndRetriesBackoffAtOnce(t *testing.T) {
	for _, held := range []bool{false, true} {
		t.Run(fmt.Sprint("held=", held), func(t *testing.T) {
			opts := []eventmonitor.Option{eventmonitor.WithBackoff(time.Hour, time.Hour)}
			if held {
				opts = append(opts, eventmonitor.WithDeferredStart())
			}
			h := newHarness(t, nil, opts...)
			release := func() {}
			defer func() { release() }()
			if held {
				h.submit(t, ev{"a", 1})
				h.m.Backoff("d", ev{"d", 1})
			} else {
				h.rec.fail(ev{"d", 1}, 1)
				h.submit(t, ev{"d", 1})
				h.settle(t) // d waits an hour
				var started <-chan struct{}
				started, release = h.rec.gate(ev{"a", 1})
				h.submit(t, ev{"a", 1})
				awaitClosed(t, started, "a/1 starts")
			}
			h.submit(t, ev{"d", 2}, ev{"a", 2}, ev{"b", 1})
			h.m.Backoff("c", ev{"c", 1})
			shut := stopShutdown(t, h.m, context.Background())
			waitFor(t, "Shutdown retries c at once", func() bool { return !h.m.InBackoff("c") })
			require.ErrorIs(t, h.m.Submit("e", ev{"e", 1}), eventmonitor.ErrStopped, "intake while Shutdown drains")
			h.m.Backoff("f", ev{"f", 1})
			release()
			require.NoError(t, shut())

			require.Equal(t, evs("a", 1, 2), h.rec.handled("a"))
			require.Equal(t, evs("d", 1, 2), h.rec.handled("d"))
			require.ElementsMatch(t, []any{ev{"a", 1}, ev{"a", 2}, ev{"b", 1}, ev{"c", 1}, ev{"d", 1}, ev{"d", 2}}, h.rec.handled())
			for _, c := range h.rec.log() {
				require.Zero(t, c.At, "%v waited for the clock", c.Event)
			}
			require.Equal(t, []any{ev{"f", 1}}, h.drops.events())
			stopRequireDropped(t, h, ev{"f", 1})
			stopRequireDone(t, h.m.Stats())
		})
	}
}

func TestShutdownDropsAnEventThatFailsDuringTheDrain(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithBackoff(time.Hour, time.Hour))
	h.rec.fail(ev{"a", 1}, 100)
	h.submit(t, ev{"a", 1})
	h.settle(t) // a/1 waits an hour
	started, release := h.rec.gate(ev{"x", 1})
	defer release()
	h.submit(t, ev{"x", 1})
	awaitClosed(t, started, "x/1 starts")
	h.rec.fail(ev{"b", 1}, 1)
	h.submit(t, ev{"a", 2}, ev{"b", 1}, ev{"b", 2})
	shut := stopShutdown(t, h.m, context.Background())
	waitFor(t, "Shutdown retries a at once", func() bool { return !h.m.InBackoff("a") })
	release()
	require.NoError(t, shut())
	stopRequireDropped(t, h, ev{"a", 1}, ev{"b", 1})
	require.Len(t, h.drops.events(), 2)
	require.ElementsMatch(t, []any{ev{"x", 1}, ev{"a", 2}, ev{"b", 2}}, h.rec.handled(), "their keys move on")
	s := h.m.Stats()
	require.EqualValues(t, 3, s.Failed, "a/1 twice, b/1 once: no retry during the drain")
	stopRequireDone(t, s)
}

func TestShutdownWhoseCtxEndsFirstAbandonsEveryCall(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout time.Duration // real time
		cancel  string        // "before" Shutdown, "while" it drains, or not
		want    error
	}{
		{"ended before", time.Hour, "before", context.Canceled},
		{"cancelled while it drains", time.Hour, "while", context.Canceled},
		{"deadline while it drains", 20 * time.Millisecond, "", context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := goleak.IgnoreCurrent()
			h := newHarness(t, nil, eventmonitor.WithBackoff(time.Hour, time.Hour))
			h.m.Backoff("c", ev{"c", 1})
			started, release := h.rec.gate(ev{"a", 1}) // ignores its ctx
			defer release()
			h.submit(t, ev{"a", 1})
			awaitClosed(t, started, "a/1 starts")
			h.submit(t, ev{"a", 2}, ev{"b", 1})
			ctx, cancel := context.WithTimeout(context.Background(), tc.timeout)
			defer cancel()
			if tc.cancel == "before" {
				cancel()
			}
			shut := stopShutdown(t, h.m, ctx)
			if tc.cancel == "while" {
				waitFor(t, "Shutdown drains", func() bool { return !h.m.InBackoff("c") })
				cancel()
			}
			require.ErrorIs(t, shut(), tc.want)
			stopRequireDropped(t, h, ev{"a", 1}, ev{"a", 2}, ev{"b", 1}, ev{"c", 1})
			s := h.m.Stats()
			require.Equal(t, [2]uint64{0, 4}, [2]uint64{s.Handled, s.Dropped})
			stopRequireDone(t, s)
			release()
			require.NoError(t, goleak.Find(before))
			require.Len(t, h.rec.log(), 1, "only a/1 was handed to the handler")
			require.Equal(t, s, h.m.Stats())
		})
	}
}

// Once nothing but an overrunning call can move, Shutdown stops: the stuck
// call does not hold the drain up, nor does the key waiting behind it.
func TestShutdownIsNotHeldUpByAStuckCall(t *testing.T) {
	for _, tc := range []struct {
		name     string
		overruns int
		handled  bool // o/1, on a replacement worker
	}{
		{"its worker replaced", 64, true},
		{"WithMaxOverruns(0)", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, eventmonitor.WithHandleTimeout(time.Second), eventmonitor.WithMaxOverruns(tc.overruns))
			started, release := h.rec.gate(ev{"s", 1})
			defer release()
			h.submit(t, ev{"s", 1})
			awaitClosed(t, started, "s/1 starts")
			h.submit(t, ev{"s", 2}, ev{"o", 1})
			schedArmed(t, h)
			shut := stopShutdown(t, h.m, context.Background())
			h.clk.Step(1100 * time.Millisecond)
			require.NoError(t, shut())
			stopRequireDropped(t, h, ev{"s", 1}, ev{"s", 2})
			if tc.handled {
				require.Equal(t, evs("o", 1), h.rec.handled())
			} else {
				stopRequireDropped(t, h, ev{"o", 1})
			}
			stopRequireDone(t, h.m.Stats())
		})
	}
}

func TestShutdownWhileAStopWaitsHonoursItsCtx(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithHandleTimeout(0)) // Stop waits as long as the handler
	started, release := h.rec.gate(ev{"a", 1})
	defer release()
	h.submit(t, ev{"a", 1})
	awaitClosed(t, started, "a/1 starts")
	began := stopBegan(h.m)
	stopped := stopAsync(h.m.Stop)
	awaitClosed(t, began, "Stop begins")
	ctx, cancel := context.WithCancel(context.Background())
	shut := stopShutdown(t, h.m, ctx)
	cancel()
	require.ErrorIs(t, shut(), context.Canceled)
	awaitClosed(t, stopped, "Stop, once Shutdown abandoned the call")
	stopRequireDropped(t, h, ev{"a", 1})
	stopRequireDone(t, h.m.Stats())
}

func TestWaitIdleReturnsOnceTheMonitorIsIdle(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []eventmonitor.Option
		run  func(t *testing.T, h *harness) (check func())
	}{
		{"a call returns", nil, func(t *testing.T, h *harness) func() {
			started, release := h.rec.gate(ev{"a", 1})
			h.submit(t, ev{"a", 1})
			awaitClosed(t, started, "a/1 starts")
			go release()
			return func() { require.Equal(t, evs("a", 1), h.rec.handled()) }
		}},
		{"a retry due after a step of the clock", nil, func(t *testing.T, h *harness) func() {
			h.m.Backoff("a", ev{"a", 1})
			h.settle(t)
			h.clk.Step(time.Second)
			return func() { require.Equal(t, evs("a", 1), h.rec.handled()) }
		}},
		{"a held monitor with events queued", []eventmonitor.Option{eventmonitor.WithDeferredStart()}, func(t *testing.T, h *harness) func() {
			h.submit(t, ev{"a", 1}, ev{"b", 1})
			return func() { require.Equal(t, [2]int{0, 2}, [2]int{len(h.rec.log()), h.m.Stats().Queued}) }
		}},
		{"after Stop", nil, func(t *testing.T, h *harness) func() {
			h.m.Backoff("a", ev{"a", 1})
			h.m.Stop()
			return func() { stopRequireDropped(t, h, ev{"a", 1}) }
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, tc.opts...)
			check := tc.run(t, h)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			require.NoError(t, h.m.WaitIdle(ctx))
			check()
		})
	}
}

func TestWaitIdleReturnsCtxErrorWhileBusy(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout time.Duration // real time; an hour: cancelled first
		want    error
	}{
		{"cancelled", time.Hour, context.Canceled},
		{"deadline", 20 * time.Millisecond, context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			started, release := h.rec.gate(ev{"a", 1})
			defer release()
			h.submit(t, ev{"a", 1}, ev{"b", 1})
			awaitClosed(t, started, "a/1 starts")
			ctx, cancel := context.WithTimeout(context.Background(), tc.timeout)
			defer cancel()
			if tc.timeout == time.Hour {
				cancel()
			}
			require.ErrorIs(t, h.m.WaitIdle(ctx), tc.want)
			require.Empty(t, h.rec.log(), "WaitIdle waited for the call")
		})
	}
}

// Mixed traffic (submits, backoffs, exits, failures, steps of the clock),
// then Shutdown: every event is handled or dropped exactly once, each key's
// successes in the order accepted, and the Stats identity holds.
func TestShutdownAccountsForMixedTraffic(t *testing.T) {
	for _, tc := range []struct {
		name string
		seed uint64
		opts []eventmonitor.Option
	}{
		{"one worker", 1, nil},
		{"four workers", 2, []eventmonitor.Option{eventmonitor.WithWorkers(4)}},
		{"WithMaxAttempts", 3, []eventmonitor.Option{eventmonitor.WithWorkers(2), eventmonitor.WithMaxAttempts(2)}},
		{"WithMaxQueuedPerKey", 4, []eventmonitor.Option{eventmonitor.WithWorkers(2), eventmonitor.WithMaxQueuedPerKey(3)}},
		{"held until Shutdown", 5, []eventmonitor.Option{eventmonitor.WithDeferredStart()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, append([]eventmonitor.Option{eventmonitor.WithBackoff(time.Second, 4*time.Second)}, tc.opts...)...)
			rng := rand.New(rand.NewPCG(tc.seed, 7))
			var offered []any // all but refused Submits: each handled or dropped
			for seq := range 300 {
				e := ev{fmt.Sprint("k", rng.IntN(6)), seq}
				if rng.IntN(3) == 0 {
					h.rec.fail(e, 1+rng.IntN(3))
				}
				switch rng.IntN(6) {
				case 0:
					h.m.Backoff(e.Key, e)
					offered = append(offered, e)
				case 1:
					exits := make(chan stopExit, 1)
					exits <- stopExit{}
					awaitClosed(t, eventmonitor.WatchExit(context.Background(), h.m, e.Key, exits,
						func(uint32, time.Time) any { return e }), "the exit")
					offered = append(offered, e)
				default:
					if err := h.m.Submit(e.Key, e); err == nil {
						offered = append(offered, e)
					} else {
						require.ErrorIs(t, err, eventmonitor.ErrQueueFull)
					}
				}
				if rng.IntN(8) == 0 {
					h.step(t, time.Duration(rng.IntN(3000))*time.Millisecond)
					requireBalanced(t, h.m.Stats())
				}
			}
			require.NoError(t, h.m.Shutdown(context.Background()))

			handled, dropped := h.rec.handled(), h.drops.events()
			seen := map[any]int{}
			for _, e := range append(handled, dropped...) {
				seen[e]++
			}
			for _, e := range offered {
				require.Equal(t, 1, seen[e], "%v handled or dropped once", e)
			}
			require.Len(t, seen, len(offered))
			last := map[string]int{}
			for _, e := range handled {
				e := e.(ev)
				require.Greater(t, e.Seq+1, last[e.Key], "%v handled after %s/%d", e, e.Key, last[e.Key]-1)
				last[e.Key] = e.Seq + 1
			}
			require.Empty(t, h.rec.overlapped())
			s := h.m.Stats()
			require.Equal(t, [2]uint64{uint64(len(handled)), uint64(len(dropped))}, [2]uint64{s.Handled, s.Dropped})
			stopRequireDone(t, s)
		})
	}
}
