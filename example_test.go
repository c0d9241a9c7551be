package eventmonitor_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/types/known/wrapperspb"

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
	fmt.Println(mux.HandleEvent(ctx, "no route for strings"))
	// Output:
	// c1 ran out of memory
	// c1 exited with 137
	// <nil>
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
	subscriptions := 0
	stream := eventmonitor.SubscriberFunc(func(ctx context.Context, filters ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
		subscriptions++
		errs := make(chan error, 1)
		if subscriptions == 1 {
			errs <- errors.New("connection reset")
		}
		return make(chan *eventmonitor.Envelope), errs
	})
	ctx, cancel := context.WithCancel(context.Background())
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error { return nil }),
		eventmonitor.WithConverter(eventmonitor.NewConverter()),
		eventmonitor.WithResubscribe(time.Millisecond, time.Second),
		eventmonitor.WithResync(func(ctx context.Context) error {
			fmt.Println("resync: relisting containers")
			cancel() // the example ends here
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
	// resync: relisting containers
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
