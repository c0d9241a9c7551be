package eventmonitor

import (
	"context"
	"errors"
	"io"
	"sync"
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

func rvRecv(t *testing.T, ch <-chan string, want string, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for {
		select {
		case got := <-ch:
			if got == want {
				return
			}
		case <-deadline:
			t.Fatalf("%q not handled within %v", want, within)
		}
	}
}

// Guarantee 4 (no lost wake-ups). A retry that comes due earlier than the
// timer while the scheduler is held outside the lock (here by its own
// overrun log line: user code, the logger) must still be replayed on time.
// The scheduler once recorded the time it would arm in a second step, and
// an earlier need arriving in between was compared against the stale time
// and lost; the timer is now set under mu by whoever changes what is due.
func TestReviewSchedulerLosesEarlierWakeWhileArming(t *testing.T) {
	fc := testclock.NewFakeClock(time.Unix(1_000_000, 0))
	t0 := fc.Now()
	logger := logrus.New()
	logger.Out = io.Discard
	hook := newBlockHook(logrus.WarnLevel, "overran its timeout")
	logger.AddHook(hook)

	handled := make(chan string, 16)
	release := make(chan struct{})
	h := HandlerFunc(func(ctx context.Context, e any) error {
		s := e.(string)
		handled <- s
		if s == "a" || s == "c" {
			<-release // ignores ctx: a overruns
		}
		return nil
	})
	m, err := New(h, WithClock(fc), WithWorkers(4), WithHandleTimeout(10*time.Second),
		WithBackoff(time.Second, time.Hour), WithLogger(logrus.NewEntry(logger)))
	require.NoError(t, err)
	var releaseOnce sync.Once
	unblock := func() {
		releaseOnce.Do(func() {
			close(release)
			select {
			case <-hook.blocked:
			default:
				hook.once.Do(func() {}) // never block later
			}
			select {
			case <-hook.release:
			default:
				close(hook.release)
			}
		})
	}
	t.Cleanup(func() { unblock(); m.Stop() })

	require.NoError(t, m.Submit("a", "a"))
	rvRecv(t, handled, "a", 5*time.Second)
	waitArmed(t, m, func(at time.Time) bool { return at.Equal(t0.Add(10 * time.Second)) })

	fc.Step(5 * time.Second)
	require.NoError(t, m.Submit("c", "c")) // deadline t0+15s
	rvRecv(t, handled, "c", 5*time.Second)

	// t0+11s: a is past its deadline and grace. The scheduler computes its
	// next wake-up, c's deadline t0+15s, unlocks and logs the overrun.
	fc.Step(6 * time.Second)
	select {
	case <-hook.blocked:
	case <-time.After(5 * time.Second):
		t.Fatal("overrun never logged")
	}
	// b is due at t0+12s, before what the scheduler is about to arm.
	m.Backoff("b", "b")
	due, ok := m.NextRetry()
	require.True(t, ok)
	require.Equal(t, t0.Add(12*time.Second), due)
	close(hook.release)

	// Wait until the scheduler armed again (anything after the stale t0+11s).
	armed := waitArmed(t, m, func(at time.Time) bool { return at.After(t0.Add(11 * time.Second)) })
	fc.Step(time.Second) // t0+12s: b is due
	if armed.After(due) {
		t.Logf("scheduler armed %v after b's due time", armed.Sub(due))
	}
	rvRecv(t, handled, "b", 3*time.Second)
}

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
