package eventmonitor_test

// What the monitor reports to Metrics and to its log.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/anypb"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

// spyMetrics records every Metrics call.
type spyMetrics struct {
	mu        sync.Mutex
	done      []handlerDone
	recovered []time.Duration
	dropped   map[error]int // events by the sentinel their reason wraps
}

type handlerDone struct {
	d   time.Duration
	err error
}

var dropSentinels = []error{eventmonitor.ErrDecode, eventmonitor.ErrInvalidEvent, eventmonitor.ErrMaxAttempts,
	eventmonitor.ErrQueueFull, eventmonitor.ErrStopped}

func (s *spyMetrics) HandlerDone(d time.Duration, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.done = append(s.done, handlerDone{d, err})
}

func (s *spyMetrics) Recovered(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.recovered = append(s.recovered, d)
}

func (s *spyMetrics) Dropped(reason error, events int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dropped == nil {
		s.dropped = map[error]int{}
	}
	for _, sentinel := range dropSentinels {
		if errors.Is(reason, sentinel) {
			s.dropped[sentinel] += events
			return
		}
	}
	s.dropped[reason] += events // wraps no sentinel: shows in the test's failure
}

func (s *spyMetrics) calls() []handlerDone {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]handlerDone(nil), s.done...)
}

func TestMetricsGetEveryCallsDurationAndError(t *testing.T) {
	spy := &spyMetrics{}
	h := newHarness(t, nil, eventmonitor.WithMetrics(spy))
	h.rec.fail(ev{"b", 1}, 1)
	started, release := gateAll(t, h.rec, ev{"a", 1}, ev{"b", 1})
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	awaitClosed(t, started[0], "a/1")
	h.clk.Step(300 * time.Millisecond)
	release[0]()
	awaitClosed(t, started[1], "b/1")
	h.clk.Step(200 * time.Millisecond)
	release[1]()
	// Not settle alone: WaitIdle may return before the call's report (TestWaitIdleWaitsForTheReportOfTheLastCall).
	waitFor(t, "b/1's failure reported", func() bool { return len(spy.calls()) == 2 })
	h.step(t, time.Second) // b/1's retry, at once
	waitFor(t, "three calls reported", func() bool { return len(spy.calls()) == 3 })
	calls := spy.calls()
	assert.Equal(t, handlerDone{300 * time.Millisecond, nil}, calls[0])
	assert.Equal(t, 200*time.Millisecond, calls[1].d)
	assert.EqualError(t, calls[1].err, "injected failure of b/1")
	assert.Equal(t, handlerDone{0, nil}, calls[2])
}

func TestMetricsGetTheTimeARetriedEventTookToRecover(t *testing.T) {
	for _, tc := range []struct {
		name  string
		queue func(*testing.T, *harness)
		steps []time.Duration
		want  time.Duration
	}{
		{"failed twice", func(t *testing.T, h *harness) { h.rec.fail(ev{"a", 1}, 2); h.submit(t, ev{"a", 1}) },
			[]time.Duration{time.Second, 2 * time.Second}, 3 * time.Second},
		{"given to Backoff", func(_ *testing.T, h *harness) { h.m.Backoff("a", ev{"a", 1}) },
			[]time.Duration{time.Second}, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spy := &spyMetrics{}
			h := newHarness(t, nil, eventmonitor.WithMetrics(spy))
			h.submit(t, ev{"b", 1}) // handled at once: no recovery
			tc.queue(t, h)
			for _, d := range tc.steps {
				h.step(t, d)
			}
			require.Equal(t, evs("a", 1), h.rec.handled("a"))
			waitFor(t, "the recovery reported", func() bool { spy.mu.Lock(); defer spy.mu.Unlock(); return len(spy.recovered) > 0 })
			spy.mu.Lock()
			defer spy.mu.Unlock()
			assert.Equal(t, []time.Duration{tc.want}, spy.recovered, "since the first failure")
		})
	}
}

func TestMetricsGetEveryDropsReasonAndCount(t *testing.T) {
	spy := &spyMetrics{}
	h := newHarness(t, nil, eventmonitor.WithMetrics(spy), eventmonitor.WithMaxAttempts(2),
		eventmonitor.WithConverter(keyConverter))
	sub := newFakeSubscriber(1)
	runMonitor(t, h.m, sub)
	st := sub.next(t)
	st.ch <- &eventmonitor.Envelope{Namespace: "ns", Topic: "/test", Event: &anypb.Any{
		TypeUrl: "type.googleapis.com/google.protobuf.StringValue", Value: []byte{0x0a, 0x05, 'a'}}} // truncated
	h.rec.fail(ev{"m", 1}, 2)
	h.submit(t, ev{"m", 1})
	h.step(t, time.Second)       // its retry fails too: ErrMaxAttempts
	h.m.Backoff("", ev{"", 1})   // ErrInvalidEvent
	h.m.Backoff("s", ev{"s", 1}) // waits 1 s: ErrStopped, with s/2 and s/3
	h.submit(t, ev{"s", 2}, ev{"s", 3})
	waitFor(t, "the envelope read", func() bool { return h.m.Stats().Received == 6 })
	h.settle(t)
	h.m.Stop()
	spy.mu.Lock()
	defer spy.mu.Unlock()
	assert.Equal(t, map[error]int{eventmonitor.ErrDecode: 1, eventmonitor.ErrMaxAttempts: 1,
		eventmonitor.ErrInvalidEvent: 1, eventmonitor.ErrStopped: 3}, spy.dropped)
	assert.Equal(t, uint64(6), h.m.Stats().Dropped)
	assert.Len(t, h.drops.list(), 4, "one Drop per reason: Stop drops s's three events together")
}

// An event nobody handles is not an error: HandlerDone gets a nil error,
// as for an event handled, so a "result=error" metric counts failures only.
func TestIgnoredEventsReachMetricsAsNoError(t *testing.T) {
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(context.Context, ev) error { return nil })
	for name, handler := range map[string]eventmonitor.Handler{
		"a Mux with no route for the type": mux,
		"a handler returning ErrUnsupportedEvent": eventmonitor.HandlerFunc(func(context.Context, any) error {
			return fmt.Errorf("not mine: %w", eventmonitor.ErrUnsupportedEvent)
		}),
	} {
		t.Run(name, func(t *testing.T) {
			spy := &spyMetrics{}
			h := newHarness(t, handler, eventmonitor.WithMetrics(spy))
			require.NoError(t, h.m.Submit("a", unrouted{}))
			waitFor(t, "the call reported", func() bool { return len(spy.calls()) == 1 })
			assert.Equal(t, []handlerDone{{0, nil}}, spy.calls())
			s := h.m.Stats()
			assert.Equal(t, [3]uint64{1, 0, 0}, [3]uint64{s.Ignored, s.Handled, s.Failed}, "ignored, handled, failed")
		})
	}
}

// entries is the log lines with message msg.
func entries(h *harness, msg string) []*logrus.Entry {
	var out []*logrus.Entry
	for _, e := range h.logs.AllEntries() {
		if e.Message == msg {
			out = append(out, e)
		}
	}
	return out
}

const (
	failedLine = "event handling failed; backing off"
	retryLine  = "retrying backed-off events"
	giveUpLine = "giving up on event"
)

// One envelope's event fails twice and is given up on (WithMaxAttempts(2)):
// each step logs one line with the key and the envelope's topic and namespace.
func TestFailureRetryAndGiveUpAreLogged(t *testing.T) {
	failure := errors.New("shim not answering")
	h := newHarness(t, eventmonitor.HandlerFunc(func(context.Context, any) error { return failure }),
		eventmonitor.WithConverter(keyConverter), eventmonitor.WithMaxAttempts(2))
	sub := newFakeSubscriber(1)
	runMonitor(t, h.m, sub)
	sub.next(t).ch <- envelope(t, "k8s.io", "c1")
	waitFor(t, "the first failure logged", func() bool { return len(entries(h, failedLine)) == 1 })
	h.step(t, time.Second)
	origin := logrus.Fields{"key": "c1", "topic": "/test", "namespace": "k8s.io"}

	var order []string
	for _, e := range h.logs.AllEntries() {
		order = append(order, e.Message)
	}
	require.Equal(t, []string{failedLine, retryLine, giveUpLine}, order, "a retry is logged before its outcome")
	failed := entries(h, failedLine)[0]
	assert.Equal(t, logrus.ErrorLevel, failed.Level)
	assert.Equal(t, withFields(origin, logrus.Fields{"attempt": 1, "delay": time.Second, logrus.ErrorKey: failure}), failed.Data)
	retry := entries(h, retryLine)[0]
	assert.Equal(t, logrus.InfoLevel, retry.Level)
	assert.Subset(t, retry.Data, withFields(origin, logrus.Fields{"events": 1, "previous_error": failure}))
	assert.NotContains(t, retry.Data, logrus.ErrorKey, "the retry line must not read as a failed retry")
	gaveUp := entries(h, giveUpLine)[0]
	assert.Equal(t, logrus.WarnLevel, gaveUp.Level)
	assert.Equal(t, withFields(origin, logrus.Fields{"attempt": 2, logrus.ErrorKey: failure}), gaveUp.Data)
	assert.ErrorIs(t, h.drops.list()[0].Reason, eventmonitor.ErrMaxAttempts)
}

func withFields(a, b logrus.Fields) logrus.Fields {
	out := logrus.Fields{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}

func TestTheRetryOfABackoffdEventHasNoPreviousError(t *testing.T) {
	h := newHarness(t, nil)
	h.m.Backoff("a", ev{"a", 1})
	h.submit(t, ev{"a", 2})
	h.step(t, time.Second)
	lines := entries(h, retryLine)
	require.Len(t, lines, 1)
	assert.Equal(t, "a", lines[0].Data["key"])
	assert.Equal(t, 2, lines[0].Data["events"], "the retried event and the one behind it")
	assert.NotContains(t, lines[0].Data, "previous_error", "no handler call failed")
	assert.Empty(t, entries(h, failedLine))
}

// explodingHandler panics, so that its frame is in the logged stack.
func explodingHandler(context.Context, any) error { panic("boom") }

func TestAHandlerPanicIsLoggedWithItsStack(t *testing.T) {
	h := newHarness(t, eventmonitor.HandlerFunc(explodingHandler))
	h.submit(t, ev{"a", 1})
	h.settle(t)
	lines := entries(h, "event handler panicked")
	require.Len(t, lines, 1)
	assert.Equal(t, logrus.ErrorLevel, lines[0].Level)
	assert.Equal(t, "a", lines[0].Data["key"])
	assert.ErrorContains(t, lines[0].Data[logrus.ErrorKey].(error), "boom")
	assert.Contains(t, lines[0].Data["stack"], "eventmonitor_test.explodingHandler")
	waitFor(t, "the event backing off", func() bool { return len(entries(h, failedLine)) == 1 })
}

// 1,000 events on a key whose handler always fails: one failure line and
// one retry line per delay, not per event.
func TestAFailingKeyLogsOncePerDelay(t *testing.T) {
	h := newHarness(t, nil, eventmonitor.WithBackoff(time.Second, time.Minute))
	h.rec.fail(ev{"flood", 0}, 1<<30)
	for i := range 1000 {
		h.submit(t, ev{"flood", i})
	}
	h.settle(t)
	require.Equal(t, 1000, h.m.Stats().EventsInBackoff, "every event waits behind the first")
	for range 5 { // after 1, 2, 4, 8 and 16 s
		h.step(t, h.pending("flood").Due.Sub(h.clk.Now()))
	}
	assert.Len(t, h.rec.log(), 6, "one call per delay")
	waitFor(t, "the sixth failure logged", func() bool { return len(entries(h, failedLine)) >= 6 })
	assert.Len(t, entries(h, failedLine), 6)
	retries := entries(h, retryLine)
	require.Len(t, retries, 5)
	assert.Equal(t, 1000, retries[4].Data["events"])
}

func TestTheDefaultDropHandlerLogsTheDrop(t *testing.T) {
	logger, hook := logtest.NewNullLogger()
	m, err := eventmonitor.New(nopHandler, eventmonitor.WithClock(testclock.NewFakeClock(epoch)),
		eventmonitor.WithLogger(logrus.NewEntry(logger)))
	require.NoError(t, err)
	defer m.Stop()
	m.Backoff("", ev{"", 1})
	require.Len(t, hook.AllEntries(), 1)
	line := hook.LastEntry()
	assert.Equal(t, "event dropped", line.Message)
	assert.Equal(t, logrus.WarnLevel, line.Level)
	assert.Equal(t, 1, line.Data["events"])
	assert.ErrorIs(t, line.Data[logrus.ErrorKey].(error), eventmonitor.ErrInvalidEvent)
}

// blockingMetrics holds HandlerDone until release closes.
type blockingMetrics struct{ entered, release chan struct{} }

func (b blockingMetrics) HandlerDone(time.Duration, error) { close(b.entered); <-b.release }
func (blockingMetrics) Recovered(time.Duration)            {}
func (blockingMetrics) Dropped(error, int)                 {}

// WaitIdle, the sync point of fake-clock tests, waits for what a settled
// call reports (Metrics, its failure line), so that a test reads them at once.
func TestWaitIdleWaitsForTheReportOfTheLastCall(t *testing.T) {
	bm := blockingMetrics{make(chan struct{}), make(chan struct{})}
	h := newHarness(t, nil, eventmonitor.WithMetrics(bm))
	t.Cleanup(func() { close(bm.release) })
	h.submit(t, ev{"a", 1})
	awaitClosed(t, bm.entered, "HandlerDone")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, h.m.WaitIdle(ctx), context.DeadlineExceeded, "WaitIdle returned while HandlerDone ran")
}
