package containerd_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
	"github.com/eventmonitor/eventmonitor/containerd/containerdtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// seen records what the handler handled, and fails events a test asks it to.
type seen struct {
	mu     sync.Mutex
	events []any
	fail   map[string]int // fail events with this key (container ID or name) this many times
	calls  int
}

func (s *seen) HandleEvent(_ context.Context, event any) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if key := keyOf(event); s.fail[key] > 0 {
		s.fail[key]--
		return fmt.Errorf("failing %T of %s on purpose", event, key)
	}
	s.events = append(s.events, event)
	return nil
}

// of returns the events handled for key, in order.
func (s *seen) of(key string) []any {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []any
	for _, e := range s.events {
		if keyOf(e) == key {
			out = append(out, e)
		}
	}
	return out
}

// keyOf keys an event the way the converter does, through it.
func keyOf(event any) string {
	payload, err := typeurl.MarshalAnyToProto(event)
	if err != nil {
		return ""
	}
	key, _, _ := containerd.Converter().Convert(payload)
	return key
}

func types(evs []any) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = reflect.TypeOf(e).Elem().Name()
	}
	return out
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	require.Eventually(t, cond, 20*time.Second, 5*time.Millisecond, "waiting for %s", what)
}

// client is a test's connection to its daemon.
type client struct {
	t    *testing.T
	conn *grpc.ClientConn
}

func dial(t *testing.T, d *testDaemon) *client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := containerd.Dial(ctx, d.Address())
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return &client{t: t, conn: conn}
}

// publish publishes event on topic in namespace ns through the daemon.
func (c *client) publish(ns, topic string, event any) error {
	payload, err := typeurl.MarshalAnyToProto(event)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "containerd-namespace", ns)
	_, err = eventsapi.NewEventsClient(c.conn).Publish(ctx, &eventsapi.PublishRequest{Topic: topic, Event: payload})
	return err
}

// handshake publishes a probe every 20 ms until the handler has seen one:
// containerd registers a subscriber only some time after Subscribe returns,
// and events published before that are not delivered to it.
func (c *client) handshake(ns string, h *seen) {
	c.t.Helper()
	probe := fmt.Sprintf("probe-%d", time.Now().UnixNano())
	deadline := time.Now().Add(20 * time.Second)
	for len(h.of(probe)) == 0 {
		if time.Now().After(deadline) {
			c.t.Fatalf("no probe reached the handler")
		}
		// Errors are expected while a restarted daemon comes up.
		_ = c.publish(ns, "/eventmonitor-test/probe", &events.NamespaceUpdate{Name: probe})
		time.Sleep(20 * time.Millisecond) // the probe's period, not a wait for an outcome
	}
}

// handshakeAll publishes one probe every 20 ms until every handler has
// seen it, and returns how long after since each had.
func (c *client) handshakeAll(ns string, since time.Time, hs ...*seen) []time.Duration {
	c.t.Helper()
	began := time.Now()
	took := make([]time.Duration, len(hs))
	probe := fmt.Sprintf("probe-%d", time.Now().UnixNano())
	for left := len(hs); left > 0; {
		if time.Since(began) > 20*time.Second {
			c.t.Fatalf("the probe reached only %d of %d handlers", len(hs)-left, len(hs))
		}
		// Errors are expected while a restarted daemon comes up.
		_ = c.publish(ns, "/eventmonitor-test/probe", &events.NamespaceUpdate{Name: probe})
		time.Sleep(20 * time.Millisecond) // the probe's period, not a wait for an outcome
		for i, h := range hs {
			if took[i] == 0 && len(h.of(probe)) > 0 {
				took[i] = time.Since(since)
				left--
			}
		}
	}
	return took
}

// subscribeBare subscribes to the daemon's events without the monitor, as
// the measure of what containerd delivers, and records them in a seen.
func subscribeBare(t *testing.T, c *client, filters []string) *seen {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := eventsapi.NewEventsClient(c.conn).Subscribe(ctx, &eventsapi.SubscribeRequest{Filters: filters})
	require.NoError(t, err)
	h, done := &seen{}, make(chan struct{})
	go func() {
		defer close(done)
		for {
			env, err := stream.Recv()
			if err != nil {
				return
			}
			if event, err := typeurl.UnmarshalAny(env.GetEvent()); err == nil {
				_ = h.HandleEvent(ctx, event)
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return h
}

// run starts a monitor on the daemon's stream; cleanup shuts it down.
func run(t *testing.T, c *client, h *seen, filters []string, opts ...eventmonitor.Option) *eventmonitor.Monitor {
	t.Helper()
	m, err := eventmonitor.New(h, append([]eventmonitor.Option{
		eventmonitor.WithConverter(containerd.Converter()),
		eventmonitor.WithWorkers(4),
	}, opts...)...)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx, containerd.NewSubscriber(c.conn), filters...) }()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
		m.Stop()
	})
	return m
}

func TestConverterKeysEveryEventType(t *testing.T) {
	for _, tc := range []struct {
		event any
		key   string
	}{
		{&events.TaskCreate{ContainerID: "c"}, "c"},
		{&events.TaskStart{ContainerID: "c"}, "c"},
		{&events.TaskDelete{ContainerID: "c", ID: "exec"}, "c"},
		{&events.TaskExit{ContainerID: "c", ID: "exec"}, "c"},
		{&events.TaskOOM{ContainerID: "c"}, "c"},
		{&events.TaskExecAdded{ContainerID: "c", ExecID: "e"}, "c"},
		{&events.TaskExecStarted{ContainerID: "c", ExecID: "e"}, "c"},
		{&events.TaskPaused{ContainerID: "c"}, "c"},
		{&events.TaskResumed{ContainerID: "c"}, "c"},
		{&events.TaskCheckpointed{ContainerID: "c"}, "c"},
		{&events.ContainerCreate{ID: "c"}, "c"},
		{&events.ContainerUpdate{ID: "c"}, "c"},
		{&events.ContainerDelete{ID: "c"}, "c"},
		{&events.SandboxCreate{SandboxID: "s"}, "s"},
		{&events.SandboxStart{SandboxID: "s"}, "s"},
		{&events.SandboxExit{SandboxID: "s"}, "s"},
		{&events.ImageCreate{Name: "docker.io/library/busybox:latest"}, "docker.io/library/busybox:latest"},
		{&events.ImageUpdate{Name: "i"}, "i"},
		{&events.ImageDelete{Name: "i"}, "i"},
		{&events.NamespaceCreate{Name: "n"}, "n"},
		{&events.NamespaceUpdate{Name: "n"}, "n"},
		{&events.NamespaceDelete{Name: "n"}, "n"},
		{&events.SnapshotPrepare{Key: "k", Parent: "p"}, "k"},
		{&events.SnapshotCommit{Key: "k", Name: "n"}, "k"},
		{&events.SnapshotRemove{Key: "k"}, "k"},
		{&events.ContentCreate{Digest: "sha256:abc"}, "sha256:abc"},
		{&events.ContentDelete{Digest: "sha256:abc"}, "sha256:abc"},
	} {
		payload, err := typeurl.MarshalAnyToProto(tc.event)
		require.NoError(t, err)
		for range 2 { // the first through typeurl, the second by the URL it learned
			key, event, err := containerd.Converter().Convert(payload)
			require.NoError(t, err, "%T", tc.event)
			assert.Equal(t, tc.key, key, "%T", tc.event)
			assert.True(t, proto.Equal(tc.event.(proto.Message), event.(proto.Message)), "%T: %v", tc.event, event)
		}
	}

	payload, err := typeurl.MarshalAnyToProto(&eventsapi.PublishRequest{Topic: "/x"})
	require.NoError(t, err)
	_, _, err = containerd.Converter().Convert(payload)
	assert.ErrorIs(t, err, eventmonitor.ErrUnsupportedEvent, "a message that is not an event")
}

// Dial says at once why it cannot connect, rather than waiting out its
// timeout and reporting TRANSIENT_FAILURE.
func TestDialErrors(t *testing.T) {
	_, err := containerd.Dial(context.Background(), "")
	assert.ErrorContains(t, err, "empty socket address")

	dir := t.TempDir()
	missing := filepath.Join(dir, "no.sock")
	regular := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(regular, nil, 0o600))
	stale := filepath.Join(dir, "stale.sock") // a socket file nobody listens on
	l, err := net.Listen("unix", stale)
	require.NoError(t, err)
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, l.Close())

	for _, tc := range []struct {
		address string
		is      error
		says    string
	}{
		{missing, fs.ErrNotExist, "no socket at " + missing},
		{regular, nil, regular + " is not a socket (a regular file)"},
		{dir, nil, dir + " is not a socket (a directory)"},
		{stale, syscall.ECONNREFUSED, "cannot open socket " + stale},
	} {
		start := time.Now()
		_, err := containerd.Dial(context.Background(), tc.address)
		require.Error(t, err, tc.address)
		assert.Less(t, time.Since(start), 2*time.Second, "%s: at once, not after the dial timeout", tc.address)
		assert.ErrorContains(t, err, tc.says)
		if tc.is != nil {
			assert.ErrorIs(t, err, tc.is)
		}
		assert.NotErrorIs(t, err, context.DeadlineExceeded, tc.address)
	}
}

func TestFilters(t *testing.T) {
	filters, err := containerd.Filters("k8s.io",
		eventmonitor.KeyOf(func(e *events.TaskExit) string { return e.ContainerID }),
		eventmonitor.KeyOf(func(e *events.SandboxExit) string { return e.SandboxID }))
	require.NoError(t, err)
	assert.Equal(t, []string{
		`namespace=="k8s.io",topic=="/tasks/exit"`,
		`namespace=="k8s.io",topic=="/sandboxes/exit"`,
		`namespace=="k8s.io",topic=="sandboxes/exit"`,
	}, filters)

	filters, err = containerd.Filters("", eventmonitor.KeyOf(func(e *events.ImageCreate) string { return e.Name }))
	require.NoError(t, err)
	assert.Equal(t, []string{`topic=="/images/create"`}, filters)

	_, err = containerd.Filters("", eventmonitor.KeyOf(func(e *eventsapi.PublishRequest) string { return e.Topic }))
	assert.ErrorContains(t, err, "no known topic for *events.PublishRequest")
}

// TestFiltersInDaemon asks the daemon for task exits only: nothing else
// crosses the socket, so nothing is even ignored.
func TestFiltersInDaemon(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, false)
	c := dial(t, d)
	h := &seen{}
	filters, err := containerd.Filters(containerd.K8sNamespace,
		eventmonitor.KeyOf(func(e *events.TaskExit) string { return e.ContainerID }))
	require.NoError(t, err)
	m := run(t, c, h, append(filters, `topic=="/eventmonitor-test/probe"`))
	c.handshake("default", h)
	probes := m.Stats().Received

	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/oom", &events.TaskOOM{ContainerID: "c1"}))
	require.NoError(t, c.publish(containerd.K8sNamespace, "/images/create", &events.ImageCreate{Name: "i"}))
	require.NoError(t, c.publish("other", "/tasks/exit", &events.TaskExit{ContainerID: "c1"}))
	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/exit", &events.TaskExit{ContainerID: "c1", ExitStatus: 3}))
	waitFor(t, "the exit", func() bool { return len(h.of("c1")) == 1 })
	assert.Equal(t, []string{"TaskExit"}, types(h.of("c1")))
	s := m.Stats()
	assert.Equal(t, probes+1, s.Received, "the other events never reached the monitor (a stream is in order)")
	assert.Zero(t, s.Ignored)
	assert.Zero(t, s.Filtered)
}

func TestTaskExitBuilder(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	e := containerd.TaskExit("c1", "c1", 42)(137, at).(*events.TaskExit)
	assert.Equal(t, "c1", e.ContainerID)
	assert.Equal(t, uint32(42), e.Pid)
	assert.Equal(t, uint32(137), e.ExitStatus)
	assert.Equal(t, at, e.ExitedAt.AsTime())
}

// TestEventsFromDaemon publishes events into a real containerd and makes
// others with real API calls: all reach the handler typed and in order per
// key.
func TestEventsFromDaemon(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, false)
	c := dial(t, d)
	h := &seen{}
	m := run(t, c, h, nil)
	c.handshake("default", h)

	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/exit",
		&events.TaskExit{ContainerID: "c1", ID: "c1", Pid: 7, ExitStatus: 3}))
	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/oom", &events.TaskOOM{ContainerID: "c1"}))
	require.NoError(t, c.publish(containerd.K8sNamespace, "/images/delete", &events.ImageDelete{Name: "docker.io/library/busybox:1"}))

	rootfs := t.TempDir()
	d.mustCtr("namespaces", "create", "emtest-api")
	d.mustCtr("-n", "emtest-api", "containers", "create", "--rootfs", rootfs, "api-c", "/bin/true")
	d.mustCtr("-n", "emtest-api", "containers", "label", "api-c", "purpose=test")
	d.mustCtr("-n", "emtest-api", "containers", "delete", "api-c")
	d.mustCtr("namespaces", "remove", "emtest-api")

	waitFor(t, "every event", func() bool {
		return len(h.of("c1")) == 2 && len(h.of("docker.io/library/busybox:1")) == 1 &&
			len(h.of("api-c")) == 3 && len(h.of("emtest-api")) == 2
	})
	exits := h.of("c1")
	assert.Equal(t, []string{"TaskExit", "TaskOOM"}, types(exits))
	exit := exits[0].(*events.TaskExit)
	assert.Equal(t, uint32(3), exit.ExitStatus)
	assert.Equal(t, uint32(7), exit.Pid)
	assert.Equal(t, []string{"ImageDelete"}, types(h.of("docker.io/library/busybox:1")))
	assert.Equal(t, []string{"ContainerCreate", "ContainerUpdate", "ContainerDelete"}, types(h.of("api-c")))
	assert.Equal(t, []string{"NamespaceCreate", "NamespaceDelete"}, types(h.of("emtest-api")))
	assert.Zero(t, m.Stats().Dropped)
}

// TestNamespaceFilters filters by namespace twice: in the daemon, with a
// containerd filter passed through the subscriber, and in the monitor.
func TestNamespaceFilters(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, false)
	c := dial(t, d)

	inDaemon := &seen{}
	run(t, c, inDaemon, []string{`namespace==k8s.io`})
	inMonitor := &seen{}
	m := run(t, c, inMonitor, nil, eventmonitor.WithNamespace(containerd.K8sNamespace))
	c.handshake(containerd.K8sNamespace, inDaemon)
	c.handshake(containerd.K8sNamespace, inMonitor)

	require.NoError(t, c.publish("other", "/tasks/exit", &events.TaskExit{ContainerID: "other-c"}))
	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/exit", &events.TaskExit{ContainerID: "k8s-c"}))
	for _, h := range []*seen{inDaemon, inMonitor} {
		waitFor(t, "the k8s.io event", func() bool { return len(h.of("k8s-c")) == 1 })
		assert.Empty(t, h.of("other-c"))
	}
	// The monitor saw the other namespace's event (published before the
	// k8s.io one, and a stream is in order) and counted it as filtered.
	assert.Equal(t, uint64(1), m.Stats().Filtered)
}

func TestFailingHandlerRetries(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, false)
	c := dial(t, d)
	h := &seen{fail: map[string]int{"c1": 2}}
	m := run(t, c, h, nil, eventmonitor.WithBackoff(10*time.Millisecond, 100*time.Millisecond))
	c.handshake("default", h)

	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/start", &events.TaskStart{ContainerID: "c1", Pid: 1}))
	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/exit", &events.TaskExit{ContainerID: "c1", ExitStatus: 1}))
	waitFor(t, "both events after retries", func() bool { return len(h.of("c1")) == 2 })
	assert.Equal(t, []string{"TaskStart", "TaskExit"}, types(h.of("c1")), "order kept across retries")
	s := m.Stats()
	assert.Equal(t, uint64(2), s.Failed)
	assert.Equal(t, uint64(2), s.Retried)
	assert.Zero(t, s.KeysInBackoff)
}

// TestDaemonRestart kills containerd under a running monitor and starts it
// again: Run re-subscribes by itself, calls the resync hook, and handles
// what is published after the restart.
func TestDaemonRestart(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, false)
	c := dial(t, d)
	h := &seen{}
	var mu sync.Mutex
	resyncs := 0
	m := run(t, c, h, nil,
		eventmonitor.WithResubscribe(20*time.Millisecond, 200*time.Millisecond),
		eventmonitor.WithResync(func(context.Context) error {
			mu.Lock()
			defer mu.Unlock()
			resyncs++
			return nil
		}))
	c.handshake("default", h)
	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/start", &events.TaskStart{ContainerID: "before"}))
	waitFor(t, "the event before the restart", func() bool { return len(h.of("before")) == 1 })

	d.Stop()
	d.restart()
	c.handshake("default", h) // the new subscription is live
	waitFor(t, "the resync after re-subscribing", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return resyncs == 2 // the first subscription's, and the new one's
	})
	assert.Equal(t, uint64(1), m.Stats().Resubscribed, "one outage")

	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/exit", &events.TaskExit{ContainerID: "after", ExitStatus: 9}))
	waitFor(t, "the event after the restart", func() bool { return len(h.of("after")) == 1 })
	assert.Equal(t, uint32(9), h.of("after")[0].(*events.TaskExit).ExitStatus)
}

// TestResubscribesPromptlyAfterALongOutage kills containerd for 10 s and
// starts it again: once the daemon is back, Run re-subscribes within about
// WithResubscribe's maximum delay, 1 s by default:
// with the defaults, over Dial's connection; and with the maximum set to
// 1 s, over Dial's connection and over a plain gRPC connection, whose own
// reconnect backoff (1 s growing by 1.6, next try about 16 s after the
// kill) the subscriber wakes before subscribing.
func TestResubscribesPromptlyAfterALongOutage(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, false)
	explicit := eventmonitor.WithResubscribe(100*time.Millisecond, time.Second)
	byDefault, overDial, overPlain := &seen{}, &seen{}, &seen{}
	run(t, dial(t, d), byDefault, nil)
	run(t, dial(t, d), overDial, nil, explicit)
	plain, err := grpc.NewClient("unix://"+d.Address(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { plain.Close() })
	run(t, &client{t: t, conn: plain}, overPlain, nil, explicit)
	c := dial(t, d)
	c.handshakeAll("default", time.Now(), byDefault, overDial, overPlain)

	const outage = 10 * time.Second
	d.Kill()
	time.Sleep(outage) // the outage itself
	d.restart()
	ready := time.Now()
	c = dial(t, d) // a connection of its own, so that publishing wakes no monitor's
	took := c.handshakeAll("default", ready, byDefault, overDial, overPlain)
	t.Logf("after a %v outage, re-subscribed %v (defaults, Dial), %v (1 s maximum, Dial) and %v (1 s maximum, plain connection) after the daemon was ready",
		outage, took[0].Round(time.Millisecond), took[1].Round(time.Millisecond), took[2].Round(time.Millisecond))
	// Run tries at most its maximum delay apart (plus up to 200 ms giving
	// the connection a chance to come up), and a probe goes out every 20 ms:
	// the new subscription is seen within the maximum and a little. With the
	// defaults that is 1.5 s, the default maximum being 1 s; were it
	// longer, so would the wait be (30 s measured 2.6 to 3.7 s here).
	assert.Less(t, took[0], time.Second+500*time.Millisecond, "with the defaults")
	assert.Less(t, took[1], 1500*time.Millisecond, "over Dial's connection")
	assert.Less(t, took[2], 1500*time.Millisecond, "over a plain connection")
}

// TestRealContainerExit runs a real container whose process exits with 42
// and checks that the monitor handles the task events containerd delivers,
// all of them and in order: the same as a bare subscription beside it
// receives, the exit with its status among them.
//
// The bare subscription is the measure because containerd does not
// guarantee a task's end events. The shim publishes TaskCreate, TaskStart
// and TaskExit through its own queue, in that order; the daemon publishes
// TaskDelete itself when the task is deleted, which `ctr run --rm` does as
// soon as Wait returns. So TaskDelete may reach subscribers before
// TaskExit, and under load either may never come: the shim can be gone
// before its queued TaskExit is forwarded, and a delete that races the
// shim's exit ends in the daemon's dead-shim cleanup, which publishes
// nothing for a task already removed (see the package doc). Once, under
// CI's load, neither came within 20 s.
func TestRealContainerExit(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, true)
	rootfs, err := d.Rootfs()
	require.NoError(t, err)
	c := dial(t, d)
	filters := []string{`topic~="/tasks/"`, `topic=="/eventmonitor-test/probe"`}
	h, bare := &seen{}, subscribeBare(t, c, filters)
	run(t, c, h, filters)
	c.handshakeAll("default", time.Now(), h, bare)

	args := append([]string{"-n", "emtest-exit", "run", "--rm", "--rootfs", rootfs, "exit42"},
		containerdtest.Process{ExitCode: 42}.Args()...)
	out, err := d.Ctr(args...)
	var exitErr *exec.ExitError
	require.True(t, errors.As(err, &exitErr), "ctr run: %v: %s\ndaemon log:\n%s", err, out, d.Log())
	require.Equal(t, 42, exitErr.ExitCode(), "ctr reports the container's exit code")
	// Both end events, if they come, come within moments; either may not.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		if got := types(bare.of("exit42")); slices.Contains(got, "TaskExit") && slices.Contains(got, "TaskDelete") {
			break
		}
		time.Sleep(5 * time.Millisecond) // polling for events that may never come, with a deadline
	}
	waitFor(t, "the monitor to handle what the bare subscription received", func() bool {
		return slices.Equal(types(bare.of("exit42")), types(h.of("exit42")))
	})

	evs := h.of("exit42")
	got := types(evs)
	byType := map[string]any{}
	for i, e := range evs {
		byType[got[i]] = e
	}
	var statuses []string
	if e, ok := byType["TaskExit"].(*events.TaskExit); ok {
		statuses = append(statuses, fmt.Sprint("exit ", e.ExitStatus))
		assert.Equal(t, uint32(42), e.ExitStatus)
		assert.Equal(t, byType["TaskStart"].(*events.TaskStart).Pid, e.Pid)
	}
	if e, ok := byType["TaskDelete"].(*events.TaskDelete); ok {
		statuses = append(statuses, fmt.Sprint("delete ", e.ExitStatus))
	}
	t.Logf("task events in the order they arrived: %v (%s)", got, strings.Join(statuses, ", "))
	shim := slices.DeleteFunc(slices.Clone(got), func(s string) bool { return s == "TaskDelete" })
	assert.Equal(t, []string{"TaskCreate", "TaskStart"}, shim[:min(2, len(shim))], "the shim's own events keep their order")
	assert.LessOrEqual(t, len(got), 4, "no task event twice")
}

func TestSandboxExitBuilder(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	e := containerd.SandboxExit("s1")(137, at).(*events.SandboxExit)
	assert.Equal(t, "s1", e.SandboxID)
	assert.Equal(t, uint32(137), e.ExitStatus)
	assert.Equal(t, at, e.ExitedAt.AsTime())
	assert.Equal(t, "s1", keyOf(e), "keyed by Converter as the sandbox")
}
