//go:build go1.25

package eventmonitor_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/eventmonitor/eventmonitor"
)

// Inside a testing/synctest bubble the monitor runs on its default, real
// clock, which is the bubble's fake time: retries and handle timeouts fire
// when time.Sleep reaches them, and synctest.Wait returns once the monitor
// has done all it can. No fake clock, no WaitIdle, no polling.
func TestRetriesAndTimeoutsInASynctestBubble(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// The handler runs on the monitor's goroutines: what it shares with
		// the test needs a lock or atomics, bubble or not.
		var calls atomic.Int32
		var timedOut atomic.Pointer[error]
		m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
			n := calls.Add(1)
			switch {
			case event == "hangs":
				<-ctx.Done() // the handle timeout ends it
				err := ctx.Err()
				timedOut.Store(&err)
				return err
			case n == 1:
				return errors.New("shim not answering")
			}
			return nil
		}))
		if err != nil {
			t.Fatal(err)
		}
		defer m.Stop()

		if err := m.Submit("c1", "exit of c1"); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		if n := calls.Load(); n != 1 || !m.InBackoff("c1") {
			t.Fatalf("after Submit: %d calls, in backoff %v; want 1 failed call", n, m.InBackoff("c1"))
		}
		time.Sleep(time.Second - time.Nanosecond)
		synctest.Wait()
		if n := calls.Load(); n != 1 {
			t.Fatalf("retried before its 1 s backoff: %d calls", n)
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if n := calls.Load(); n != 2 || m.InBackoff("c1") {
			t.Fatalf("at 1 s: %d calls, in backoff %v; want the retry to have succeeded", n, m.InBackoff("c1"))
		}

		if err := m.Submit("c2", "hangs"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10*time.Second - time.Nanosecond)
		synctest.Wait()
		if err := timedOut.Load(); err != nil {
			t.Fatalf("the call's context ended before its deadline: %v", *err)
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		if err := timedOut.Load(); err == nil || !errors.Is(*err, context.DeadlineExceeded) {
			t.Fatalf("the call's context at its deadline: %v, want DeadlineExceeded", err)
		}
	})
}

// Stop and Shutdown beside a handler that ignores its ctx return when the
// call overruns (its deadline plus the grace) to the nanosecond, not
// before: the bound is the clock's.
func TestStopAndShutdownReturnExactlyAtTheOverrun(t *testing.T) {
	for _, how := range []string{"Stop", "Shutdown"} {
		t.Run(how, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				release := make(chan struct{})
				dropped := &drops{}
				m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error {
					<-release
					return nil
				}), eventmonitor.WithHandleTimeout(5*time.Second), eventmonitor.WithDropHandler(dropped.add),
					eventmonitor.WithLogger(quietLogger()))
				if err != nil {
					t.Fatal(err)
				}
				defer close(release)
				if err := m.Submit("k", "stuck"); err != nil {
					t.Fatal(err)
				}
				synctest.Wait() // the call starts now: its deadline is 5 s on, the grace 0.5 s after
				returned := make(chan error, 1)
				go func() {
					if how == "Stop" {
						m.Stop()
						returned <- nil
						return
					}
					returned <- m.Shutdown(context.Background())
				}()
				time.Sleep(5500*time.Millisecond - time.Nanosecond)
				synctest.Wait()
				if len(returned) > 0 {
					t.Fatalf("%s returned before the call overran", how)
				}
				time.Sleep(time.Nanosecond)
				synctest.Wait()
				select {
				case err := <-returned:
					if err != nil {
						t.Fatalf("%s: %v, want nil (the abandoned call's drop reports the loss)", how, err)
					}
				default:
					t.Fatalf("%s did not return as the call overran", how)
				}
				if reason := dropped.reason("stuck"); !errors.Is(reason, eventmonitor.ErrStopped) {
					t.Errorf("the stuck call's event dropped with %v, want ErrStopped", reason)
				}
			})
		})
	}
}

// A stream is read inside the bubble too: once synctest.Wait returns, every
// envelope sent has been converted and handled.
func TestStreamInASynctestBubble(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var handled []string
		m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
			mu.Lock()
			defer mu.Unlock()
			handled = append(handled, event.(*wrapperspb.StringValue).GetValue())
			return nil
		}), eventmonitor.WithConverter(eventmonitor.NewConverter(
			eventmonitor.KeyOf(func(e *wrapperspb.StringValue) string { return e.GetValue() }))))
		if err != nil {
			t.Fatal(err)
		}
		defer m.Stop()
		ch := make(chan *eventmonitor.Envelope)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go m.Run(ctx, eventmonitor.SubscriberFunc(func(context.Context, ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
			return ch, nil
		}))
		for _, id := range []string{"c1", "c2", "c3"} {
			ch <- containerEvent("k8s.io", id)
		}
		synctest.Wait()
		mu.Lock()
		defer mu.Unlock()
		if !slices.Equal(handled, []string{"c1", "c2", "c3"}) {
			t.Fatalf("handled %v, want c1, c2 and c3", handled)
		}
	})
}

// An exit already in exitCh as Stop begins is read, and handled or dropped
// with ErrStopped, whichever of the exit and the stop the watcher's select
// takes first: never left unread and uncounted.
func TestAnExitWaitingAsStopBeginsIsAccountedFor(t *testing.T) {
	for range 50 {
		synctest.Test(t, func(t *testing.T) {
			var dropped atomic.Int32
			m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error { return nil }),
				eventmonitor.WithDropHandler(func(d eventmonitor.Drop) {
					if errors.Is(d.Reason, eventmonitor.ErrStopped) {
						dropped.Add(int32(len(d.Events)))
					}
				}))
			if err != nil {
				t.Fatal(err)
			}
			exitCh := make(chan exitStatus, 1)
			exitCh <- exitStatus{code: 1}
			eventmonitor.WatchExit(context.Background(), m, "a", exitCh, func(uint32, time.Time) any { return "exit" })
			m.Stop()
			s := m.Stats()
			if len(exitCh) != 0 || s.Received != 1 || s.Handled+s.Dropped != 1 || s.Dropped != uint64(dropped.Load()) {
				t.Fatalf("exit left in its channel: %d; stats %+v; dropped with ErrStopped: %d", len(exitCh), s, dropped.Load())
			}
		})
	}
}
