package containerd_test

import (
	"context"
	"fmt"
	"time"

	"github.com/containerd/containerd/api/events"
	"github.com/containerd/typeurl/v2"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

// A monitor of a node's Kubernetes containers: dial containerd, key its
// events with Converter, and let Run subscribe and re-subscribe.
func ExampleNewSubscriber() {
	ctx := context.Background()
	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()

	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *events.TaskExit) error {
		fmt.Printf("%s exited with %d\n", e.ContainerID, e.ExitStatus)
		return nil
	})
	m, err := eventmonitor.New(mux,
		eventmonitor.WithNamespace(containerd.K8sNamespace),
		eventmonitor.WithConverter(containerd.Converter()),
		eventmonitor.WithWorkers(4))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(ctx)
	_ = m.Run(ctx, containerd.NewSubscriber(conn), `topic~="/tasks/"`)
}

// exitStatus stands in for containerd's client type containerd.ExitStatus,
// which task.Wait delivers and which has the same Result method, to keep the
// client module out of these tests.
type exitStatus struct {
	code uint32
	at   time.Time
}

func (s exitStatus) Result() (uint32, time.Time, error) { return s.code, s.at, nil }

// WatchExit takes the exit channel of containerd's client as it is;
// TaskExit turns the status into the event containerd would publish.
func ExampleTaskExit() {
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *events.TaskExit) error {
		fmt.Printf("%s (pid %d) exited with %d\n", e.ContainerID, e.Pid, e.ExitStatus)
		return nil
	})
	m, err := eventmonitor.New(mux)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Stop()

	exitCh := make(chan exitStatus, 1) // in a runtime: exitCh, err := task.Wait(ctx)
	exitCh <- exitStatus{code: 137, at: time.Now()}
	<-eventmonitor.WatchExit(context.Background(), m, "c1", exitCh, containerd.TaskExit("c1", "c1", 4242))
	// Output: c1 (pid 4242) exited with 137
}

// A runtime's own exit wait that a daemon restart does not turn into an
// exit: WaitExit waits through containerd's Tasks service, and waits again
// when the connection breaks. A task the daemon no longer has is reported
// with eventmonitor.UnknownExitCode; read WaitExit's channel yourself to
// tell why (ErrTaskGone).
func ExampleWaitExit() {
	ctx := context.Background()
	conn, err := containerd.Dial(ctx, "/run/containerd/containerd.sock")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, event any) error {
		fmt.Printf("%v\n", event)
		return nil
	}))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Stop()

	const id, pid = "c1", 4242
	eventmonitor.WatchExit(ctx, m, id, containerd.WaitExit(ctx, conn, containerd.K8sNamespace, id, ""),
		containerd.TaskExit(id, id, pid))
}

// subscribe stands for the Subscribe method of containerd's client, here
// of the in-process client a plugin inside containerd builds with
// containerd.New("", containerd.WithInMemoryServices(ic)): its envelope
// channel is never closed.
func subscribe(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error) {
	ch := make(chan *Envelope)
	errs := make(chan error, 1)
	go func() {
		defer close(errs)
		payload, _ := typeurl.MarshalAnyToProto(&events.TaskOOM{ContainerID: "c1"})
		select {
		case ch <- &Envelope{Namespace: containerd.K8sNamespace, Topic: "/tasks/oom", Event: payload}:
		case <-ctx.Done():
		}
		<-ctx.Done()
	}()
	return ch, errs
}

// FromSubscribe takes the method value of containerd's client as it is:
// m.Run(ctx, containerd.FromSubscribe(client.Subscribe), filters...).
func ExampleFromSubscribe() {
	handled := make(chan struct{})
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e *events.TaskOOM) error {
		fmt.Printf("%s ran out of memory\n", e.ContainerID)
		close(handled)
		return nil
	})
	m, err := eventmonitor.New(mux, eventmonitor.WithConverter(containerd.Converter()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- m.Run(ctx, containerd.FromSubscribe(subscribe), `topic=="/tasks/oom"`) }()
	<-handled
	cancel() // ends the stream, though the source never closes its channel
	fmt.Println("Run returned", <-done)
	// Output:
	// c1 ran out of memory
	// Run returned <nil>
}

// sandbox stands for what a CRI implementation holds for a sandbox (its
// store entry).
type sandbox struct{ id, name string }

// sandboxExit carries the sandbox the exit monitor had in hand with the
// event, so that its handler needs no store lookup, which can miss while
// the store is still being recovered.
type sandboxExit struct {
	*events.SandboxExit
	sandbox *sandbox
}

// SandboxExit builds the event of the CRI's startSandboxExitMonitor. The
// builder may wrap it with what the caller already has: the handler of the
// wrapper type gets the sandbox itself; a SandboxExit from the stream (no
// sandbox) goes to the *events.SandboxExit handler, which looks it up.
func ExampleSandboxExit() {
	mux := eventmonitor.NewMux()
	eventmonitor.On(mux, func(ctx context.Context, e sandboxExit) error {
		fmt.Printf("sandbox %s (%s) exited with %d\n", e.SandboxID, e.sandbox.name, e.ExitStatus)
		return nil
	})
	eventmonitor.On(mux, func(ctx context.Context, e *events.SandboxExit) error {
		fmt.Printf("sandbox %s exited with %d; looking it up\n", e.SandboxID, e.ExitStatus)
		return nil
	})
	m, err := eventmonitor.New(mux)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Stop()

	sb := &sandbox{id: "s1", name: "web-0"}
	exitCh := make(chan exitStatus, 1) // in a CRI: the sandbox controller's Wait
	exitCh <- exitStatus{code: 137, at: time.Now()}
	build := containerd.SandboxExit(sb.id)
	<-eventmonitor.WatchExit(context.Background(), m, sb.id, exitCh, func(code uint32, exitedAt time.Time) any {
		return sandboxExit{SandboxExit: build(code, exitedAt).(*events.SandboxExit), sandbox: sb}
	})
	// Output: sandbox s1 (web-0) exited with 137
}
