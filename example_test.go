package eventmonitor_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"

	"github.com/eventmonitor/eventmonitor"
)

// envelopes is a Subscriber that delivers a fixed list of envelopes and then
// keeps the stream open until ctx ends, as a live runtime would.
func envelopes(list ...*eventmonitor.Envelope) eventmonitor.Subscriber {
	return eventmonitor.SubscriberFunc(func(ctx context.Context, filters ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		ch := make(chan *eventmonitor.Envelope)
		go func() {
			for _, env := range list {
				select {
				case ch <- env:
				case <-ctx.Done():
					return
				}
			}
		}()
		return ch, nil
	})
}

func containerEvent(ns, id string) *eventmonitor.Envelope {
	payload, err := typeurl.MarshalAnyToProto(wrapperspb.String(id))
	if err != nil {
		panic(err)
	}
	return &eventmonitor.Envelope{Timestamp: time.Now(), Namespace: ns, Topic: "/containers/update", Event: payload}
}

// The containerd-compatible entry points: Subscribe, Start, Stop. Events are
// typed by the converter and keyed by container ID; other namespaces are
// filtered out.
func ExampleNew() {
	done := make(chan struct{})
	handled := 0
	handler := eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		fmt.Println("handled", event.(*wrapperspb.StringValue).GetValue())
		if handled++; handled == 2 {
			close(done)
		}
		return nil
	})
	m, err := eventmonitor.New(handler,
		eventmonitor.WithNamespace("k8s.io"),
		eventmonitor.WithConverter(eventmonitor.NewConverter(
			eventmonitor.KeyOf(func(e *wrapperspb.StringValue) string { return e.GetValue() }),
		)),
	)
	if err != nil {
		panic(err)
	}
	m.Subscribe(envelopes(
		containerEvent("k8s.io", "c1"),
		containerEvent("moby", "c2"),
		containerEvent("k8s.io", "c3"),
	))
	errCh := m.Start()
	<-done
	m.Stop()
	_, open := <-errCh
	fmt.Println("stream error channel open:", open, "filtered:", m.Stats().Filtered)
	// Output:
	// handled c1
	// handled c3
	// stream error channel open: false filtered: 1
}

type TaskExit struct {
	ID   string
	Code uint32
}

type TaskOOM struct{ ID string }

// Mux routes each event to the function registered for its type.
func ExampleMux() {
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *TaskExit) error {
		fmt.Printf("%s exited with %d\n", e.ID, e.Code)
		return nil
	})
	eventmonitor.On(mux, func(ctx context.Context, e *TaskOOM) error {
		fmt.Printf("%s ran out of memory\n", e.ID)
		return nil
	})
	ctx := context.Background()
	_ = mux.HandleEvent(ctx, &TaskOOM{ID: "c1"})
	_ = mux.HandleEvent(ctx, &TaskExit{ID: "c1", Code: 137})
	err := mux.HandleEvent(ctx, "no route for strings") // the monitor counts it as ignored
	fmt.Println(errors.Is(err, eventmonitor.ErrUnsupportedEvent))
	// Output:
	// c1 ran out of memory
	// c1 exited with 137
	// true
}

// exitStatus stands in for containerd's ExitStatus, which WatchExit takes as is.
type exitStatus struct {
	code uint32
	at   time.Time
}

func (s exitStatus) Result() (uint32, time.Time, error) { return s.code, s.at, nil }

// WatchExit replaces a hand-written exit monitor per object kind: the exit is
// handled as soon as it arrives, never beside another call for its key, and
// backs off like any event if handling fails.
func ExampleWatchExit() {
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *TaskExit) error {
		fmt.Printf("%s exited with %d\n", e.ID, e.Code)
		return nil
	})
	m, err := eventmonitor.New(mux)
	if err != nil {
		panic(err)
	}
	defer m.Stop()

	exitCh := make(chan exitStatus, 1) // in containerd: task.Wait(ctx)
	done := eventmonitor.WatchExit(context.Background(), m, "sandbox-1", exitCh,
		func(code uint32, exitedAt time.Time) any { return &TaskExit{ID: "sandbox-1", Code: code} })
	exitCh <- exitStatus{code: 0, at: time.Now()}
	<-done
	// Output:
	// sandbox-1 exited with 0
}

// Run re-subscribes when the stream breaks and calls the resync hook after
// each re-subscription, so nothing the broken stream missed stays missed.
func ExampleMonitor_Run() {
	var errs chan error
	stream := eventmonitor.SubscriberFunc(func(ctx context.Context, filters ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		errs = make(chan error, 1)
		return make(chan *eventmonitor.Envelope), errs
	})
	ctx, cancel := context.WithCancel(context.Background())
	resyncs := 0
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error { return nil }),
		eventmonitor.WithConverter(eventmonitor.NewConverter()),
		eventmonitor.WithResubscribe(time.Millisecond, time.Second),
		eventmonitor.WithResync(func(ctx context.Context) error {
			resyncs++
			fmt.Printf("resync %d: relisting containers\n", resyncs)
			if resyncs == 1 {
				errs <- errors.New("connection reset") // the stream breaks
			} else {
				cancel() // the example ends here
			}
			return nil
		}),
	)
	if err != nil {
		panic(err)
	}
	fmt.Println("Run:", m.Run(ctx, stream))
	fmt.Println("resubscribed:", m.Stats().Resubscribed)
	_ = m.Shutdown(context.Background())
	// Output:
	// resync 1: relisting containers
	// resync 2: relisting containers
	// Run: <nil>
	// resubscribed: 1
}

// Shutdown drains: queued events are handled and every backoff queue is
// replayed once, now, before the monitor stops.
func ExampleMonitor_Shutdown() {
	var dropped []eventmonitor.Drop
	m, err := eventmonitor.New(
		eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
			fmt.Println("handled", event)
			return nil
		}),
		eventmonitor.WithBackoff(time.Hour, time.Hour),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) { dropped = append(dropped, d) }),
	)
	if err != nil {
		panic(err)
	}
	m.Backoff("c1", "retry of c1 that would wait an hour")
	fmt.Println("shutdown:", m.Shutdown(context.Background()), "dropped:", len(dropped))
	fmt.Println("submit after shutdown:", m.Submit("c1", "late"))
	// Output:
	// handled retry of c1 that would wait an hour
	// shutdown: <nil> dropped: 0
	// submit after shutdown: eventmonitor: monitor stopped
}

// A converter keys each event type by its own field; payloads of other types
// get ErrUnsupportedEvent, which the monitor counts as ignored (not dropped).
func ExampleNewConverter() {
	conv := eventmonitor.NewConverter(
		eventmonitor.KeyOf(func(e *wrapperspb.StringValue) string { return e.GetValue() }),
		eventmonitor.KeyOf(func(e *wrapperspb.Int64Value) string { return fmt.Sprint("pid-", e.GetValue()) }),
	)
	for _, v := range []any{wrapperspb.String("c1"), wrapperspb.Int64(42), wrapperspb.Bool(true)} {
		payload, err := typeurl.MarshalAnyToProto(v)
		if err != nil {
			panic(err)
		}
		key, event, err := conv.Convert(payload)
		fmt.Printf("%q %T %v\n", key, event, errors.Is(err, eventmonitor.ErrUnsupportedEvent))
	}
	// Output:
	// "c1" *wrapperspb.StringValue false
	// "pid-42" *wrapperspb.Int64Value false
	// "" <nil> true
}

// ConverterFunc fits a converter of one's own, here one that takes a single
// event type and prefixes its keys.
func ExampleConverterFunc() {
	conv := eventmonitor.ConverterFunc(func(payload typeurl.Any) (string, any, error) {
		event := &wrapperspb.StringValue{}
		if err := typeurl.UnmarshalTo(payload, event); err != nil {
			return "", nil, fmt.Errorf("%w: %w", eventmonitor.ErrUnsupportedEvent, err)
		}
		return "container/" + event.GetValue(), event, nil
	})
	for _, v := range []any{wrapperspb.String("c1"), wrapperspb.Int64(42)} {
		payload, err := typeurl.MarshalAnyToProto(v)
		if err != nil {
			panic(err)
		}
		key, _, err := conv.Convert(payload)
		fmt.Printf("%q %v\n", key, errors.Is(err, eventmonitor.ErrUnsupportedEvent))
	}
	// Output:
	// "container/c1" false
	// "" true
}

// A failed event waits in its key's backoff queue, and later events of the
// key wait behind it; other keys go on. Forget hands a gone object's events
// back to the caller.
func ExampleMonitor_Submit() {
	failed := make(chan struct{})
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if event == "c1 start" {
			close(failed)
			return errors.New("shim not answering")
		}
		fmt.Println("handled", event)
		return nil
	}), eventmonitor.WithBackoff(time.Hour, time.Hour))
	if err != nil {
		panic(err)
	}
	defer m.Stop()

	_ = m.Submit("c1", "c1 start")
	<-failed
	_ = m.Submit("c1", "c1 stop")
	if err := m.WaitIdle(context.Background()); err != nil { // the failure is settled: c1 waits an hour
		panic(err)
	}
	for _, p := range m.Pending() {
		fmt.Println("waiting:", p.Key, p.Events, "after", p.Attempts, "attempt")
	}
	fmt.Println("forgotten:", m.Forget("c1"))
	// Output:
	// waiting: c1 [c1 start c1 stop] after 1 attempt
	// forgotten: [c1 start c1 stop]
}

// WaitIdle and Pending step a fake clock through a failing event's
// retries: each step lands exactly on a due time, with no sleep and no
// race. The eventmonitortest package wraps these steps for tests.
func ExampleMonitor_WaitIdle() {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	calls := 0
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		if calls++; calls < 3 {
			return errors.New("shim not answering")
		}
		return nil
	}), eventmonitor.WithClock(clk))
	if err != nil {
		panic(err)
	}
	defer m.Stop()

	ctx := context.Background()
	_ = m.Submit("c1", "exit of c1")
	for {
		if err := m.WaitIdle(ctx); err != nil {
			panic(err)
		}
		pending := m.Pending()
		if len(pending) == 0 {
			break
		}
		fmt.Printf("call %d failed; retry due in %v\n", calls, pending[0].Due.Sub(clk.Now()))
		clk.SetTime(pending[0].Due)
	}
	fmt.Println("handled at call", calls)
	// Output:
	// call 1 failed; retry due in 1s
	// call 2 failed; retry due in 2s
	// handled at call 3
}

// Backoff puts an event straight into its key's backoff queue, as
// containerd's CRI monitor does with an exit it could not handle at once:
// it is handled when the queue is due, the key's later events behind it,
// while other keys go on.
func ExampleMonitor_Backoff() {
	clk := testclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		fmt.Println("handled", event, "at", clk.Now().Format(time.TimeOnly))
		return nil
	}), eventmonitor.WithClock(clk), eventmonitor.WithBackoff(time.Second, time.Minute))
	if err != nil {
		panic(err)
	}
	defer m.Stop()

	ctx := context.Background()
	m.Backoff("c1", "c1 exit")
	_ = m.Submit("c1", "c1 delete") // waits behind the exit
	_ = m.Submit("c2", "c2 start")
	if err := m.WaitIdle(ctx); err != nil {
		panic(err)
	}
	clk.SetTime(m.Pending()[0].Due)
	if err := m.WaitIdle(ctx); err != nil {
		panic(err)
	}
	// Output:
	// handled c2 start at 00:00:00
	// handled c1 exit at 00:00:01
	// handled c1 delete at 00:00:01
}

// WithDeferredStart holds handling until Start or Run, as containerd's CRI
// plugin queues the exits it sees while it recovers its containers on a
// restart: what was accepted before is handled, in order, once Start is
// called.
func ExampleWithDeferredStart() {
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		fmt.Println("handled", event)
		return nil
	}), eventmonitor.WithDeferredStart())
	if err != nil {
		panic(err)
	}
	defer m.Stop()

	ctx := context.Background()
	_ = m.Submit("c1", "c1 exit, seen while recovering")
	if err := m.WaitIdle(ctx); err != nil { // a held monitor is idle with its events queued
		panic(err)
	}
	fmt.Println("before Start:", m.Stats().Queued, "queued")
	m.Start() // without Subscribe it reads nothing: its channel stands for the monitor's life
	if err := m.WaitIdle(ctx); err != nil {
		panic(err)
	}
	// Output:
	// before Start: 1 queued
	// handled c1 exit, seen while recovering
}

// Forget takes back what a key holds once its object is gone, as when a
// container is removed while its events wait in backoff: they are returned,
// in order, rather than retried against nothing.
func ExampleMonitor_Forget() {
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		return errors.New("task not found")
	}), eventmonitor.WithBackoff(time.Hour, time.Hour))
	if err != nil {
		panic(err)
	}
	defer m.Stop()

	_ = m.Submit("c1", "c1 exit") // fails, and waits an hour in backoff
	_ = m.Submit("c1", "c1 delete")
	if err := m.WaitIdle(context.Background()); err != nil {
		panic(err)
	}
	fmt.Println("in backoff:", m.InBackoff("c1"))
	fmt.Println("forgotten:", m.Forget("c1"))
	fmt.Println("in backoff:", m.InBackoff("c1"), "forgotten in all:", m.Stats().Forgotten)
	// Output:
	// in backoff: true
	// forgotten: [c1 exit c1 delete]
	// in backoff: false forgotten in all: 2
}
