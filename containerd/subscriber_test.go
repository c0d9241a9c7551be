package containerd_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	apitypes "github.com/containerd/containerd/api/types"
	"github.com/sirupsen/logrus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

// oneEvent is containerd's events service delivering one envelope to each
// subscriber.
type oneEvent struct {
	eventsapi.UnimplementedEventsServer
}

func (oneEvent) Subscribe(_ *eventsapi.SubscribeRequest, stream eventsapi.Events_SubscribeServer) error {
	if err := stream.Send(&eventsapi.Envelope{Topic: "/x"}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

// TestSubscribeRightAfterTheDaemonIsBack subscribes once, over a
// connection whose last attempt failed, right after a daemon is listening
// again. Waking the connection's reconnection alone is not enough: until
// the new attempt succeeds, gRPC fails calls at once with the error of the
// attempt before, and Run would wait a whole resubscribe delay for nothing.
// The subscription must come through the first time.
func TestSubscribeRightAfterTheDaemonIsBack(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "ems")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket := filepath.Join(dir, "events.sock")
	// A plain connection, whose reconnect backoff is gRPC's default (1 s
	// and more): without the wake, its next attempt would come too late.
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	sub := containerd.NewSubscriber(conn)

	// Nobody listens: the subscription fails and the connection with it.
	ctx, cancel := context.WithCancel(context.Background())
	_, errs := sub.Subscribe(ctx)
	require.Error(t, <-errs)
	cancel()
	// gRPC may already be connecting again (TransientFailure or Connecting,
	// by its own timing): what matters is that it is not ready.
	require.NotEqual(t, connectivity.Ready, conn.GetState())

	l, err := net.Listen("unix", socket)
	require.NoError(t, err)
	srv := grpc.NewServer()
	eventsapi.RegisterEventsServer(srv, oneEvent{})
	go srv.Serve(l)
	t.Cleanup(srv.Stop)

	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	ch, errs := sub.Subscribe(ctx)
	select {
	case env := <-ch:
		require.NotNil(t, env)
		require.Equal(t, "/x", env.Topic)
	case err := <-errs:
		t.Fatalf("the first subscription after the daemon was back failed: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no envelope within 10 s")
	}
}

// failingStreamConn is a gRPC connection whose one events stream delivers n
// envelopes and then fails, as a daemon killed under load does.
type failingStreamConn struct{ n int }

func (c failingStreamConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	return status.Error(codes.Unimplemented, "no unary calls")
}

func (c failingStreamConn) NewStream(ctx context.Context, _ *grpc.StreamDesc, _ string, _ ...grpc.CallOption) (grpc.ClientStream, error) {
	return &failingStream{ctx: ctx, n: c.n}, nil
}

type failingStream struct {
	ctx  context.Context
	n, i int
}

func (s *failingStream) Header() (metadata.MD, error) { return nil, nil }
func (s *failingStream) Trailer() metadata.MD         { return nil }
func (s *failingStream) CloseSend() error             { return nil }
func (s *failingStream) Context() context.Context     { return s.ctx }
func (s *failingStream) SendMsg(any) error            { return nil }
func (s *failingStream) RecvMsg(m any) error {
	if s.i == s.n {
		return status.Error(codes.Unavailable, "error reading from server: EOF")
	}
	a, err := anypb.New(wrapperspb.String(fmt.Sprintf("c%d", s.i)))
	if err != nil {
		return err
	}
	s.i++
	env := m.(*apitypes.Envelope)
	env.Namespace, env.Topic, env.Event = "k8s.io", "/tasks/exit", a
	return nil
}

func subscriberGoroutineAlive() bool {
	buf := make([]byte, 1<<20)
	return strings.Contains(string(buf[:runtime.Stack(buf, true)]), "containerd.(*subscriber).Subscribe.func1")
}

// While the monitor's intake limit holds its reader back, NewSubscriber's
// buffer fills; then the daemon goes away. The stream's error comes behind
// the envelopes buffered, and the monitor reads them all before it.
func TestEnvelopesBufferedBeforeTheDaemonWentAreRead(t *testing.T) {
	const n = 20
	release := make(chan struct{})
	var once sync.Once
	handler := eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		<-release
		return nil
	})
	var drops []eventmonitor.Drop
	var mu sync.Mutex
	m, err := eventmonitor.New(handler,
		eventmonitor.WithConverter(eventmonitor.NewConverter(
			eventmonitor.KeyOf(func(v *wrapperspb.StringValue) string { return v.GetValue() }))),
		eventmonitor.WithIntakeLimit(1),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) { mu.Lock(); drops = append(drops, d); mu.Unlock() }))
	require.NoError(t, err)
	defer m.Stop()
	defer once.Do(func() { close(release) })

	m.Subscribe(containerd.NewSubscriber(failingStreamConn{n: n}))
	errCh := m.Start()
	// The reader is held back by the intake limit; the subscriber's
	// goroutine buffers the rest, sees the error, sends it and ends.
	require.Eventually(t, func() bool { return !subscriberGoroutineAlive() }, 10*time.Second, time.Millisecond)
	once.Do(func() { close(release) })
	select {
	case err := <-errCh:
		require.Error(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Start's channel never reported the stream's error")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, m.WaitIdle(ctx))
	s := m.Stats()
	mu.Lock()
	defer mu.Unlock()
	assert.EqualValues(t, n, s.Received, "the daemon delivered %d envelopes before failing; the monitor read %d (drops: %d)",
		n, s.Received, len(drops))
}

// Run relists (WithResync) once a subscription is established, that is, it
// delivered or was not refused within the initial resubscribe delay (100
// ms by default). NewSubscriber waits up to connectWait (200 ms) for the
// connection, so it must report a refusal as Subscribe returns: otherwise
// every attempt against a daemon that is down counts as established.
func TestNoResyncWhileTheDaemonIsDown(t *testing.T) {
	dir := t.TempDir()
	conn, err := grpc.NewClient("unix://"+dir+"/missing.sock", grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	var mu sync.Mutex
	resyncs := 0
	m, err := eventmonitor.New(eventmonitor.HandlerFunc(func(context.Context, any) error { return nil }),
		eventmonitor.WithConverter(containerd.Converter()),
		eventmonitor.WithLogger(logrus.NewEntry(&logrus.Logger{Out: io.Discard, Formatter: new(logrus.TextFormatter), Level: logrus.PanicLevel})),
		eventmonitor.WithResync(func(ctx context.Context) error {
			mu.Lock()
			resyncs++
			mu.Unlock()
			return errors.New("relist: daemon unreachable")
		}))
	require.NoError(t, err)
	defer m.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	var attempts atomic.Int32
	sub := containerd.NewSubscriber(conn)
	go func() {
		ran <- m.Run(ctx, eventmonitor.SubscriberFunc(func(ctx context.Context, filters ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
			attempts.Add(1)
			return sub.Subscribe(ctx, filters...)
		}))
	}()
	const tries = 3 // each one a chance to take the refusal for an established subscription
	require.Eventually(t, func() bool { return attempts.Load() >= tries }, 30*time.Second, time.Millisecond,
		"Run did not try to subscribe %d times against a missing daemon", tries)
	cancel()
	require.NoError(t, <-ran)
	mu.Lock()
	defer mu.Unlock()
	assert.Zero(t, resyncs, "the daemon never came back: no subscription was established, yet the hook relisted")
	assert.Zero(t, m.Stats().Resubscribed)
}

// A daemon that accepts the socket but does not answer (hung, or still
// starting its gRPC server) keeps the connection connecting, and opening
// a stream on it blocks for gRPC's connect timeout (20 s). Subscribe, which
// Monitor.Subscribe and Run call on their goroutine, returns in 400 ms.
func TestSubscribeDoesNotWaitForAHungDaemon(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "hung.sock")
	l, err := net.Listen("unix", sock)
	require.NoError(t, err)
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close() // accepted, never answered
		}
	}()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	_, errs := containerd.NewSubscriber(conn).Subscribe(ctx)
	took := time.Since(start)
	cancel()
	for range errs {
	}
	require.Less(t, took, time.Second, "Subscribe returned after %v", took)
}
