package eventmonitor

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/require"
	testclock "k8s.io/utils/clock/testing"
)

type rvNopFormatter struct{}

func (rvNopFormatter) Format(*logrus.Entry) ([]byte, error) { return nil, nil }

// Guarantee 7 (no data race on fields read outside the lock). report reads
// c.it.failures.attempts (itemFields) after handle dropped mu, but the
// *failures is shared with the event's next call: once settle put the
// event back, the scheduler may replay it on another worker whose settle
// does it.failures.attempts++ under mu while the first goroutine is still
// reporting (the logger is user code and may take its time). Run with
// -race.
func TestReviewReportRacesNextAttemptOnFailures(t *testing.T) {
	fc := testclock.NewFakeClock(time.Unix(1_000_000, 0))
	logger := logrus.New()
	logger.Out = io.Discard
	logger.Formatter = rvNopFormatter{}
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

// rvAny is a payload whose GetTypeUrl notes whether the monitor's mutex is
// held when it is called.
type rvAny struct{ m *Monitor }

var rvUnderLock atomic.Int32

func (a rvAny) GetTypeUrl() string {
	if a.m.mu.TryLock() {
		a.m.mu.Unlock()
	} else {
		rvUnderLock.Add(1)
	}
	return "review/unknown"
}
func (a rvAny) GetValue() []byte { return nil }

// Guarantee 7 (no user code under mu). take calls env.Event.GetTypeUrl()
// (the payload is the subscriber's typeurl.Any: user code) with mu held, to
// log an ignored type once. A payload that looks at the monitor (or just
// blocks) holds every Submit, worker and Stop.
func TestReviewIgnoredPayloadCalledUnderLock(t *testing.T) {
	rvUnderLock.Store(0)
	m, err := New(HandlerFunc(func(context.Context, any) error { return nil }),
		WithConverter(ConverterFunc(func(typeurl.Any) (string, any, error) {
			return "", nil, ErrUnsupportedEvent
		})))
	require.NoError(t, err)
	ch := make(chan *Envelope)
	m.Subscribe(SubscriberFunc(func(ctx context.Context, _ ...string) (<-chan *Envelope, <-chan error) {
		return ch, nil
	}))
	m.Start()
	t.Cleanup(m.Stop)
	ch <- &Envelope{Topic: "/x", Event: rvAny{m: m}}
	require.Eventually(t, func() bool { return m.Stats().Ignored == 1 }, 5*time.Second, time.Millisecond)
	require.Zero(t, rvUnderLock.Load(), "payload's GetTypeUrl was called with the monitor's mutex held")
}
