package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"
)

// entries returns the log entries with message msg.
func (h *harness) entries(msg string) []logrus.Entry {
	var out []logrus.Entry
	for _, e := range h.logs.AllEntries() {
		if e.Message == msg {
			out = append(out, *e)
		}
	}
	return out
}

const (
	failedLine = "event handling failed; backing off"
	retryLine  = "retrying backed-off events"
	giveUpLine = "giving up on event"
)

// TestFailureRetryAndGiveUpLogs follows one key from the stream through two
// failures and a give-up: each logs one line with the key, the envelope's
// topic and namespace, the attempt, the delay and the error.
func TestFailureRetryAndGiveUpLogs(t *testing.T) {
	failure := errors.New("shim not answering")
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { return failure }),
		WithConverter(testConverter), WithBackoff(time.Second, time.Minute), WithMaxAttempts(2))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	sub := <-stream.newSub
	sub.send(t, &Envelope{Namespace: "k8s.io", Topic: "/tasks/exit", Event: payload(t, wrapperspb.String("c1"))})

	waitFor(t, func() bool { return len(h.entries(failedLine)) == 1 }, "first failure logged")
	failed := h.entries(failedLine)[0]
	assert.Equal(t, logrus.ErrorLevel, failed.Level, "as containerd logs a failed event")
	assert.Equal(t, "c1", failed.Data["key"])
	assert.Equal(t, "/tasks/exit", failed.Data["topic"])
	assert.Equal(t, "k8s.io", failed.Data["namespace"])
	assert.Equal(t, 1, failed.Data["attempt"])
	assert.Equal(t, time.Second, failed.Data["delay"])
	assert.Equal(t, failure, failed.Data[logrus.ErrorKey])

	h.clock.Step(time.Second)
	waitFor(t, func() bool { return len(h.entries(giveUpLine)) == 1 }, "give-up logged")
	retries := h.entries(retryLine)
	require.Len(t, retries, 1)
	assert.Equal(t, "c1", retries[0].Data["key"])
	assert.Equal(t, "/tasks/exit", retries[0].Data["topic"])
	assert.Equal(t, "k8s.io", retries[0].Data["namespace"])
	assert.Equal(t, 2, retries[0].Data["attempt"])
	assert.Equal(t, time.Second, retries[0].Data["delay"])
	assert.Equal(t, failure.Error(), retries[0].Data["previous_error"], "the retry says what it retries")
	assert.NotContains(t, retries[0].Data, logrus.ErrorKey, "the retry line must not read as a failed retry")

	gaveUp := h.entries(giveUpLine)[0]
	assert.Equal(t, "c1", gaveUp.Data["key"])
	assert.Equal(t, 2, gaveUp.Data["attempt"])
	assert.ErrorIs(t, gaveUp.Data[logrus.ErrorKey].(error), failure)
	assert.Len(t, h.entries(failedLine), 1, "a give-up is not also logged as a failure")

	var order []string
	for _, e := range h.logs.AllEntries() {
		order = append(order, e.Message)
	}
	assert.Equal(t, []string{failedLine, retryLine, giveUpLine}, order[len(order)-3:],
		"a retry is logged before its outcome")
}

// TestFailingKeyDoesNotFloodTheLog puts 1,000 events on one key whose
// handler always fails. The log grows by one failure and one retry line per
// backoff delay, not per event.
func TestFailingKeyDoesNotFloodTheLog(t *testing.T) {
	r := newRecorder()
	r.onCall = func(context.Context, any) error { return errors.New("down") }
	h := newHarness(t, r, WithBackoff(time.Second, time.Minute))
	for i := range 1000 {
		h.submit(t, ev{"flood", i})
	}
	h.settled(t)
	require.Equal(t, 1000, h.m.Stats().EventsInBackoff, "all events wait behind the first")
	for range 5 {
		h.step(t, h.pending("flood").Due.Sub(h.clock.Now()))
	}
	assert.Equal(t, 6, r.callCount(), "one call per delay")
	assert.Len(t, h.entries(failedLine), 6)
	assert.Len(t, h.entries(retryLine), 5)
	assert.Equal(t, 1000, h.entries(retryLine)[4].Data["events"])
}

// Events of one origin share what they know of it until they fail: one
// event's failures must not show on another's count.
func TestEventsOfOneOriginCountTheirOwnAttempts(t *testing.T) {
	h := newHarness(t, HandlerFunc(func(_ context.Context, e any) error {
		if e.(*wrapperspb.StringValue).Value == "ok" {
			return nil
		}
		return errors.New("failing")
	}), WithConverter(testConverter), WithBackoff(time.Second, time.Minute))
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	sub := <-stream.newSub
	send := func(key string) {
		sub.send(t, &Envelope{Namespace: "k8s.io", Topic: "/tasks/exit", Event: payload(t, wrapperspb.String(key))})
	}
	send("c1")
	waitFor(t, func() bool { return h.pending("c1").Attempts == 1 }, "c1 fails once")
	h.clock.Step(time.Second)
	waitFor(t, func() bool { return h.pending("c1").Attempts == 2 }, "c1 fails again")
	send("ok")
	send("c2")
	waitFor(t, func() bool { return h.pending("c2").Attempts == 1 }, "c2 fails once")
	assert.Equal(t, 2, h.pending("c1").Attempts)
	assert.EqualValues(t, 1, h.m.Stats().Handled)

	waitFor(t, func() bool { return len(h.entries(failedLine)) == 3 }, "c2's failure logged") // after Pending shows it
	lines := h.entries(failedLine)
	assert.Equal(t, "c2", lines[2].Data["key"])
	assert.Equal(t, 1, lines[2].Data["attempt"])
	assert.Equal(t, "/tasks/exit", lines[2].Data["topic"])
	assert.Equal(t, "k8s.io", lines[2].Data["namespace"])
}

// A handler logging through log.G(ctx) writes to the monitor's logger, with
// the key it is handling.
func TestHandlerLogsWithItsKey(t *testing.T) {
	h := newHarness(t, HandlerFunc(func(ctx context.Context, event any) error {
		log.G(ctx).WithField("event", event.(ev).Seq).Info("handling")
		assert.Contains(t, fmt.Sprint(ctx), event.(ev).Key, "the context names its key")
		return nil
	}))
	h.submit(t, ev{"c1", 1}, ev{"c2", 2})
	h.settled(t)
	lines := h.entries("handling")
	require.Len(t, lines, 2)
	for _, line := range lines {
		assert.Equal(t, map[int]string{1: "c1", 2: "c2"}[line.Data["event"].(int)], line.Data["key"])
	}
}

type nopFormatter struct{}

func (nopFormatter) Format(*logrus.Entry) ([]byte, error) { return nil, nil }

// No data race on fields read outside the lock. report once read
// c.it.failures.attempts (itemFields) after handle dropped mu, but the
// *failures is shared with the event's next call: once settle put the
// event back, the scheduler may replay it on another worker whose settle
// does it.failures.attempts++ under mu while the first goroutine is still
// reporting (the logger is user code and may take its time). Run with
// -race.
func TestFailureReportDoesNotRaceTheNextAttempt(t *testing.T) {
	fc := testclock.NewFakeClock(time.Unix(1_000_000, 0))
	logger := logrus.New()
	logger.Out = io.Discard
	logger.Formatter = nopFormatter{}
	logger.SetNoLock() // the logger itself must not order the two goroutines
	hook := newBlockHook(logrus.ErrorLevel, "event handling failed")
	logger.AddHook(hook)

	h := HandlerFunc(func(ctx context.Context, e any) error { return errors.New("boom") })
	m, err := New(h, WithClock(fc), WithWorkers(2), WithBackoff(time.Second, time.Hour),
		WithLogger(logrus.NewEntry(logger)))
	require.NoError(t, err)
	t.Cleanup(func() {
		select {
		case <-hook.release:
		default:
			close(hook.release)
		}
		m.Stop()
	})

	require.NoError(t, m.Submit("k", "e"))
	// First call failed and was settled; its goroutine reports (and blocks
	// in the logger) without mu.
	require.Eventually(t, func() bool { return m.Stats().Failed == 1 }, 5*time.Second, time.Millisecond)
	waitArmed(t, m, func(at time.Time) bool { return true })
	fc.Step(time.Second) // replay on the second worker; it fails too
	require.Eventually(t, func() bool { return m.Stats().Failed == 2 }, 5*time.Second, time.Millisecond)
	close(hook.release)
}
